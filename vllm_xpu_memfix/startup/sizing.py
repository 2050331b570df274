"""The start-up model's inputs from what was read: the checkpoint, the engine's arguments
(a pasted serve line, doctor's flags, or the engine's own configuration) and the machine
(this one, or one described in a file). Reads nothing itself."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_xpu_memfix.intel import catalog, driver, driver_facts
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config
from vllm_xpu_memfix.memory.estimate import BurstShape, estimate_sampler_burst
from vllm_xpu_memfix.startup import phases, reserve

# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = {"sym_int4", "fp8", "int4", "woq_int4"}
INT4 = {"sym_int4", "int4", "woq_int4"}
# Checkpoints quantized ahead of time: device bytes per linear weight element (4-bit with
# a 16-bit scale per group of 128, or 8-bit), by the method config.json names
# (quantization_config.quant_method) or the suffix of the model's name.
PREQUANTIZED_BYTES = {
    "fp8": 1.0,
    "w8a8": 1.0,
    "int8": 1.0,
    "awq": catalog.ONE_LAYOUT,
    "gptq": catalog.ONE_LAYOUT,
    "int4": catalog.ONE_LAYOUT,
    "w4a16": catalog.ONE_LAYOUT,
    "compressed-tensors": None,  # the scheme says which: read the tensors, else unknown
}
_NAME_FORMAT = re.compile(r"[-_.](fp8|awq|gptq|int4|w4a16|w8a8|int8)(?=$|[-_.])", re.IGNORECASE)
# vLLM's `vllm serve` defaults where the line does not give them (EngineArgs: 256
# sequences outside the large data-centre GPUs; 8192 batched tokens for the API server).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_BATCHED_TOKENS = 8192
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}
FLAG_DTYPES = {"auto": 0, "float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.\d+\.(?P<proj>\w+)\.weight$")
_SIDE = {
    "gate_proj": "w13",
    "up_proj": "w13",
    "w1": "w13",
    "w3": "w13",
    "down_proj": "w2",
    "w2": "w2",
}


@dataclass(frozen=True)
class ServeArgs:
    """The engine arguments the model reads, as given (None: vLLM's default)."""

    model: str | None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.92
    quantization: str | None = None
    dtype: str | None = None
    device_memory_gib: float | None = None
    max_parallel_loading_workers: int | None = None
    params: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str | None = None
    # -1 or "auto": vLLM fits the context to the KV cache (max_model_len then None).
    max_model_len_fitted: bool = False
    # The parallel layout: this node's share is what the host and its GPUs hold.
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None
    cpu_offload_gb: float = 0.0
    # Flags of a pasted serve line (or EngineArgs fields, in the preflight) set away from
    # their default that the model does not cover, as given.
    not_modelled: tuple[str, ...] = ()


@dataclass(frozen=True)
class Machine:
    """What the model needs of the machine that will serve: read from this one, or from a
    host file. ``room`` None: not known (the host side is then not judged)."""

    gpus_visible: int
    battlemage_visible: int
    device_bytes: float | None
    runtime: driver.Runtime | None
    kernel: driver.Kernel | None
    # The serving processes' environment, with what the driver guard sets there.
    environ: Mapping[str, str] = field(default_factory=dict)
    room: float | None = None
    swap: float = 0.0
    p2p: bool | None = None
    plugin: bool = True
    kv_headroom: bool = False
    kv_headroom_slack: float = reserve.DEFAULT_SLACK
    load_slots: int | None = None
    legacy_load: tuple[bool, str] = (False, "")
    int4_layouts: int = 1


def checkpoint_format(ckpt: Checkpoint | None, name: str | None) -> tuple[str | None, str]:
    """The format a checkpoint was quantized to ahead of time, and where that was read:
    config.json's ``quantization_config``, else the model's name (then assumed)."""
    if ckpt is not None:
        quant = text_config(ckpt.config).get("quantization_config") or ckpt.config.get(
            "quantization_config"
        )
        if isinstance(quant, dict) and isinstance(quant.get("quant_method"), str):
            return quant["quant_method"].lower(), "config.json quantization_config"
    match = _NAME_FORMAT.search(name or "")
    if match:
        return match.group(1).lower(), f"assumed from the model's name ({match.group(0)[1:]})"
    return None, ""


def _config_int(section: dict[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that holds a positive integer."""
    for key in keys:
        value = section.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _largest_from_config(config: dict[str, Any]) -> tuple[float, str]:
    """The largest staged unit from config.json's sizes, where no tensor header was read."""
    text = text_config(config)
    hidden = _config_int(text, "hidden_size")
    if hidden is None:
        return 0.0, "no linear layer known (neither tensor headers nor config sizes)"
    linear = float(hidden * (_config_int(text, "intermediate_size") or hidden))
    experts = _config_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    expert_inter = _config_int(text, "moe_intermediate_size")
    if experts and expert_inter and 2 * experts * expert_inter * hidden > linear:
        return float(2 * experts * expert_inter * hidden), "an MoE side (from config.json)"
    return linear, "a linear layer (from config.json)"


def params_from_config(config: dict[str, Any]) -> int | None:
    """A dense model's parameters from config.json's sizes, where no weights can be read:
    the embedding (and an untied head), then per layer the attention projections and a
    gated MLP. None for an MoE model or where a size is missing."""
    text = text_config(config)
    hidden = _config_int(text, "hidden_size")
    layers = _config_int(text, "num_hidden_layers")
    vocab = _config_int(text, "vocab_size")
    inter = _config_int(text, "intermediate_size")
    heads = _config_int(text, "num_attention_heads")
    if not (hidden and layers and vocab and inter and heads) or _config_int(
        text, "num_experts", "num_local_experts", "n_routed_experts"
    ):
        return None
    head_dim = _config_int(text, "head_dim") or hidden // heads
    kv_heads = _config_int(text, "num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    embeddings = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + 3 * hidden * inter)


def largest_staged_params(ckpt: Checkpoint) -> tuple[float, str]:
    """Parameters of the largest unit quantized at once: a Linear weight, or one MoE side
    (all experts' gate+up, or all experts' down, of one layer)."""
    if not ckpt.tensors:
        return _largest_from_config(ckpt.config)
    linear = 0.0
    sides: dict[tuple[str, str], float] = {}
    for tensor in ckpt.tensors:
        if not tensor.is_linear_weight:
            continue
        params = tensor.nbytes / (2 if tensor.dtype in ("BF16", "F16") else 4)
        match = _EXPERT.match(tensor.name)
        which = _SIDE.get(match.group("proj")) if match else None
        if match and which:
            key = (match.group("layer"), which)
            sides[key] = sides.get(key, 0.0) + params
        else:
            linear = max(linear, params)
    largest_side = max(sides.values(), default=0.0)
    if largest_side > linear:
        return largest_side, "an MoE side"
    return linear, "a linear layer"


def _split_weights(ckpt: Checkpoint) -> tuple[float, float]:
    """(16-bit linear params, bytes of everything else). Without tensor headers every
    16-bit weight is taken for a linear layer."""
    total = float(ckpt.total_bytes)
    if ckpt.tensors:
        linear = sum(
            t.nbytes / 2 for t in ckpt.tensors if t.is_linear_weight and t.dtype in ("BF16", "F16")
        )
    else:
        linear = total / 2 if ckpt.dtype in ("BF16", "F16") else 0.0
    return linear, total - 2 * linear


def _bytes_per_weight(machine: Machine, quant: str, ckpt: Checkpoint, args: ServeArgs) -> float:
    if quant in INT4:
        return catalog.TWO_LAYOUTS if machine.int4_layouts == 2 else catalog.ONE_LAYOUT
    if quant == "fp8":
        return 1.0
    prequantized = PREQUANTIZED_BYTES.get(quant)
    if prequantized:
        return prequantized
    return float(FLAG_DTYPES.get((args.dtype or "").removeprefix("torch."), 0)) or float(
        _DTYPE_BYTES.get(ckpt.dtype, 2)
    )


def _logits_bytes(args: ServeArgs, ckpt: Checkpoint | None) -> int:
    flag = FLAG_DTYPES.get((args.dtype or "").removeprefix("torch."))
    return flag or (_DTYPE_BYTES.get(ckpt.dtype, 2) if ckpt else 2)


def _kv_bytes_per_token(text: dict[str, Any], args: ServeArgs, dtype: int) -> float | None:
    """Per rank: K and V of every attention layer (only the full-attention ones of a
    hybrid model that lists them in ``layer_types``)."""
    layers = _config_int(text, "num_hidden_layers")
    heads = _config_int(text, "num_attention_heads")
    kv_heads = _config_int(text, "num_key_value_heads") or heads
    hidden = _config_int(text, "hidden_size")
    if not (layers and heads and kv_heads and hidden):
        return None
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        layers = sum(1 for t in types if t == "full_attention") or layers
    head_dim = _config_int(text, "head_dim") or hidden // heads
    kv_dtype = (args.kv_cache_dtype or "auto").lower()
    size = 1 if kv_dtype.startswith("fp8") else dtype
    per_rank_heads = max(1.0, kv_heads / args.tensor_parallel_size)
    return 2.0 * layers * per_rank_heads * head_dim * size


def _forward(ckpt: Checkpoint | None, args: ServeArgs) -> tuple[float, Any, float | None]:
    """(activation bytes per rank, the sampler burst, KV bytes per token per rank)."""
    text = text_config(ckpt.config) if ckpt else {}
    dtype = _logits_bytes(args, ckpt)
    tokens = args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    hidden = _config_int(text, "hidden_size")
    inter = _config_int(text, "intermediate_size", "moe_intermediate_size") or 0
    tp = args.tensor_parallel_size
    activations = float(tokens * (4 * hidden + 2 * inter / tp) * dtype) if hidden else 0.0
    vocab = _config_int(text, "vocab_size")
    burst = None
    if vocab:
        try:
            shape = BurstShape(
                num_reqs=min(args.max_num_seqs or DEFAULT_MAX_NUM_SEQS, tokens),
                vocab_size=vocab,
                logits_dtype_bytes=dtype,
                tp_size=tp,
                hidden_size=hidden or 0,
            )
            burst = estimate_sampler_burst(shape)
        except ValueError:
            burst = None
    return activations, burst, _kv_bytes_per_token(text, args, dtype)


def _load_mode(machine: Machine, args: ServeArgs, quant: str, unit: str) -> tuple[bool, str]:
    """Whether sym_int4's legacy load buffers each rank's whole shard, and why."""
    holds_shard, why = machine.legacy_load
    legacy = holds_shard and quant == "sym_int4"
    if not legacy:
        in_flight = f"{unit} in flight (more if the allocator keeps freed staging)"
        why = f"{in_flight}; {why}" if why else in_flight
    tp, slots = args.tensor_parallel_size, machine.load_slots
    if slots is not None and slots < tp:
        why += f"; the load lock lets {slots} of {tp} ranks stage at once"
    return legacy, why


def quantization(ckpt: Checkpoint | None, args: ServeArgs) -> tuple[str, str]:
    """The method the weights load with (``-q``, else the checkpoint's format), and the
    ``assumed:`` line where only the model's name said so."""
    given = (args.quantization or "").lower()
    if given:
        return given, ""
    found, source = checkpoint_format(ckpt, args.model)
    if found is None:
        return "", ""
    return found, (f"{found} checkpoint, {source}" if source.startswith("assumed") else "")


def inputs_for(machine: Machine, args: ServeArgs, ckpt: Checkpoint | None) -> phases.Inputs:
    """The phase model's inputs for serving ``ckpt`` with ``args`` on ``machine``."""
    quant, _ = quantization(ckpt, args)
    prequantized = checkpoint_format(ckpt, args.model)[0] is not None
    keys = driver_facts.debug_keys(machine.environ)
    activations, burst, kv_per_token = _forward(ckpt, args)
    weights: dict[str, Any] = {}
    if ckpt is not None:
        linear, other = _split_weights(ckpt)
        on_the_fly = not prequantized and quant in ON_THE_FLY_QUANT and ckpt.dtype in _DTYPE_BYTES
        unit, unit_kind = largest_staged_params(ckpt) if on_the_fly else (0.0, "")
        legacy, why = _load_mode(machine, args, quant, unit_kind)
        weights = {
            "other_weight_bytes": other,
            "linear_params": linear,
            "linear_bytes_per_weight": _bytes_per_weight(machine, quant, ckpt, args),
            "int4_layouts": machine.int4_layouts if quant in INT4 else 0,
            "on_the_fly": on_the_fly,
            "unit_params": unit,
            "shard_16bit": float(ckpt.total_bytes),
            "legacy_load": legacy,
            "load_mode_why": why,
        }
    return phases.Inputs(
        tp=args.tensor_parallel_size,
        utilization=args.gpu_memory_utilization,
        device_bytes=machine.device_bytes,
        **weights,
        staging_slots=machine.load_slots,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        activation_bytes=activations,
        burst=burst,
        kv_headroom=machine.kv_headroom,
        kv_headroom_slack=machine.kv_headroom_slack,
        kv_bytes_per_token=kv_per_token,
        max_model_len=args.max_model_len,
        gpus_in_context=machine.gpus_visible,
        battlemage_in_context=machine.battlemage_visible,
        runtime=machine.runtime,
        kernel=machine.kernel,
        defer_backing_off=keys.defer_backing_off,
        peer_access_off=keys.peer_access_off,
        p2p=machine.p2p,
        plugin=machine.plugin,
        room=machine.room,
        swap=machine.swap,
    )
