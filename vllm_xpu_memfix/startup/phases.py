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

from vllm_xpu_memfix.core.units import GiB, size
from vllm_xpu_memfix.intel import driver
from vllm_xpu_memfix.intel import driver_facts as dfacts
from vllm_xpu_memfix.memory.estimate import BurstEstimate
from vllm_xpu_memfix.startup import codes, formats, limits, reserve, staging
from vllm_xpu_memfix.startup.causes import Cause, causes_of, main_cause
from vllm_xpu_memfix.startup.known import Known, Source, exact
from vllm_xpu_memfix.startup.kv_layout import KvLayout

# Host RAM of the vLLM processes themselves, per rank: vllm #50269's maintainers
# call ~15 GB normal on 4x B60 and ~10 GB on one CUDA GPU.
BASELINE_PER_RANK = 3.5 * GiB
AT_RISK_SHARE = 0.85  # host: more than this share of the room is at risk
DEVICE_AT_RISK_SHARE = 0.98  # device: less than 2 % left is at risk
# Device memory the warm-up adds outside torch's count after the KV cache is sized:
# Level Zero modules of the JIT warm-up, oneCCL buffers, fragmentation; XPU's free-memory
# figure misses them (vLLM PRs #49482, #53990; ROOT-CAUSES cause 7). An assumption: the
# unknown kv_headroom's slack is kept for, taken at twice that slack's default.
WARMUP_OUTSIDE_TORCH = 2 * reserve.DEFAULT_SLACK
# What an Inputs built by hand (not by ``sizing``) holds where it names nothing.
SIXTEEN_BIT = exact(2.0, "16-bit weights", Source.GIVEN)
NO_FORWARD = exact(0.0, "no forward pass", Source.GIVEN)


@dataclass(frozen=True)
class Inputs:
    """Everything the model reads. Bytes unless named otherwise; None is unknown; a
    :class:`Known` is a range with its provenance. The properties are the worst case (each
    range's high end); :func:`run` judges both ends (:func:`corner`)."""

    tp: int
    utilization: float
    device_bytes: float | None
    pp: int = 1
    ranks_here: int = 0  # the ranks this host runs (engines x TP x PP here); 0: TP x PP
    engines_here: int = 1
    ranks_placed: bool = True  # False under Ray: ranks may run on other nodes
    expert_ranks: int = 1  # DP engines sharing the experts under expert parallel
    stage_share: float = 1.0  # the largest pipeline stage's share of the weights
    expert_share: float = 0.0  # the experts' share of the weights
    other_weight_bytes: float = 0.0  # on the device, all ranks together
    linear_params: float = 0.0
    linear_bytes_per_weight: Known = SIXTEEN_BIT  # on the device
    prequantized: bool = False
    cpu_offload_bytes: float = 0.0  # per rank, --cpu-offload-gb
    int4_layouts: int = 0  # 0: not sym_int4; 1 or 2 device layouts per weight
    on_the_fly: bool = False  # 16-bit weights converted while loading
    unit_params: float = 0.0  # the largest unit converted at once, all ranks together
    shard_16bit: float = 0.0  # the 16-bit checkpoint, all ranks together
    legacy_load: bool = False
    load_mode_why: str = ""
    staging_slots: int | None = None
    kv_cache_bytes: float | None = None  # --kv-cache-memory-bytes
    activation_bytes: Known = NO_FORWARD  # per rank, the profile run's forward pass
    burst: BurstEstimate | None = None
    kv_headroom: bool = False
    kv_headroom_slack: float = reserve.DEFAULT_SLACK
    kv_layout: KvLayout | None = None  # what one sequence holds (startup.kv_layout)
    kv_per_token: Known | None = None  # per rank, where no layout is read (kv_layout.UNREAD)
    kv_cache_dtype: str = "auto"
    kv_element_bytes: int = 2
    max_model_len: int | None = None  # as given, else the model's own
    max_model_len_fitted: bool = False  # -1 / auto: vLLM fits it to the KV cache
    model_max_len: int | None = None
    attention_heads: int | None = None
    refusals: tuple[str, ...] = ()  # vLLM's reasons to refuse, read before any memory
    checked_tp: int = 0  # the TP at which vLLM's own checks ran (refusals); 0: none ran
    not_modelled: tuple[str, ...] = ()  # flags set that the model does not cover
    gpus_in_context: int = 0
    battlemage_in_context: int = 0
    runtime: driver.Runtime | None = None
    kernel: driver.Kernel | None = None
    defer_backing_off: bool = False
    peer_access_off: bool = False
    p2p: bool | None = None  # peer access between the GPUs; None: not known
    plugin: bool = True  # the plugin is installed where it will serve
    baseline: float = BASELINE_PER_RANK
    room: float | None = None
    swap: float = 0.0

    @property
    def host_ranks(self) -> int:
        return self.ranks_here or self.tp * self.pp

    @property
    def loaded(self) -> float:
        """Per rank, the weights of the largest stage before any CPU offload."""
        linear = self.linear_params * self.linear_bytes_per_weight.high
        experts = 1 - self.expert_share + self.expert_share / self.expert_ranks
        return (self.other_weight_bytes + linear) * experts * self.stage_share / self.tp

    @property
    def offloaded(self) -> float:
        """Per rank, the weights --cpu-offload-gb keeps in host memory."""
        return min(self.cpu_offload_bytes, self.loaded)

    @property
    def weights(self) -> float:
        """Per rank, as the device holds them once loaded."""
        return self.loaded - self.offloaded

    @property
    def staging(self) -> float:
        """Host bytes per rank that convert weights during the load."""
        if not self.on_the_fly:
            return 0.0
        shard = self.shard_16bit * self.stage_share / self.tp if self.legacy_load else 0.0
        return staging.per_rank(self.unit_params / self.tp, shard_bytes=shard)

    @property
    def staging_ranks(self) -> int:
        if self.staging and self.staging_slots:
            return min(self.host_ranks, self.staging_slots)
        return self.host_ranks

    @property
    def kv_bytes_per_token(self) -> float | None:
        return limits.kv_bytes_per_token(self)

    @property
    def kv_tokens(self) -> int | None:
        """The longest sequence the KV cache of one rank holds (``limits.kv_tokens``)."""
        return limits.kv_tokens(self)

    @property
    def debug_keys(self) -> dfacts.DebugKeys:
        """The driver keys the serving processes start with, as the driver reads them."""
        env = {dfacts.READ_DEBUG_KEYS: "1"}
        if self.defer_backing_off:
            env[dfacts.DEFER_BACKING] = "0"
        if self.peer_access_off:
            env[dfacts.FORCE_PEER_ACCESS] = "0"
        return dfacts.debug_keys(env)

    @property
    def host_copy(self) -> bool:
        """Whether the driver pins a host copy (an unknown runtime counts as affected)."""
        return (
            driver.why_no_host_copy(
                self.gpus_in_context, self.battlemage_in_context, self.runtime, self.debug_keys
            )
            is None
        )

    @property
    def xe_peer_condition(self) -> driver.XePeerOom | None:
        """compute-runtime #916's condition, with the parts not known (None: ruled out)."""
        return driver.xe_peer_oom(
            self.gpus_in_context,
            self.runtime,
            self.kernel,
            self.peer_access_off,
            self.p2p,
        )

    @property
    def peer_oom(self) -> bool | None:
        """compute-runtime #916 will strike (True), cannot (False), or a part of its
        condition is not known (None)."""
        oom = self.xe_peer_condition
        return False if oom is None else (True if oom.certain else None)

    @property
    def reserve(self) -> float:
        """kv_headroom's reserve (``reserve.kv_reserve``), where it takes one."""
        if not self.kv_headroom or self.burst is None or self.kv_cache_bytes is not None:
            return 0.0
        return float(reserve.kv_reserve(self.burst, self.kv_headroom_slack))

    @property
    def profile_peak(self) -> float:
        return self.activation_bytes.high + (self.burst.peak if self.burst else 0.0)

    @property
    def kv_cache(self) -> float | None:
        """Per rank: the KV cache vLLM allocates (negative: the weights leave none)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if self.device_bytes is None:
            return None
        budget = self.utilization * self.device_bytes
        return budget - self.weights - self.profile_peak - self.reserve


@dataclass(frozen=True)
class Phase:
    host: float
    device: float | None
    pinned: float  # the host copy's share of ``host``


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
        capped = limits.capped(inp, codes.DEVICE, text, codes.LOAD)
        if capped is None:
            stands = limits.cannot_rescue(inp, codes.DEVICE, codes.LOAD)
            why = "; ".join(part for part in (text, stands) if part)
            return Outcome(inp, phases, causes, codes.WILL_FAIL, start, why, code)
        if worst == codes.FITS:
            worst, why, side = codes.AT_RISK, capped, codes.DEVICE
    for name, phase in phases.items():
        for where, judge in ((codes.DEVICE, _judge_device), (codes.HOST, _judge_host)):
            judged, share = judge(inp, name, phase)
            text = f"{where} at {name}: {share}"
            if judged == codes.RUNS_OUT:
                capped = limits.capped(inp, where, text, name)
                if capped is None:
                    main = main_cause(causes, where)
                    at = {"phase": name, "where": where}
                    stands = limits.cannot_rescue(inp, where, name)
                    text = "; ".join(part for part in (text, stands) if part)
                    return Outcome(inp, phases, causes, codes.RUNS_OUT, at, text, main)
                judged, text = codes.AT_RISK, capped
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
