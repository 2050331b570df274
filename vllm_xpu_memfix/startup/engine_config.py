"""The start-up model's engine arguments from vLLM's resolved configuration (the
``VllmConfig`` that ``EngineArgs.create_engine_config`` returns): what vLLM will run,
defaults filled and flags resolved, rather than the flags as given."""

from __future__ import annotations

from typing import Any

from vllm_xpu_memfix.startup import kv_layout
from vllm_xpu_memfix.startup.sizing import ServeArgs


def serve_args(vllm_config: Any, not_modelled: tuple[str, ...] = ()) -> ServeArgs:
    """The engine arguments the start-up model reads, from the engine's resolved
    configuration (its checks passed: ``refused`` is empty); ``not_modelled``: the flags the
    user set that the model does not cover."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    offload = getattr(getattr(vllm_config, "offload_config", None), "uva", None)
    kv_bytes = getattr(cache, "kv_cache_memory_bytes", None)
    fitted = getattr(model, "original_max_model_len", None) == -1
    return ServeArgs(
        model=str(model.model),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        gpu_memory_utilization=float(cache.gpu_memory_utilization),
        quantization=model.quantization,
        dtype=str(model.dtype).removeprefix("torch."),
        max_parallel_loading_workers=getattr(parallel, "max_parallel_loading_workers", None),
        max_model_len=None if fitted else getattr(model, "max_model_len", None),
        max_num_seqs=getattr(sched, "max_num_seqs", None),
        max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None),
        kv_cache_memory_bytes=int(kv_bytes) if kv_bytes else None,
        kv_cache_dtype=getattr(cache, "cache_dtype", None),
        max_model_len_fitted=fitted,
        pipeline_parallel_size=int(parallel.pipeline_parallel_size),
        data_parallel_size=int(parallel.data_parallel_size),
        data_parallel_size_local=getattr(parallel, "data_parallel_size_local", None),
        nnodes=int(getattr(parallel, "nnodes", 1)),
        node_rank=int(getattr(parallel, "node_rank", 0)),
        enable_expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)),
        distributed_executor_backend=_backend_name(parallel.distributed_executor_backend),
        cpu_offload_gb=float(getattr(offload, "cpu_offload_gb", 0) or 0),
        not_modelled=not_modelled,
        refused=(),
        kv_layout=_kv_layout(vllm_config),
    )


def _kv_layout(vllm_config: Any) -> kv_layout.KvLayout | None:
    """The KV cache as this configuration lays it out; None (config.json's rules then)
    where this vLLM lacks a field the layout reads, or its model class a state rule."""
    try:
        return kv_layout.from_vllm(vllm_config)
    except Exception:  # another vLLM version's config: never into vLLM
        return None


def _backend_name(backend: Any) -> str | None:
    return backend if backend is None or isinstance(backend, str) else type(backend).__name__
