"""What the start-up model decides before, or beside, memory: vLLM's refusals read from
the model and the command, ranks against the GPUs, one sequence against the KV cache, a
fitted context, and the cap a flag outside the model (``domain``) puts on its side."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_xpu_memfix.startup import domain

if TYPE_CHECKING:
    from vllm_xpu_memfix.startup import phases


def kv_tokens(inp: phases.Inputs) -> int | None:
    """The longest sequence one rank's KV cache holds, at most the judged context (or the
    model's own), as vLLM sizes one sequence (``kv_layout.KvLayout.tokens_within``)."""
    kv, layout = inp.kv_cache, inp.kv_layout
    if kv is None or layout is None or not layout.allocates or not inp.weights_known:
        return None
    limit = inp.max_model_len or inp.model_max_len or 2**31 - 1
    return layout.tokens_within(max(kv, 0.0), inp.tp, inp.kv_element_bytes, limit)


def kv_shortfall(inp: phases.Inputs) -> float:
    """Bytes one --max-model-len sequence needs beyond one rank's KV cache."""
    layout = inp.kv_layout
    if layout is None or inp.kv_cache is None or not inp.max_model_len:
        return 0.0
    need = layout.sequence_bytes(inp.max_model_len, inp.tp, inp.kv_element_bytes)
    return max(0.0, need + layout.reserved(inp.tp, inp.kv_element_bytes) - inp.kv_cache)


def short_context(inp: phases.Inputs) -> bool:
    """vLLM's check at KV cache allocation: one --max-model-len sequence must fit."""
    tokens = inp.kv_tokens
    if inp.max_model_len_fitted or tokens is None or not inp.max_model_len:
        return False
    return 0 < tokens < inp.max_model_len


def ranks_over_gpus(inp: phases.Inputs) -> bool:
    """More ranks on this node than GPUs visible: vLLM cannot place them."""
    return inp.ranks_placed and 0 < inp.gpus_in_context < inp.host_ranks


def ranks_why(inp: phases.Inputs) -> str:
    if inp.host_ranks == inp.tp:
        return (
            f"--tensor-parallel-size {inp.tp} needs {inp.tp} GPUs; {inp.gpus_in_context} "
            "visible (ZE_AFFINITY_MASK / ONEAPI_DEVICE_SELECTOR narrow them)"
        )
    return (
        f"{inp.host_ranks} ranks on this node ({inp.engines_here} engine(s) x TP {inp.tp} x "
        f"PP {inp.pp}) need {inp.host_ranks} GPUs; {inp.gpus_in_context} visible"
    )


def vllm_refusals(inp: phases.Inputs) -> list[str]:
    """vLLM's refusals read before any memory: the format on the platform, the context,
    and TP against the heads (vllm/config/model.py:ModelConfig.verify_with_parallel_config)."""
    found = list(inp.refusals)
    heads = inp.attention_heads
    if heads and heads % inp.tp:
        found.append(
            f"total number of attention heads ({heads}) must be divisible by tensor parallel "
            f"size ({inp.tp}) (vllm/config/model.py:ModelConfig.verify_with_parallel_config)"
        )
    return found


def unmodelled_on(inp: phases.Inputs, side: str) -> list[str]:
    """The flags set that the model does not cover and that change ``side``."""
    return [flag for flag in inp.not_modelled if domain.side_of(flag) in (side, domain.BOTH)]


def capped(inp: phases.Inputs, side: str, why: str) -> str | None:
    """``why`` capped at "at risk" where a not-modelled flag changes ``side``; else None."""
    flags = unmodelled_on(inp, side)
    if not flags:
        return None
    names = [flag.split("=")[0].split(" ")[0] for flag in flags]
    named = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    return f"{why}; not modelled on the {side}: {named}, so at most at risk"


def fitted(inp: phases.Inputs) -> str:
    tokens = inp.kv_tokens
    if not inp.max_model_len_fitted:
        return ""
    if tokens is None:
        return "--max-model-len fitted to the KV cache (its size in tokens not known)"
    length = min(tokens, inp.model_max_len or tokens)
    return f"--max-model-len fitted to the KV cache: about {length:,} tokens"
