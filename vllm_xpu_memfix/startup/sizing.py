"""The start-up model's inputs from what was read: the checkpoint, the engine's arguments
(a pasted serve line, doctor's flags, or the engine's own configuration) and the machine
(this one, or one described in a file). Reads nothing itself."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.intel import catalog, driver, driver_facts
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config
from vllm_xpu_memfix.memory.estimate import BurstShape, estimate_sampler_burst
from vllm_xpu_memfix.startup import context, formats, kv_layout, layout, phases, reserve
from vllm_xpu_memfix.startup.known import Known, Source, exact
from vllm_xpu_memfix.startup.kv_layout import config_int

# Quantization methods that convert 16-bit weights while loading, through the host.
ON_THE_FLY_QUANT = frozenset(formats.ON_THE_FLY)
INT4 = formats.INTEL_INT4
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
    # vLLM's own refusals where it built the configuration from these arguments (doctor's
    # vLLM path, the preflight; () where it accepted them): its checks ran, so the model's
    # hand-written ones (``limits.vllm_refusals``, ``context.refusal``) stay out. None:
    # vLLM did not build it.
    refused: tuple[str, ...] | None = None
    # Flags of a pasted serve line (or EngineArgs fields, in the preflight) set away from
    # their default that the model does not cover, as given.
    not_modelled: tuple[str, ...] = ()
    # The KV cache as vLLM's resolved configuration lays it out (engine_config); None:
    # from config.json's own rules.
    kv_layout: kv_layout.KvLayout | None = None


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
    ipex_gptq_moe: bool = False  # the image's GPTQ MoE runs IPEX (catalog.IPEX_GPTQ_MOE)


def quantization_config(ckpt: Checkpoint | None) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (the text model's, else the top level's)."""
    if ckpt is None:
        return None
    quant = text_config(ckpt.config).get("quantization_config") or ckpt.config.get(
        "quantization_config"
    )
    return quant if isinstance(quant, dict) else None


def weight_format(ckpt: Checkpoint | None, args: ServeArgs) -> formats.Format:
    """The checkpoint's own format (from its metadata: config.json's
    ``quantization_config``, a GGUF header; never from the model's name), else ``-q``'s
    (converted while loading), else none."""
    own = formats.from_config(quantization_config(ckpt))
    if own is not None:
        return own
    given = (args.quantization or "").lower()
    return formats.given(given) if given else formats.Format("", 2.0, False)


def _largest_from_config(config: dict[str, Any]) -> tuple[float, str]:
    """The largest staged unit from config.json's sizes, where no tensor header was read."""
    text = text_config(config)
    hidden = config_int(text, "hidden_size")
    if hidden is None:
        return 0.0, "no linear layer known (neither tensor headers nor config sizes)"
    linear = float(hidden * (config_int(text, "intermediate_size") or hidden))
    experts = config_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    expert_inter = config_int(text, "moe_intermediate_size")
    if experts and expert_inter and 2 * experts * expert_inter * hidden > linear:
        return float(2 * experts * expert_inter * hidden), "an MoE side (from config.json)"
    return linear, "a linear layer (from config.json)"


def params_from_config(config: dict[str, Any]) -> int | None:
    """A dense model's parameters from config.json's sizes, where no weights can be read:
    the embedding (and an untied head), then per layer the attention projections and a
    gated MLP. None for an MoE model or where a size is missing."""
    text = text_config(config)
    hidden = config_int(text, "hidden_size")
    layers = config_int(text, "num_hidden_layers")
    vocab = config_int(text, "vocab_size")
    inter = config_int(text, "intermediate_size")
    heads = config_int(text, "num_attention_heads")
    if not (hidden and layers and vocab and inter and heads) or config_int(
        text, "num_experts", "num_local_experts", "n_routed_experts"
    ):
        return None
    head_dim = config_int(text, "head_dim") or hidden // heads
    kv_heads = config_int(text, "num_key_value_heads") or heads
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


def _bytes_per_weight(
    machine: Machine, fmt: formats.Format, ckpt: Checkpoint, args: ServeArgs
) -> Known:
    """Device bytes per element of the checkpoint's linear weights. Where a prequantized
    checkpoint's headers were read, its quantized tensors are counted at their own size and
    its 16-bit ones at the served dtype. Where the format was not read (a size from
    --params, a method without its config), the widths it can have (``formats.widths``)."""
    if fmt.method in INT4 and not fmt.prequantized:
        two = machine.int4_layouts == 2
        per_weight = catalog.TWO_LAYOUTS if two else catalog.ONE_LAYOUT
        return exact(per_weight, f"-q {fmt.method}, {1 + two} device layout(s)", Source.GIVEN)
    dtype = (args.dtype or "").removeprefix("torch.")
    flag = float(FLAG_DTYPES.get(dtype, 0))
    # vLLM's "auto" serves a float32 checkpoint at 16 bits (vllm/config/model.py,
    # _resolve_auto_dtype, 0.32.0: "Downcast for float32 models").
    served = flag or min(float(_DTYPE_BYTES.get(ckpt.dtype, 2)), 2.0)
    origin = f"--dtype {dtype}" if flag else f"the checkpoint's {ckpt.dtype}, as vLLM serves it"
    if not fmt.method and (ckpt.assumed_dtype is None or ckpt.config):
        return exact(served, origin)  # config.json read: no quantization_config
    if fmt.prequantized and ckpt.tensors and fmt.bytes_per_weight is not None:
        return exact(served, "the checkpoint's tensor headers")
    if fmt.bytes_per_weight is not None and (fmt.prequantized or fmt.on_the_fly):
        source = Source.READ if fmt.prequantized else Source.GIVEN
        return exact(fmt.bytes_per_weight, f"{fmt.method} ({fmt.source})", source)
    low, high = formats.widths(fmt.method)
    if not fmt.method:
        what, settle = (
            "the format is not read (sized from --params)",
            "pass --quantization, or go online",
        )
    else:
        what, settle = f"{fmt.method}'s width is not read", "go online, or give its directory"
    return Known.between(low, min(high, flag or high), Source.ASSUMED, what, settle)


def _logits_bytes(args: ServeArgs, ckpt: Checkpoint | None) -> int:
    """The served dtype's bytes: --dtype's, else 16-bit (vLLM's "auto" serves float32
    checkpoints at 16 bits, as ``_bytes_per_weight`` says)."""
    return FLAG_DTYPES.get((args.dtype or "").removeprefix("torch.")) or 2


def kv_cache_layout(
    ckpt: Checkpoint | None, args: ServeArgs, stage_layers: int | None
) -> kv_layout.KvLayout | None:
    """The KV cache layout: vLLM's where its configuration was read, else config.json's,
    scaled to the largest pipeline stage's layers."""
    if args.kv_layout is not None:
        return args.kv_layout
    if ckpt is None:
        return None
    text = text_config(ckpt.config)
    found = kv_layout.from_config(
        ckpt.config,
        element=_kv_element_bytes(args, ckpt),
        state_element=_logits_bytes(args, ckpt),
        batched_tokens=args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS,
        pp=args.pipeline_parallel_size,
        directory=ckpt.directory,
    )
    layers = config_int(text, "num_hidden_layers")
    if found is None or not (layers and stage_layers):
        return found
    return replace(found, share=stage_layers / layers)


def _kv_unread(ckpt: Checkpoint, args: ServeArgs, stage_share: float) -> Known:
    """Per rank, the bytes per token of a KV cache whose layout was not read (no config.json,
    or one without its layers and heads): from none (an attention-free model) to the
    widest a model of this size keeps (``kv_layout.per_token_high``)."""
    params = float(ckpt.total_bytes) / _DTYPE_BYTES.get(ckpt.dtype, 2)
    element = _kv_element_bytes(args, ckpt)
    high = kv_layout.per_token_high(params, element, args.tensor_parallel_size) * stage_share
    what = "no config.json read" if not ckpt.config else "config.json has no layers or heads"
    return Known.between(
        0.0,
        high,
        Source.ASSUMED,
        f"the KV layout is not known ({what})",
        "go online, or give the model's directory",
    )


def _kv_element_bytes(args: ServeArgs, ckpt: Checkpoint | None) -> int:
    return (
        1
        if (args.kv_cache_dtype or "auto").lower().startswith("fp8")
        else _logits_bytes(args, ckpt)
    )


def _activations(ckpt: Checkpoint | None, args: ServeArgs, hidden: int | None) -> Known:
    """Per rank, the profile run's forward pass: ``tokens x (4 hidden + 2 intermediate /
    TP)`` elements. Without config.json's sizes, from none to the widest model of this
    size (a gated MLP 4x as wide, at least 8 layers: hidden <= sqrt(params / 96))."""
    text = text_config(ckpt.config) if ckpt else {}
    dtype = _logits_bytes(args, ckpt)
    tokens = args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    tp = args.tensor_parallel_size
    if hidden:
        inter = config_int(text, "intermediate_size", "moe_intermediate_size") or 0
        return exact(float(tokens * (4 * hidden + 2 * inter / tp) * dtype), "config.json")
    widest = (float(ckpt.total_bytes) / 2 / 96) ** 0.5 if ckpt else 0.0
    high = tokens * (4 + 8 / tp) * widest * dtype
    return Known.between(0.0, high, Source.ASSUMED, "no hidden_size read", "go online")


def _forward(ckpt: Checkpoint | None, args: ServeArgs, sampler: bool) -> tuple[Known, Any]:
    """(activation bytes per rank, the sampler burst: none where no sampler runs, as
    under a pooling runner)."""
    text = text_config(ckpt.config) if ckpt else {}
    dtype = _logits_bytes(args, ckpt)
    tokens = args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    hidden = config_int(text, "hidden_size")
    tp = args.tensor_parallel_size
    activations = _activations(ckpt, args, hidden)
    vocab = config_int(text, "vocab_size")
    burst = None
    if vocab and sampler:
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
    return activations, burst


def _with_ipex_moe(
    activations: Known, machine: Machine, fmt: str, ckpt: Checkpoint | None, layers: int | None
) -> Known:
    """The forward pass with what IPEX's GatedMLPMOE adds to a GPTQ MoE's first one on the
    images that run it (llm-scaler #348: catalog.IPEX_MOE_FIRST_FORWARD from one layer to
    each of the stage's layers)."""
    text = text_config(ckpt.config) if ckpt else {}
    moe = config_int(text, "num_experts", "num_local_experts", "n_routed_experts")
    if not (machine.ipex_gptq_moe and moe and layers and fmt in formats.GPTQ):
        return activations
    each = float(catalog.IPEX_MOE_FIRST_FORWARD)
    return Known.between(
        activations.low + each,
        activations.high + each * layers,
        Source.ASSUMED,
        f"{activations.origin}; IPEX GatedMLPMOE's first forward (llm-scaler #348)",
        "whether each layer keeps it is not known",
    )


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


def quantization(ckpt: Checkpoint | None, args: ServeArgs) -> str:
    """The weights' format as doctor names it: the checkpoint's method and its parameters
    (``gguf Q4_K_M``, ``awq 4-bit, group 128``), ``-q``'s, or none."""
    return formats.label(weight_format(ckpt, args), quantization_config(ckpt))


def _layout(args: ServeArgs) -> layout.Layout:
    return layout.of(
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.data_parallel_size,
        args.data_parallel_size_local,
        args.nnodes,
        args.distributed_executor_backend,
        args.enable_expert_parallel,
    )


def _weights(
    machine: Machine, args: ServeArgs, ckpt: Checkpoint, fmt: formats.Format, place: layout.Layout
) -> dict[str, Any]:
    linear, other = _split_weights(ckpt)
    on_the_fly = fmt.on_the_fly and fmt.method in ON_THE_FLY_QUANT and ckpt.dtype in _DTYPE_BYTES
    unit, unit_kind = largest_staged_params(ckpt) if on_the_fly else (0.0, "")
    legacy, why = _load_mode(machine, args, fmt.method, unit_kind)
    per_weight = _bytes_per_weight(machine, fmt, ckpt, args)
    share, _ = layout.largest_stage(ckpt.config, float(ckpt.total_bytes), place.pp)
    return {
        "other_weight_bytes": other,
        "linear_params": linear,
        "linear_bytes_per_weight": per_weight,
        "prequantized": fmt.prequantized,
        "int4_layouts": machine.int4_layouts if fmt.method in INT4 else 0,
        "on_the_fly": on_the_fly,
        "unit_params": unit,
        "shard_16bit": float(ckpt.total_bytes),
        "legacy_load": legacy,
        "load_mode_why": why,
        "stage_share": share,
        "expert_share": layout.expert_share(ckpt) if place.expert_ranks > 1 else 0.0,
    }


def _model_facts(ckpt: Checkpoint | None, args: ServeArgs, machine: Machine) -> dict[str, Any]:
    """What vLLM checks before any memory: the heads, the context, the format's platform."""
    config = ckpt.config if ckpt else {}
    text = text_config(config)
    own = context.model_max_len(config)
    fmt = weight_format(ckpt, args)
    length = args.max_model_len
    checked = args.refused is not None
    asked = "" if checked else context.refusal(length, config, machine.environ)
    if length is None and not args.max_model_len_fitted and own is not None:
        length = own[0]  # vLLM's default: the model's own context
    return {
        "attention_heads": config_int(text, "num_attention_heads"),
        "model_max_len": None if own is None else own[0],
        "max_model_len": length,
        "max_model_len_fitted": args.max_model_len_fitted,
        "checked_tp": args.tensor_parallel_size if checked else 0,
        "refusals": tuple(
            why
            for why in (
                *(args.refused or ()),
                fmt.xpu_refusal,
                asked,
            )
            if why
        ),
    }


def inputs_for(machine: Machine, args: ServeArgs, ckpt: Checkpoint | None) -> phases.Inputs:
    """The phase model's inputs for serving ``ckpt`` with ``args`` on ``machine``."""
    place = _layout(args)
    fmt = weight_format(ckpt, args)
    keys = driver_facts.debug_keys(machine.environ)
    _, stage_layers = layout.largest_stage(
        ckpt.config if ckpt else {}, float(ckpt.total_bytes) if ckpt else 0.0, place.pp
    )
    kv = kv_cache_layout(ckpt, args, stage_layers)
    share, _ = layout.largest_stage({}, 1.0, place.pp)
    unread = _kv_unread(ckpt, args, share) if kv is None and ckpt is not None else None
    activations, burst = _forward(ckpt, args, kv is None or kv.sampler)
    activations = _with_ipex_moe(activations, machine, fmt.method, ckpt, stage_layers)
    weights = _weights(machine, args, ckpt, fmt, place) if ckpt is not None else {}
    return phases.Inputs(
        tp=args.tensor_parallel_size,
        pp=place.pp,
        ranks_here=place.ranks_here,
        engines_here=place.engines_here,
        ranks_placed=place.placed,
        expert_ranks=place.expert_ranks,
        utilization=args.gpu_memory_utilization,
        device_bytes=machine.device_bytes,
        **weights,
        **_model_facts(ckpt, args, machine),
        cpu_offload_bytes=args.cpu_offload_gb * GiB,
        staging_slots=machine.load_slots,
        kv_cache_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        kv_element_bytes=_kv_element_bytes(args, ckpt),
        activation_bytes=activations,
        burst=burst,
        kv_headroom=machine.kv_headroom,
        kv_headroom_slack=machine.kv_headroom_slack,
        kv_layout=kv,
        kv_per_token=unread,
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
        not_modelled=args.not_modelled,
    )
