"""What the serve command will need: host bytes per rank and per cause, against the room
there is, and the verdict. Works on a Measurement alone; reads nothing."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_xpu_memfix.cli.doctor import catalog, model
from vllm_xpu_memfix.cli.doctor.facts import OFFLOAD, Measurement, ServeArgs
from vllm_xpu_memfix.cli.doctor.model import AT_RISK_SHARE, BASELINE_PER_RANK
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.units import STAGING_BYTES_PER_PARAM
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver_facts
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config
from vllm_xpu_memfix.memory.estimate import BurstShape, estimate_sampler_burst

__all__ = ["AT_RISK_SHARE", "BASELINE_PER_RANK"]
# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = {"sym_int4", "fp8", "int4", "woq_int4"}
INT4 = {"sym_int4", "int4", "woq_int4"}
# vLLM's `vllm serve` defaults where the line does not give them (EngineArgs: 256
# sequences outside the large data-centre GPUs; 8192 batched tokens for the API server).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_BATCHED_TOKENS = 8192
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}
_FLAG_DTYPES = {"float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4}
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
class Estimate:
    """Host memory the serve command needs against the room there is, and the verdict;
    ``outcome`` holds the phases, causes and verdict of the phase model."""

    mirror_active: bool
    staging_why: str
    per_rank: dict[str, float]
    total: dict[str, float]
    room: float
    causes: dict[str, float]
    outcome: model.Outcome

    @property
    def verdict(self) -> str:
        return self.outcome.verdict

    @property
    def need(self) -> float:
        return self.total["host_need"]

    @property
    def main_cause(self) -> str:
        return max(self.causes, key=lambda k: self.causes[k])


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


def _staging(
    ckpt: Checkpoint | None, args: ServeArgs, legacy: tuple[bool, str]
) -> tuple[float, str]:
    """Host bytes per rank for weight conversion during loading, with the reason."""
    quant = (args.quantization or "").lower()
    if ckpt is None or quant not in ON_THE_FLY_QUANT or ckpt.dtype not in ("BF16", "F16", "F32"):
        return 0.0, "no on-the-fly quantization"
    tp = args.tensor_parallel_size
    params, unit = largest_staged_params(ckpt)
    per_layer = params / tp * STAGING_BYTES_PER_PARAM
    holds_shard, why = legacy
    if holds_shard and quant == "sym_int4":
        return ckpt.total_bytes / tp + per_layer, why
    in_flight = f"{unit} in flight (more if the allocator keeps freed staging)"
    return per_layer, in_flight if why.startswith(f"{OFFLOAD} unset") else f"{in_flight}; {why}"


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


def _bytes_per_weight(measured: Measurement, args: ServeArgs, ckpt: Checkpoint) -> float:
    quant = (args.quantization or "").lower()
    if quant in INT4:
        return catalog.TWO_LAYOUTS if measured.int4_layouts == 2 else catalog.ONE_LAYOUT
    if quant == "fp8":
        return 1.0
    return float(_FLAG_DTYPES.get((args.dtype or "").removeprefix("torch."), 0)) or float(
        _DTYPE_BYTES.get(ckpt.dtype, 2)
    )


def _logits_bytes(args: ServeArgs, ckpt: Checkpoint | None) -> int:
    flag = _FLAG_DTYPES.get((args.dtype or "").removeprefix("torch."))
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


def _kv_headroom_on(measured: Measurement) -> bool:
    settings = measured.settings
    if not measured.plugin or settings is None or not settings.requested(config.KV_HEADROOM):
        return False
    return settings.mode(config.KV_HEADROOM) is config.Mode.ON or bool(measured.visible)


def effective_env(measured: Measurement) -> dict[str, str]:
    """The serving processes' environment, with what the driver guard sets."""
    env = dict(measured.environ)
    driver_env.apply(measured.guard, env)
    return env


def inputs_for(measured: Measurement, args: ServeArgs) -> model.Inputs:
    """The phase model's inputs from what doctor read (or was told)."""
    ckpt = measured.ckpt
    quant = (args.quantization or "").lower()
    keys = driver_facts.debug_keys(effective_env(measured))
    activations, burst, kv_per_token = _forward(ckpt, args)
    room = measured.room.bytes
    unknown_room = room is None and measured.described is not None
    weights: dict[str, Any] = {}
    if ckpt is not None:
        linear, other = _split_weights(ckpt)
        on_the_fly = quant in ON_THE_FLY_QUANT and ckpt.dtype in _DTYPE_BYTES
        weights = {
            "other_weight_bytes": other,
            "linear_params": linear,
            "linear_bytes_per_weight": _bytes_per_weight(measured, args, ckpt),
            "int4_layouts": measured.int4_layouts if quant in INT4 else 0,
            "on_the_fly": on_the_fly,
            "unit_params": largest_staged_params(ckpt)[0] if on_the_fly else 0.0,
            "shard_16bit": float(ckpt.total_bytes),
        }
    return model.Inputs(
        tp=args.tensor_parallel_size,
        utilization=args.gpu_memory_utilization,
        device_bytes=float(measured.device_bytes) if measured.device_bytes else None,
        **weights,
        legacy_load=measured.legacy[0] and quant == "sym_int4",
        load_mode_why=measured.legacy[1],
        staging_slots=measured.load_slots,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        activation_bytes=activations,
        burst=burst,
        kv_headroom=_kv_headroom_on(measured),
        kv_bytes_per_token=kv_per_token,
        max_model_len=args.max_model_len,
        gpus_in_context=len(measured.visible),
        battlemage_in_context=measured.visible_battlemage,
        runtime=measured.runtime,
        kernel=measured.kernel.version if measured.kernel else None,
        defer_backing_off=keys.defer_backing_off,
        peer_access_off=keys.peer_access_off,
        room=None if unknown_room else float(room or 0),
        swap=float(measured.snap.swap_free or 0),
    )


def decide(measured: Measurement, args: ServeArgs, environ: Mapping[str, str]) -> Estimate:
    """Host need per rank and per cause, the room for it, and whether it fits."""
    del environ  # the environment is the measurement's (this process's, or a host file's)
    tp = args.tensor_parallel_size
    snap, ckpt = measured.snap, measured.ckpt
    outcome = model.run(inputs_for(measured, args))
    inp = outcome.inputs
    staging, staging_why = _staging(ckpt, args, measured.legacy)
    if inp.staging_ranks < tp and staging:
        staging_why += f"; the load lock lets {inp.staging_ranks} of {tp} ranks stage at once"
    at_kv = outcome.phases["kv_cache"]
    device_use = at_kv.device or 0.0
    per_rank = {
        "device_use": device_use,
        "driver_mirror": device_use if inp.host_copy else 0.0,
        "quantization_staging": inp.staging,
        "process_baseline": float(BASELINE_PER_RANK),
    }
    room = float(measured.room.bytes or 0)
    total = {
        "host_need": outcome.host_need,
        "page_cache": float(ckpt.total_bytes) if ckpt else 0.0,
        "mem_available": float(snap.mem_available or 0),
        "room": room,
        "swap_free": float(snap.swap_free or 0),
    }
    if measured.room.cgroup.room is not None:
        total["cgroup_room"] = float(measured.room.cgroup.room)
    causes = {
        "driver mirror": tp * per_rank["driver_mirror"],
        "quantization staging": inp.staging_ranks * inp.staging,
        "process baseline": tp * per_rank["process_baseline"],
    }
    return Estimate(inp.host_copy, staging_why, per_rank, total, room, causes, outcome)
