"""What the start-up model covers: every field of vLLM's ``EngineArgs`` classified once.

- ``MODELLED``: the model reads it (``sizing.ServeArgs``).
- ``NO_MEMORY_EFFECT``: it changes no memory the model judges (names, logging, ports,
  timeouts, scheduling order, tokenizer).
- not modelled, with the side it changes: ``host``, ``device`` or both. A failure on that
  side, in a phase the field could lower (``reach`` says, phase by phase, which way each
  field can move memory), is judged at most "at risk", naming it.

The fields are those of the installed vLLM 0.32.0 and of 0.34.0's ``vllm/engine/
arg_utils.py`` (the 0.34-only ones marked); a test fails on a field not classified here.
``doctor``'s serve line and the preflight both name the not-modelled ones through
:func:`flag_of` and :func:`not_modelled`, so they name the same.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from vllm_xpu_memfix.startup.codes import DEVICE, HOST

MODELLED = "modelled"
NO_MEMORY_EFFECT = "no memory effect"
BOTH = "host and device"
NOT_MODELLED_SIDES = (HOST, DEVICE, BOTH)


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_MODELLED = _names(
    """model tensor_parallel_size gpu_memory_utilization quantization dtype max_model_len
    max_num_seqs max_num_batched_tokens kv_cache_memory_bytes max_parallel_loading_workers
    kv_cache_dtype pipeline_parallel_size data_parallel_size data_parallel_size_local nnodes
    node_rank enable_expert_parallel distributed_executor_backend cpu_offload_gb"""
)
_NO_EFFECT = _names(
    """return_sampling_mask served_model_name tokenizer skip_tokenizer_init
    enable_prompt_embeds tokenizer_mode trust_remote_code allowed_local_media_path
    allowed_media_domains download_dir config_format seed ir_op_priority master_addr
    master_port distributed_timeout_seconds cpu_distributed_timeout_seconds numa_bind
    numa_bind_nodes numa_bind_cpus dcp_comm_backend dcp_kv_cache_interleave_size
    cp_kv_cache_interleave_size data_parallel_address data_parallel_rpc_port
    data_parallel_hybrid_lb data_parallel_multi_port_external_lb dbo_decode_token_threshold
    dp_sync_interval dbo_prefill_token_threshold disable_nccl_for_dp_synchronization
    expert_placement_strategy _api_process_count _api_process_rank block_size
    enable_prefix_caching prefix_caching_hash_algo prefix_cache_retention_interval
    disable_cascade_attn long_prefill_token_threshold long_prefill_token_threshold_adaptive
    max_num_queued_reqs max_num_queued_tokens logprobs_mode enable_trace_replay
    disable_log_stats aggregate_engine_logging code_revision hf_token tokenizer_revision
    allow_deprecated_quantization enable_mm_embeds interleave_mm_strings media_io_kwargs
    mm_hasher_algorithm mm_encoder_fp8_scale_save_path mm_encoder_fp8_scale_save_margin
    io_processor_plugin video_pruning_rate video_pruning_method mm_device_do_normalize
    ray_workers_use_nsight ignore_patterns disable_chunked_mm_input scheduler_reserve_full_isl
    prefill_schedule_interval watermark structured_outputs_config aux_output_config
    reasoning_parser reasoning_parser_plugin watermark_config show_hidden_metrics_for_version
    otlp_traces_endpoint collect_detailed_traces per_request_spec_decode_metrics
    kv_cache_metrics kv_cache_metrics_sample custom_histogram_buckets cudagraph_metrics
    enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details
    jit_monitor_mode jit_monitor_verbose enable_mm_processor_stats scheduling_policy
    scheduler_cls profiler_config logging_config log_level log_config_file kv_events_config
    reasoning_config generation_config enable_nccl_comm_suspend override_generation_config
    prefix_match_unit mamba_ssu_algorithm enable_mamba_cache_stochastic_rounding
    mamba_cache_philox_rounds use_tqdm_on_load stream_interval fault_tolerance_config
    enable_fault_tolerance tokens_only shutdown_timeout fail_on_environ_validation
    cache_aware_admission_window cache_aware_admission_threshold shuffle_safetensors_files
    watchdog_config"""
)
_NOT_MODELLED = {
    HOST: _names(
        """safetensors_load_strategy safetensors_prefetch_num_threads
        safetensors_prefetch_block_size enable_shm_tensor_arena mm_processor_cache_gb
        mm_processor_cache_type mm_shm_cache_max_object_size_mb renderer_num_workers
        max_cpu_loras kv_offloading_size kv_offloading_backend max_num_inflight_kv_loads
        checkpoint_prepare_on_startup api_server_count"""
    ),
    DEVICE: _names(
        """enable_return_routed_experts runner convert cudagraph_capture_sizes
        max_cudagraph_capture_size device_ids dcp_q_replicate enable_hc_sp
         enable_batch_sharded_sampling enable_ep_weight_filter
        moe_backend linear_backend sparse_indexer_topk_backend all2all_backend
        enable_elastic_ep elastic_ep_max_dp_size enable_dbo ubatch_size eplb_config
        enable_eplb disable_sliding_window max_num_scheduled_tokens max_num_active_seqs
        max_logprobs use_fp64_gumbel model_class_overrides enforce_eager
        disable_custom_all_reduce language_model_only limit_mm_per_prompt mm_processor_kwargs
        mm_encoder_only mm_encoder_tp_mode mm_encoder_attn_backend mm_encoder_attn_dtype
        mm_encoder_fp8_scale_path skip_mm_profiling mm_processor_device mm_ipc_gpu_memory_gb
        enable_lora max_loras max_lora_rank default_mm_loras fully_sharded_loras lora_dtype
        lora_target_modules enable_tower_connector_lora specialize_active_lora
        enable_mixed_moe_lora_format enable_moe_shared_loras max_lora_cls_labels
        num_gpu_blocks_override enable_chunked_prefill disable_hybrid_kv_cache_manager
        speculative_config spec_method spec_model spec_tokens diffusion_config pooler_config
        compilation_config attention_config engram_config mamba_config kernel_config
        enable_flashinfer_autotune enable_cumem_allocator model_impl attention_backend
        kv_cache_dtype_skip_layers mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size
        mamba_cache_mode enable_mamba_shared_prefix_checkpoint replayssm_buffer_len
        use_replayssm mamba_backend logits_processors async_scheduling kv_sharing_fast_prefill
        swa_bounded_replay optimization_level performance_mode gdn_prefill_backend
        kda_prefill_backend kda_decode_backend enable_extensible_kv_cache monokernel"""
    ),
    BOTH: _names(
        """model_weights hf_config_path load_format prefill_context_parallel_size
        decode_context_parallel_size data_parallel_rank data_parallel_start_rank
        data_parallel_external_lb data_parallel_backend offload_backend cpu_offload_params
        offload_group_size offload_num_in_group offload_prefetch_step offload_params revision
        hf_overrides quantization_config mm_tensor_ipc model_loader_extra_config worker_cls
        worker_extension_cls kv_transfer_config ec_transfer_config ec_manager_config
        enable_sleep_mode sleep_mode_offload_cudagraph sleep_preserve_parameter_names
        additional_config pt_load_map_location weight_transfer_config sleep_mode_backend"""
    ),
}
# Fields of vLLM 0.34.0's EngineArgs that 0.32.0 does not have (its arg_utils.py).
ONLY_IN_0_34 = _names(
    """enable_extensible_kv_cache max_num_inflight_kv_loads cache_aware_admission_window
    cache_aware_admission_threshold monokernel sleep_mode_backend
    checkpoint_prepare_on_startup shuffle_safetensors_files watchdog_config"""
)
# The API server's own flags are not EngineArgs fields and change no memory the model
# judges, but for this one (each API server process is a Python process on the host).
FRONTEND = ("api_server_count",)


def _table() -> dict[str, str]:
    table: dict[str, str] = {}
    groups = [(MODELLED, _MODELLED), (NO_MEMORY_EFFECT, _NO_EFFECT)]
    for group in [*groups, *_NOT_MODELLED.items()]:
        kind, names = group
        for name in names:
            if name in table:
                raise AssertionError(f"{name} is classified twice")
            table[name] = kind
    return table


# field -> MODELLED, NO_MEMORY_EFFECT, or the side (host, device, both) it is not modelled on
DOMAIN: dict[str, str] = _table()

# vLLM's short serve flags (vllm/entrypoints/launchers/cli_args.py and arg_utils.py, 0.32.0)
# and its other spelling of one long flag.
ALIASES = {
    "-q": "quantization",
    "-tp": "tensor_parallel_size",
    "-pp": "pipeline_parallel_size",
    "-n": "nnodes",
    "-r": "node_rank",
    "-dcp": "decode_context_parallel_size",
    "-pcp": "prefill_context_parallel_size",
    "-dp": "data_parallel_size",
    "-dpn": "data_parallel_rank",
    "-dpr": "data_parallel_start_rank",
    "-dpl": "data_parallel_size_local",
    "-dpa": "data_parallel_address",
    "-dpp": "data_parallel_rpc_port",
    "-dpb": "data_parallel_backend",
    "-dph": "data_parallel_hybrid_lb",
    "-dpe": "data_parallel_external_lb",
    "-dpm": "data_parallel_multi_port_external_lb",
    "-ep": "enable_expert_parallel",
    "-sc": "speculative_config",
    "-dc": "diffusion_config",
    "-cc": "compilation_config",
    "-ac": "attention_config",
    "-asc": "api_server_count",
    "--device-memory-utilization": "gpu_memory_utilization",
}


def field_of(flag: str) -> str | None:
    """The EngineArgs field (or FRONTEND flag) a serve flag sets; None where it sets none
    this table knows (another of the API server's flags, or a typo)."""
    if flag in ALIASES:
        return ALIASES[flag]
    name = flag.removeprefix("--").replace("-", "_")
    if not flag.startswith("--"):
        return None
    if name not in DOMAIN and name.startswith("no_") and name[3:] in DOMAIN:
        name = name[3:]
    return name if name in DOMAIN else None


def flag_of(name: str) -> str:
    """The serve flag of an EngineArgs field."""
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, separators=(",", ":"), default=str)
    except ValueError:  # a circular value
        text = repr(value)
    text = text if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_default(value: Any, spec: dataclasses.Field[Any]) -> bool:
    """Whether ``value`` is the field's default; one that cannot be built or compared is
    taken as the default (the preflight must never fail on a field it does not judge)."""
    try:
        if value is None or (isinstance(value, str) and not value):
            return True  # vLLM's parser gives None (or "") for a flag not given
        if spec.default is not dataclasses.MISSING:
            return bool(value == spec.default)
        if spec.default_factory is not dataclasses.MISSING:
            return bool(value == spec.default_factory())
    except Exception:
        return True
    return True


def not_modelled(engine_args: Any) -> tuple[str, ...]:
    """The not-modelled fields of ``engine_args`` (vLLM's EngineArgs) set away from their
    dataclass default, as serve flags with their value: ``--pipeline-parallel-size 2``."""
    return flags_set(
        {
            spec.name: value
            for spec in dataclasses.fields(engine_args)
            if not _is_default(value := getattr(engine_args, spec.name, None), spec)
        }
    )


def flags_set(values: Mapping[str, Any]) -> tuple[str, ...]:
    """The not-modelled fields among ``values`` (each set away from its default), as serve
    flags with their value."""
    found = []
    for name, value in values.items():
        if DOMAIN.get(name, MODELLED) in (MODELLED, NO_MEMORY_EFFECT):
            continue
        flag = flag_of(name)
        if isinstance(value, bool):
            found.append(flag if value else "--no-" + flag[2:])
        else:
            found.append(f"{flag} {_shown(value)}")
    return tuple(found)


def side_of(flag_with_value: str) -> str | None:
    """The side a not-modelled flag (as :func:`not_modelled` or doctor names it) changes:
    host, device or both; None for one this table does not know."""
    name = field_of(flag_with_value.split("=", 1)[0].split(" ", 1)[0])
    kind = DOMAIN.get(name or "")
    return kind if kind in NOT_MODELLED_SIDES else None


def covered(kind: str) -> tuple[str, ...]:
    """The fields of one class, as serve flags, sorted: for docs/doctor.md."""
    return tuple(sorted(flag_of(name) for name, k in DOMAIN.items() if k == kind))
