"""The start-up, phase by phase: host need (summed over the ranks of the host) and device
need (per rank) at ``load``, ``kv_cache`` and ``warmup``, the causes, and the verdict.

Pure arithmetic on :class:`Inputs`; reads nothing. A remedy is judged by running the same
model on changed inputs (``remedies``), never by arithmetic of its own.

Per rank, with tp ranks, utilisation u and D bytes of device memory:

- weights on the device  W = other weights / tp + linear params / tp x bytes per weight
  (sym_int4: 0.535, two layouts 1.035; fp8: 1; unquantized: the checkpoint's);
- ``load``:     device W + the 16-bit unit in flight; host tp x baseline + the ranks that
  stage at once x staging (whole 16-bit shard + unit x 6.5 B under the legacy load, the
  unit x 6.5 B otherwise) + the driver's host copy of W + unit on each rank;
- ``kv_cache``: device u x D (vLLM fills the device to the utilisation: W, the KV cache,
  the profile's activations), or W + KV + activations with --kv-cache-memory-bytes;
  host tp x baseline + the host copy of that on each rank;
- ``warmup``:   device kv_cache + the gathered logits (new contiguous memory) + what the
  warm-up adds outside torch (Level Zero modules, oneCCL buffers), less kv_headroom's
  reserve; with --kv-cache-memory-bytes the whole sampler burst is new; host as above.

The host copy (compute-runtime >= 26.09, 2+ Battlemage in one context) is about 1x each
rank's device use (compute-runtime #953, #980, intel/llvm #22873) and is pinned: swap
cannot take it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from vllm_xpu_memfix.core.units import size
from vllm_xpu_memfix.startup import codes, formats, limits, reserve
from vllm_xpu_memfix.startup.causes import Cause, causes_of, main_cause
from vllm_xpu_memfix.startup.inputs import BASELINE_PER_RANK as BASELINE_PER_RANK
from vllm_xpu_memfix.startup.inputs import Inputs, Phase

AT_RISK_SHARE = 0.85  # host: more than this share of the room is at risk
DEVICE_AT_RISK_SHARE = 0.98  # device: less than 2 % left is at risk
# Device memory the warm-up adds outside torch's count after the KV cache is sized:
# Level Zero modules of the JIT warm-up, oneCCL buffers, fragmentation; XPU's free-memory
# figure misses them (vLLM PRs #49482, #53990; ROOT-CAUSES cause 7). An assumption: the
# unknown kv_headroom's slack is kept for, taken at twice that slack's default.
WARMUP_OUTSIDE_TORCH = 2 * reserve.DEFAULT_SLACK


@dataclass(frozen=True)
class Outcome:
    """The one result of a judgement: doctor's text and JSON and the preflight's line all
    come from it. ``main_cause`` is a cause code; ``why`` says where and how much."""

    inputs: Inputs
    phases: dict[str, Phase]
    causes: list[Cause]
    verdict: str
    fails_at: dict[str, str] | None
    why: str
    main_cause: str
    # The verdict of memory alone, where a possible fatal failure (#916) made it at risk.
    memory_verdict: str | None = None
    not_judged: tuple[str, ...] = ()  # the sides (host, device) nothing could judge

    @property
    def memory_fits(self) -> bool:
        return (self.memory_verdict or self.verdict) == codes.FITS

    @property
    def host_need(self) -> float:
        return max(p.host for p in self.phases.values())

    @property
    def device_need(self) -> float | None:
        known = [p.device for p in self.phases.values() if p.device is not None]
        return max(known) if known else None


def _device(inp: Inputs) -> dict[str, float | None]:
    w = inp.weights
    unit = inp.unit_params / inp.tp * 2 if inp.on_the_fly else 0.0
    load = w + unit
    if inp.device_bytes is None and inp.kv_cache_bytes is None:
        return {codes.LOAD: load, codes.KV_CACHE: None, codes.WARMUP: None}
    kv = inp.kv_cache or 0.0
    burst = inp.burst
    if inp.kv_cache_bytes is not None:
        at_kv = w + kv + inp.activation_bytes.high
        new = burst.peak if burst else 0.0
        at_warmup = w + kv + max(inp.activation_bytes.high, new) + WARMUP_OUTSIDE_TORCH
    else:
        assert inp.device_bytes is not None
        filled = inp.utilization * inp.device_bytes - inp.reserve if limits.keeps_kv(inp) else 0
        at_kv = max(filled, w + inp.profile_peak)
        new = burst.gathered_logits if burst else 0.0
        at_warmup = at_kv + new + WARMUP_OUTSIDE_TORCH
    return {codes.LOAD: load, codes.KV_CACHE: at_kv, codes.WARMUP: at_warmup}


def _phases(inp: Inputs) -> dict[str, Phase]:
    device = _device(inp)
    ranks = inp.host_ranks
    base = ranks * (inp.baseline + inp.offloaded)
    phases = {}
    for name, per_rank in device.items():
        # The copy is of device memory: never more than the device holds.
        copied = min(per_rank or 0.0, inp.device_bytes or float("inf"))
        pinned = ranks * copied if inp.host_copy else 0.0
        staged = inp.staging_ranks * inp.staging if name == codes.LOAD else 0.0
        phases[name] = Phase(base + staged + pinned, per_rank, pinned)
    return phases


def _judge_host(inp: Inputs, name: str, phase: Phase) -> tuple[str, str]:
    if inp.room is None:
        return codes.FITS, ""
    share = f"{phase.host / inp.room:.0%} of the host's room" if inp.room > 0 else "no room"
    if phase.pinned > inp.room or phase.host > inp.room + inp.swap:
        return codes.RUNS_OUT, share
    if phase.host > AT_RISK_SHARE * inp.room:
        return codes.AT_RISK, share
    return codes.FITS, share


def _judge_device(inp: Inputs, name: str, phase: Phase) -> tuple[str, str]:
    verdict = _device_verdict(inp, name, phase)
    if phase.device is None or not inp.device_bytes:
        return verdict, ""
    return verdict, f"{phase.device / inp.device_bytes:.0%} of the device's memory"


def _device_verdict(inp: Inputs, name: str, phase: Phase) -> str:
    if phase.device is None or inp.device_bytes is None:
        return codes.FITS
    kv = inp.kv_cache
    if name == codes.KV_CACHE and kv is not None:
        if kv <= 0:
            return codes.RUNS_OUT  # vLLM: no memory left for the KV cache blocks
        if limits.short_context(inp):
            return codes.RUNS_OUT  # vLLM: the KV cache cannot hold one max-model-len sequence
    if phase.device > inp.device_bytes:
        return codes.RUNS_OUT
    if phase.device > DEVICE_AT_RISK_SHARE * inp.device_bytes:
        return codes.AT_RISK
    return codes.FITS


def _judge(inp: Inputs) -> Outcome:
    """The phases, the causes and the verdict for ``inp`` with its ranges pinned. vLLM's
    refusals come first,
    never as a memory cause. Within a phase the device is judged before the host: what the
    device cannot hold fails there, whatever the host. "will fail" only where every
    condition is known to hold (a refusal, ranks above the visible GPUs, #916 with peer
    access known); a possible failure makes the verdict "at risk", named in ``why``. A flag
    the model does not cover caps a failure at "at risk" only where it could lower the
    failing phase on that side (``reach``); one that cannot leaves the failure standing."""
    phases = _phases(inp)
    causes = causes_of(inp, phases)
    start = {"phase": codes.LOAD, "where": codes.DEVICE}
    refused = limits.vllm_refusals(inp)
    if refused:
        why = f"vLLM refuses to start: {refused[0]}"
        return Outcome(inp, phases, causes, codes.WILL_FAIL, start, why, codes.VLLM_REFUSES)
    worst, why, side = codes.FITS, "", None
    certain = []
    if limits.ranks_over_gpus(inp):
        ranks = f"TP {inp.tp}"
        if inp.host_ranks != inp.tp:
            ranks = (
                f"{inp.host_ranks} ranks ({inp.engines_here} engine(s) x TP {inp.tp} x PP {inp.pp})"
            )
        visible = f"{ranks} with {inp.gpus_in_context} GPU(s) visible: vLLM refuses to start"
        certain.append((visible, codes.TP_EXCEEDS_GPUS))
    if inp.peer_oom:
        certain.append(
            ("compute-runtime #916: every device allocation fails", codes.XE_PEER_CONTEXT_OOM)
        )
    for text, code in certain:
        fails, text = limits.stands(inp, codes.DEVICE, text, codes.LOAD)
        if fails:
            return Outcome(inp, phases, causes, codes.WILL_FAIL, start, text, code)
        if worst == codes.FITS:
            worst, why, side = codes.AT_RISK, text, codes.DEVICE
    for name, phase in phases.items():
        for where, judge in ((codes.DEVICE, _judge_device), (codes.HOST, _judge_host)):
            judged, share = judge(inp, name, phase)
            text = f"{where} at {name}: {share}"
            if judged == codes.RUNS_OUT:
                fails, text = limits.stands(inp, where, text, name)
                if fails:
                    at, main = {"phase": name, "where": where}, main_cause(causes, where)
                    return Outcome(inp, phases, causes, codes.RUNS_OUT, at, text, main)
                judged = codes.AT_RISK
            if judged == codes.AT_RISK and worst == codes.FITS:
                worst, why, side = codes.AT_RISK, text, where
    oom = inp.xe_peer_condition
    if oom is not None:
        # Not known to hold, but fatal if it does: at risk, with what is unknown.
        possible = f"compute-runtime #916 possible: {', '.join(oom.unknown)} unknown"
        main = main_cause(causes, side) if why else codes.XE_PEER_CONTEXT_OOM
        why = "; ".join(part for part in (why, possible, limits.fitted(inp)) if part)
        return Outcome(inp, phases, causes, codes.AT_RISK, None, why, main, worst)
    why = "; ".join(part for part in (why, limits.fitted(inp)) if part)
    return Outcome(inp, phases, causes, worst, None, why, main_cause(causes, side))


# The inputs that can be ranges: how a verdict names each and writes its values.
RANGED: dict[str, tuple[str, Callable[[float], str]]] = {
    "linear_bytes_per_weight": ("the weights", lambda v: _bits(v)),
    "activation_bytes": ("the activations", lambda v: size(v)),
    "kv_per_token": ("the KV cache's bytes per token", lambda v: f"{v / 1024:,.0f} KiB"),
}
FAILED = (codes.RUNS_OUT, codes.WILL_FAIL)
# Weight widths named in a verdict, narrowest first: bytes per weight at each.
WIDTHS = ((4, formats.NARROWEST), (8, 1.0), (16, 2.0))


def _open(inp: Inputs) -> list[str]:
    """The fields of ``inp`` that are ranges."""
    return [f for f in RANGED if getattr(inp, f) is not None and not getattr(inp, f).certain]


def ranged(inp: Inputs) -> list[str]:
    """Each input that is a range, with where it came from and what would settle it."""
    lines = []
    for field in _open(inp):
        (label, value), k = RANGED[field], getattr(inp, field)
        where = f"{k.source.value}: {k.origin}" + (f"; {k.settle}" if k.settle else "")
        lines.append(f"{label} {value(k.low)} to {value(k.high)} ({where})")
    return lines


def _bits(per_weight: float) -> str:
    """The widest of the usual widths within ``per_weight`` bytes (else its own bits)."""
    within = [bits for bits, width in WIDTHS if width <= per_weight * (1 + 1e-9)]
    return f"{within[-1] if within else round(per_weight * 8)}-bit"


def corner(inp: Inputs, high: bool, **pinned: float) -> Inputs:
    """``inp`` with every range at its high (else low) end, and ``pinned`` at their value."""
    ends = {f: getattr(inp, f) for f in RANGED if getattr(inp, f) is not None}
    return replace(
        inp,
        **{f: k.at(pinned.get(f, k.high if high else k.low)) for f, k in ends.items()},
    )


def _flips(inp: Inputs, field: str) -> str:
    """Where ``field`` decides (the rest at their best, it fails at its high end): the
    largest value at which the start-up still passes, by bisection, and what settles it."""
    span, (label, value) = getattr(inp, field), RANGED[field]
    if _judge(corner(inp, False, **{field: span.high})).verdict not in FAILED:
        return ""
    low, high = span.low, span.high
    for _ in range(24):
        mid = (low + high) / 2
        passes = _judge(corner(inp, False, **{field: mid})).verdict not in FAILED
        low, high = (mid, high) if passes else (low, mid)
    settle = f": {span.settle}" if span.settle else ""
    return (
        f"fits if {label} are at most {value(low)}; runs out at {value(span.high)}; "
        f"{span.origin}{settle}"
    )


def _bears(inp: Inputs, field: str) -> bool:
    """Whether ``field`` changes the phases or the causes (the rest at their low end)."""
    low = _judge(corner(inp, False))
    high = _judge(corner(inp, False, **{field: getattr(inp, field).high}))
    return (low.phases, low.causes) != (high.phases, high.causes)


def run(inp: Inputs) -> Outcome:
    """The verdict from the ranges of ``inp``: a failure is certain only where the best end
    of every range fails; "fits" only where the worst end fits; in between, "at risk",
    naming each input that decides and the value at which the verdict flips. A side with
    nothing to judge it against (no room, no device memory) is "not judged", never "fits"."""
    out = best = _judge(corner(inp, False))
    open_ = [(f, *RANGED[f]) for f in _open(inp)]
    if best.verdict == codes.WILL_FAIL:
        pass  # not a matter of memory: no range can change it
    elif best.verdict == codes.RUNS_OUT:
        bearing = [(f, label, value) for f, label, value in open_ if _bears(inp, f)]
        lows = ", ".join(f"{label} at {value(getattr(inp, f).low)}" for f, label, value in bearing)
        out = replace(best, why=f"{best.why}, even with {lows}") if lows else best
    elif open_:
        out = worst = _judge(corner(inp, True))
        if worst.verdict in FAILED:
            deciding = [text for f, *_ in open_ if (text := _flips(inp, f))]
            why = "; ".join([f"at worst {worst.why}", *deciding])
            out = replace(worst, verdict=codes.AT_RISK, fails_at=None, why=why)
    missing = (codes.HOST,) * (inp.room is None) + (codes.DEVICE,) * (inp.device_bytes is None)
    verdict = codes.NOT_JUDGED if missing and out.verdict == codes.FITS else out.verdict
    return replace(out, inputs=inp, verdict=verdict, not_judged=missing)
