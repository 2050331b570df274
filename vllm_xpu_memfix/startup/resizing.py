"""Remedies that resize the command: another TP size (for more GPUs, or for the GPUs
visible), a --max-model-len the KV cache holds, an FP8 KV cache, a higher utilisation
where the device has room for the KV cache the command needs. Each gives the model's
inputs as the command would change them; ``remedies`` runs the model on them."""

from __future__ import annotations

from dataclasses import replace

from vllm_xpu_memfix.core.units import size
from vllm_xpu_memfix.startup import codes, limits
from vllm_xpu_memfix.startup import phases as model

# Tensor-parallel sizes tried for more_gpus (vLLM needs TP to divide the heads).
TP_SIZES = (2, 4, 8, 16)
BLOCK = 16  # a --max-model-len remedy is rounded down to vLLM's KV block
HIGHEST_UTILIZATION = 0.99  # vLLM takes up to 1.0; the model judges each value


def with_tp(inp: model.Inputs, tp: int) -> model.Inputs:
    """``inp`` at another TP size: each rank a share of the weights and KV heads (the
    KV layout splits them, as vLLM does); a TP vLLM has not checked (``checked_tp``), so
    the model's own rules judge it."""
    ranks = inp.host_ranks // (inp.tp * inp.pp) * tp * inp.pp
    return replace(
        inp,
        tp=tp,
        ranks_here=ranks,
        gpus_in_context=max(ranks, inp.gpus_in_context),
    )


def tp_sizes(inp: model.Inputs) -> list[int]:
    """The TP sizes vLLM accepts for this model (dividing the heads), ascending."""
    heads = inp.attention_heads
    return [tp for tp in TP_SIZES if not heads or heads % tp == 0]


def gpu_tries(inp: model.Inputs, visible: int) -> list[tuple[model.Inputs, str, str]]:
    tries = []
    for tp in tp_sizes(inp):
        if tp > inp.tp:
            changed = with_tp(inp, tp)
            ranks = changed.host_ranks
            tries.append(
                (
                    changed,
                    f"--tensor-parallel-size {tp} on {ranks} GPUs",
                    f"{ranks - visible} more GPU(s); TP must divide the attention heads",
                )
            )
    return tries


def tp_for_gpus(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """Ranks above the visible GPUs: the largest TP the GPUs hold (dividing the heads)."""
    inp = out.inputs
    if not limits.ranks_over_gpus(inp):
        return []
    per_tp = inp.host_ranks // inp.tp
    heads = inp.attention_heads
    fitting = [
        tp
        for tp in range(inp.tp - 1, 0, -1)
        if per_tp * tp <= inp.gpus_in_context and (not heads or heads % tp == 0)
    ]
    if not fitting:
        return []
    tp = fitting[0]
    return [
        (
            codes.TP_FOR_GPUS,
            f"--tensor-parallel-size {tp} for the {inp.gpus_in_context} GPU(s) visible, or "
            f"make {inp.host_ranks} GPUs visible (ZE_AFFINITY_MASK)",
            "each GPU holds a larger share of the weights",
            with_tp(inp, tp),
        )
    ]


def tp_for_heads(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """TP not dividing the attention heads (vLLM refuses): the nearest sizes that do, below
    and above, as many GPUs as are visible at most."""
    inp = out.inputs
    heads = inp.attention_heads
    if not heads or heads % inp.tp == 0:
        return []
    most = inp.gpus_in_context or max(TP_SIZES)
    below = [tp for tp in range(inp.tp - 1, 0, -1) if heads % tp == 0]
    above = [tp for tp in range(inp.tp + 1, most + 1) if heads % tp == 0]
    return [
        (
            codes.TP_FOR_GPUS,
            f"--tensor-parallel-size {tp}: it divides the {heads} attention heads",
            "fewer GPUs, each with a larger share" if tp < inp.tp else f"{tp - inp.tp} more GPU(s)",
            with_tp(inp, tp),
        )
        for tp in (*below[:1], *above[:1])
    ]


def context(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """One --max-model-len sequence above the KV cache: the length that fits, and an FP8
    KV cache."""
    inp = out.inputs
    if not limits.short_context(inp):
        return []
    tokens = (inp.kv_tokens or 0) // BLOCK * BLOCK
    found = []
    if tokens:
        found.append(
            (
                codes.MAX_MODEL_LEN,
                f"--max-model-len {tokens}",
                f"sequences up to {tokens:,} tokens instead of {inp.max_model_len:,}",
                replace(inp, max_model_len=tokens),
            )
        )
    unread = inp.kv_per_token
    if inp.kv_element_bytes > 1 and inp.kv_bytes_per_token:
        found.append(
            (
                codes.KV_CACHE_DTYPE,
                "--kv-cache-dtype fp8",
                "twice the tokens in the KV cache; a small accuracy cost",
                replace(
                    inp,
                    kv_element_bytes=1,
                    kv_cache_dtype="fp8",
                    kv_per_token=unread and unread.scale(1 / inp.kv_element_bytes),
                ),
            )
        )
    return found


def higher_utilization(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """A KV cache that cannot hold one --max-model-len sequence, or none at all, at the
    utilisation asked (0.3, say) on a device with room: the lowest utilisation above it at
    which the model judges the start-up to fit."""
    inp = out.inputs
    if out.fails_at != {"phase": codes.KV_CACHE, "where": codes.DEVICE}:
        return []
    if inp.kv_cache_bytes is not None or not inp.device_bytes:
        return []
    steps = round((HIGHEST_UTILIZATION - inp.utilization) * 100)
    for step in range(1, steps + 1):
        value = round(inp.utilization + step / 100, 2)
        changed = replace(inp, utilization=value)
        if model.run(changed).memory_fits:
            before, after = inp.kv_cache or 0.0, changed.kv_cache or 0.0
            return [
                (
                    codes.GPU_MEMORY_UTILIZATION,
                    f"--gpu-memory-utilization {value:.2f}",
                    f"KV cache per rank {size(max(before, 0.0))} -> {size(after)}: less of "
                    "the device left for anything else on it",
                    changed,
                )
            ]
    return []
