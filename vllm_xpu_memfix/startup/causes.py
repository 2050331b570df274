"""The causes a judged start-up names: each a code of ``startup.codes``, its GiB and why,
from the model's inputs and the phases it computed (``startup.phases``)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_xpu_memfix.core.units import GiB, MiB, size
from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.intel import driver_facts as dfacts
from vllm_xpu_memfix.startup import codes, limits
from vllm_xpu_memfix.startup.inputs import Inputs, Phase


@dataclass(frozen=True)
class Cause:
    code: str
    gib: float
    why: str


def causes_of(inp: Inputs, phases: dict[str, Phase]) -> list[Cause]:
    """What the start-up's memory goes to, and what stops it, each with its GiB."""
    gib = 1 / GiB
    causes = []
    if limits.ranks_over_gpus(inp):
        causes.append(Cause(codes.TP_EXCEEDS_GPUS, 0.0, limits.ranks_why(inp)))
    for why in limits.vllm_refusals(inp):
        causes.append(Cause(codes.VLLM_REFUSES, 0.0, why))
    if limits.short_context(inp):
        causes.append(
            Cause(
                codes.CONTEXT_EXCEEDS_KV_CACHE,
                limits.kv_shortfall(inp) * gib,
                f"the KV cache holds {inp.kv_tokens:,} tokens a rank; one --max-model-len "
                f"{inp.max_model_len:,} sequence needs more (vLLM refuses at KV cache set-up)",
            )
        )
    condition = inp.xe_peer_condition
    if condition is not None:
        unknown = ", ".join(condition.unknown)
        known = (
            ""
            if condition.certain
            else f" (possible: {unknown} not known; {dfacts.XE_PEER_OOM_CHECK})"
        )
        causes.append(
            Cause(
                codes.XE_PEER_CONTEXT_OOM,
                0.0,
                f"{inp.gpus_in_context} Intel GPUs in one context, compute-runtime "
                f"{inp.runtime.version if inp.runtime else 'unknown'}, kernel "
                f"{(inp.kernel.release if inp.kernel else None) or 'unknown'}: every device "
                f"allocation fails ({dfacts.XE_PEER_OOM_THREAD}){known}",
            )
        )
    if inp.host_copy:
        peak = max(phases.values(), key=lambda p: p.pinned)
        causes.append(
            Cause(
                codes.DRIVER_HOST_COPY,
                peak.pinned * gib,
                f"{inp.battlemage_in_context} Battlemage GPUs in one context, compute-runtime "
                f"{inp.runtime.version if inp.runtime else 'unknown (assumed affected)'}: about "
                f"each rank's device use pinned on the host, {inp.host_ranks} rank(s)",
            )
        )
    if inp.staging:
        load = "whole 16-bit shard (legacy load)" if inp.legacy_load else "per layer"
        ranks = inp.staging_ranks
        causes.append(
            Cause(
                codes.QUANT_STAGING,
                ranks * inp.staging * gib,
                f"{load}: {size(inp.staging)} a rank, {ranks} of {inp.host_ranks} rank(s) at "
                f"once; {inp.load_mode_why}",
            )
        )
    if inp.int4_layouts == 2:
        per_weight = inp.linear_bytes_per_weight.high
        extra = inp.linear_params / inp.tp * (per_weight - catalog.ONE_LAYOUT)
        causes.append(
            Cause(
                codes.DUPLICATE_INT4_LAYOUT,
                extra * gib,
                f"two device layouts per sym_int4 weight ({per_weight} B per "
                f"weight element instead of {catalog.ONE_LAYOUT}): the second, per rank",
            )
        )
    if inp.burst is not None:
        burst = inp.burst
        causes.append(
            Cause(
                codes.SAMPLER_BURST,
                burst.peak * gib,
                f"B={burst.shape.num_reqs} x vocab {burst.shape.padded_vocab:,}: gathered logits "
                f"{size(burst.gathered_logits, MiB)}; the peak is at {burst.peak_parts()}",
            )
        )
    if inp.device_bytes is not None:
        over = max((p.device or 0.0) - inp.device_bytes for p in phases.values())
        kv = inp.kv_cache
        if over > 0 or (kv is not None and kv <= 0):
            causes.append(
                Cause(
                    codes.DEVICE_OVERCOMMIT,
                    max(over, -(kv or 0.0)) * gib,
                    f"weights {size(inp.weights)} + KV cache + activations per rank "
                    f"against {size(inp.device_bytes)} at utilisation {inp.utilization}",
                )
            )
    causes.append(
        Cause(
            codes.PROCESS_BASELINE,
            inp.host_ranks * inp.baseline * gib,
            f"{size(inp.baseline)} a rank, {inp.host_ranks} rank(s) on this host",
        )
    )
    return causes


def main_cause(causes: list[Cause], side: str | None) -> str:
    """The largest cause on ``side`` (any side where None), as its code."""
    on_side = [c for c in causes if side is None or codes.CAUSE_SIDE[c.code] == side]
    return max(on_side or causes, key=lambda c: c.gib).code
