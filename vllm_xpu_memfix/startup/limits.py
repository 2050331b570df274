"""What the start-up model decides before, or beside, memory: vLLM's refusals read from
the model and the command, ranks against the GPUs, one sequence against the KV cache, a
fitted context, and the cap a flag outside the model (``domain``) puts on its side."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_xpu_memfix.startup import domain, reach
from vllm_xpu_memfix.startup.inputs import Inputs


def keeps_kv(inp: Inputs) -> bool:
    """Whether vLLM allocates a KV cache (an encoder-only model keeps none; the device then
    holds the weights and activations, not the utilisation's share)."""
    return inp.kv_layout is None or inp.kv_layout.allocates


def kv_shortfall(inp: Inputs) -> float:
    """Bytes one --max-model-len sequence needs beyond one rank's KV cache."""
    found = inp.kv_of()
    if found is None or inp.kv_cache is None or not inp.max_model_len:
        return 0.0
    layout, element = found
    need = layout.sequence_bytes(inp.max_model_len, inp.tp, element)
    return max(0.0, need + layout.reserved(inp.tp, element) - inp.kv_cache)


def short_context(inp: Inputs) -> bool:
    """vLLM's check at KV cache allocation: one --max-model-len sequence must fit."""
    tokens = inp.kv_tokens
    if inp.max_model_len_fitted or tokens is None or not inp.max_model_len:
        return False
    return 0 < tokens < inp.max_model_len


def ranks_over_gpus(inp: Inputs) -> bool:
    """More ranks on this node than GPUs visible: vLLM cannot place them."""
    return inp.ranks_placed and 0 < inp.gpus_in_context < inp.host_ranks


def ranks_why(inp: Inputs) -> str:
    if inp.host_ranks == inp.tp:
        return (
            f"--tensor-parallel-size {inp.tp} needs {inp.tp} GPUs; {inp.gpus_in_context} "
            "visible (ZE_AFFINITY_MASK / ONEAPI_DEVICE_SELECTOR narrow them)"
        )
    return (
        f"{inp.host_ranks} ranks on this node ({inp.engines_here} engine(s) x TP {inp.tp} x "
        f"PP {inp.pp}) need {inp.host_ranks} GPUs; {inp.gpus_in_context} visible"
    )


def vllm_refusals(inp: Inputs) -> list[str]:
    """vLLM's refusals read before any memory: vLLM's own where it built the configuration
    at this TP (``checked_tp``), else the model's hand-written ones: the context
    (``context``) and TP against the heads
    (vllm/config/model.py:ModelConfig.verify_with_parallel_config), the latter also for a TP
    vLLM did not check (a remedy's, ``resizing.with_tp``). The format
    on XPU stays in either case: the test bed's vLLM checks its own platform."""
    found = list(inp.refusals)
    heads = inp.attention_heads
    if heads and heads % inp.tp and inp.tp != inp.checked_tp:
        found.append(
            f"total number of attention heads ({heads}) must be divisible by tensor parallel "
            f"size ({inp.tp}) (vllm/config/model.py:ModelConfig.verify_with_parallel_config)"
        )
    return found


def unmodelled_on(inp: Inputs, side: str) -> list[str]:
    """The flags set that the model does not cover and that change ``side``."""
    return [flag for flag in inp.not_modelled if domain.side_of(flag) in (side, domain.BOTH)]


def _name(flag: str) -> str:
    return flag.split("=")[0].split(" ")[0]


def rescuing(flags: Iterable[str], phase: str) -> list[str]:
    """Of ``flags`` (not-modelled, as named), those that could lower ``phase``."""
    names = [_name(flag) for flag in flags]
    return [name for name in names if reach.can_lower(domain.field_of(name) or "", phase)]


def stands(inp: Inputs, side: str, why: str, phase: str) -> tuple[bool, str]:
    """Whether ``why``, a failure at ``phase`` on ``side``, stands: not where a not-modelled
    flag could lower that phase there (``reach``; then at most "at risk"), naming it; where
    it stands, naming the flags set there that cannot."""
    flags = unmodelled_on(inp, side)
    names = rescuing(flags, phase) or [_name(flag) for flag in flags]
    named = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    if rescuing(flags, phase):
        return False, f"{why}; not modelled on the {side}: {named} can lower it, so at most at risk"
    return True, f"{why}; {named} set, which cannot lower the {phase} phase" if flags else why


def fitted(inp: Inputs) -> str:
    tokens = inp.kv_tokens
    if not inp.max_model_len_fitted:
        return ""
    if tokens is None or inp.kv_layout is None:
        return "--max-model-len fitted to the KV cache (its size in tokens not known)"
    length = min(tokens, inp.model_max_len or tokens)
    return f"--max-model-len fitted to the KV cache: about {length:,} tokens"
