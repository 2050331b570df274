"""What would make the start-up fit: each remedy changes the phase model's inputs as the
remedy changes the machine or the command, and the same model is run again. Only those
that improve the verdict are remedies, ranked: those that make it fit first, cheapest
first; then the rest, by the host need they leave. The others are kept apart, with the
verdict they would leave, as what does not help."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.units import GiB, MiB, rounded, size
from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.intel import driver_facts as dfacts
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.startup import codes, limits, resizing
from vllm_xpu_memfix.startup import phases as model
from vllm_xpu_memfix.startup.known import Source, exact

# Cheapest first: a variable, a plugin switch, a flag that costs time, one that costs KV
# cache, one that costs P2P, an image, a checkpoint, a driver, a kernel, hardware.
COST_ORDER = (
    codes.VLLM_ACCEPTS,
    codes.DRIVER_GUARD,
    codes.KV_HEADROOM,
    codes.LOAD_SLOTS,
    codes.GPU_MEMORY_UTILIZATION,
    codes.NO_PEER_ACCESS,
    codes.NEWER_IMAGE,
    codes.MAX_MODEL_LEN,
    codes.KV_CACHE_DTYPE,
    codes.QUANTIZE,
    codes.PREQUANTIZED_CHECKPOINT,
    codes.COMPUTE_RUNTIME_26_27,
    codes.COMPUTE_RUNTIME_26_05,
    codes.KERNEL_7_1,
    codes.CONTAINER_LIMIT,
    codes.MORE_HOST_RAM,
    codes.TP_FOR_GPUS,
    codes.MORE_GPUS,
)
_RANK = {verdict: i for i, verdict in enumerate(codes.VERDICTS)}
LOWEST_UTILIZATION = 0.30
PLUGIN = "vllm-xpu-memfix"
# Formats tried for quantize, with their device bytes per linear weight and their cost.
QUANT_FORMATS = (
    ("fp8", 1.0, "-q fp8: 8-bit weights, converted while loading; a small accuracy cost"),
    (
        "sym_int4",
        catalog.ONE_LAYOUT,
        "-q sym_int4 (Intel's llm-scaler images): 4-bit weights, converted while loading; "
        "a larger accuracy cost",
    ),
)


@dataclass(frozen=True)
class Context:
    """What the remedies' wording needs beyond the model's inputs."""

    user_set: Mapping[str, str] = field(default_factory=dict)  # driver keys the user set
    room: Room | None = None
    image: catalog.Image | None = None
    # vLLM refused: the changes its configuration accepts, (code, what, cost, inputs)
    accepted: tuple[tuple[str, str, str, model.Inputs], ...] = ()


@dataclass(frozen=True)
class Remedy:
    code: str
    what: str
    cost: str
    after: model.Outcome
    removes: tuple[str, ...] = ()  # causes of the verdict before that it removes

    def helps(self, before: model.Outcome) -> bool:
        """Whether it leaves a better verdict, or the same at-risk one with less need, or
        removes a cause the verdict names."""
        after, now = _RANK[self.after.verdict], _RANK[before.verdict]
        if after != now:
            return after < now
        if self.removes:
            return True
        return before.verdict == codes.AT_RISK and self.after.host_need < before.host_need

    def as_dict(self) -> dict[str, object]:
        device = self.after.device_need
        return {
            "code": self.code,
            "what": self.what,
            "cost": self.cost,
            "removes": list(self.removes),
            "host_need_after_gib": rounded(self.after.host_need / GiB, 2),
            "device_need_after_gib": None if device is None else rounded(device / GiB, 2),
            "verdict_after": self.after.verdict,
        }


def _gib(value: float) -> str:
    return size(value)


def _guard(inp: model.Inputs, context: Context) -> str:
    keys = "NEOReadDebugKeys=1 EnableDeferBacking=0"
    if not inp.plugin:
        return f"set {keys} for vllm serve, or install {PLUGIN} (its driver guard sets them)"
    if context.user_set:
        return f"unset {' '.join(context.user_set)}: the plugin's driver guard then sets {keys}"
    return f"{config.DRIVER_ENV.env}=auto (or on): the plugin's driver guard sets {keys}"


def _no_peer(inp: model.Inputs) -> str:
    keys = f"{dfacts.READ_DEBUG_KEYS}=1 {dfacts.FORCE_PEER_ACCESS}=0"
    switch = config.SWITCHES[config.DRIVER_ENV.key]
    if inp.plugin and "no_peer_access" in switch.choices:
        return f"{config.DRIVER_ENV.env}=no_peer_access (sets {keys})"
    return f"set {keys} for vllm serve"


def _utilization(inp: model.Inputs) -> float | None:
    """The largest utilisation below the asked one at which the start-up fits."""
    steps = round((inp.utilization - LOWEST_UTILIZATION) * 100)
    for step in range(1, steps + 1):
        value = round(inp.utilization - step / 100, 2)
        if model.run(replace(inp, utilization=value)).memory_fits:
            return value
    return None


def _slots(inp: model.Inputs) -> int:
    """The most ranks that may stage at once with the start-up fitting (1 at the least)."""
    for slots in range(inp.staging_ranks - 1, 0, -1):
        if model.run(replace(inp, staging_slots=slots)).memory_fits:
            return slots
    return 1


def _first_better(
    before: model.Outcome, tries: list[tuple[model.Inputs, str, str]]
) -> tuple[model.Inputs, str, str] | None:
    """The first try that fits, else the first that leaves a better verdict."""
    judged = [(model.run(inputs), (inputs, what, cost)) for inputs, what, cost in tries]
    fitting = [found for after, found in judged if after.memory_fits]
    better = [found for after, found in judged if _RANK[after.verdict] < _RANK[before.verdict]]
    return next(iter(fitting or better), None)


def _more_gpus(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """The smallest larger TP, over as many GPUs, with which the start-up fits (or does
    better)."""
    inp = out.inputs
    if limits.ranks_over_gpus(inp):
        return []  # the GPUs it has are too few already: tp_for_visible_gpus
    visible = min(inp.host_ranks, inp.gpus_in_context or inp.host_ranks)
    found = _first_better(out, resizing.gpu_tries(inp, visible))
    return [(codes.MORE_GPUS, found[1], found[2], found[0])] if found else []


def _quantize_tries(inp: model.Inputs) -> list[tuple[model.Inputs, str, str]]:
    if inp.prequantized or inp.linear_bytes_per_weight.low < 2.0 or not inp.linear_params:
        return []
    return [
        (
            replace(
                inp,
                linear_bytes_per_weight=exact(per_weight, f"-q {name}", Source.GIVEN),
                on_the_fly=True,
                int4_layouts=1 if name == "sym_int4" else 0,
                legacy_load=False,
            ),
            f"-q {name}",
            cost,
        )
        for name, per_weight, cost in QUANT_FORMATS
    ]


def _quantize(out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    """The first format, fewest bytes lost first, with which the start-up fits (or does
    better). Never for a checkpoint quantized ahead of time."""
    found = _first_better(out, _quantize_tries(out.inputs))
    return [(codes.QUANTIZE, found[1], found[2], found[0])] if found else []


def _candidates(context: Context, out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    inp = out.inputs
    found: list[tuple[str, str, str, model.Inputs]] = []
    peer_oom = inp.gpus_in_context >= 2 and inp.peer_oom is not False
    if inp.host_copy:
        found.append(
            (
                codes.DRIVER_GUARD,
                _guard(inp, context),
                "a debug key: Intel's interim workaround (vllm #50269), which its driver "
                "maintainer calls debug-only; P2P is kept",
                replace(inp, defer_backing_off=True),
            )
        )
        production = driver.runtime_from_version(dfacts.PRODUCTION_ROUTE.tag, "remedy")
        found.append(
            (
                codes.COMPUTE_RUNTIME_26_05,
                f"compute-runtime {dfacts.PRODUCTION_ROUTE.tag} (in a container: the image's)",
                dfacts.PRODUCTION_ROUTE_CAVEATS,
                replace(inp, runtime=production),
            )
        )
    if inp.host_copy or peer_oom:
        cost = "none at TP 1" if inp.tp == 1 else f"no P2P: {dfacts.NO_PEER_ACCESS_COST}"
        found.append(
            (codes.NO_PEER_ACCESS, _no_peer(inp), cost, replace(inp, peer_access_off=True))
        )
    if peer_oom:
        fixed = driver.runtime_from_version(dfacts.XE_PEER_OOM_FIXED_ON_MASTER.tag, "remedy")
        found.append(
            (
                codes.COMPUTE_RUNTIME_26_27,
                f"compute-runtime {dfacts.XE_PEER_OOM_FIXED_ON_MASTER.tag} or newer (or "
                f"{dfacts.XE_PEER_OOM_FIXED.tag}; in a container: the image's)",
                "a newer driver; on kernels before 7.1 it reports no P2P; Battlemage keeps "
                "the host copy",
                replace(inp, runtime=fixed),
            )
        )
        found.append(
            (
                codes.KERNEL_7_1,
                "Linux 7.1 or newer on the host (a container runs on the host's kernel)",
                "a kernel upgrade; P2P kept; does not remove the host copy",
                replace(inp, kernel=driver.Kernel("7.1", dfacts.KERNEL_FIXED)),
            )
        )
    # Staging matters where it is the whole shard, or where the load is what runs out.
    staging_matters = inp.legacy_load or out.fails_at == {
        "phase": codes.LOAD,
        "where": codes.HOST,
    }
    if inp.staging and inp.staging_ranks > 1 and staging_matters:
        slots = _slots(inp)
        honour = "" if inp.plugin else f" with {PLUGIN} installed (vLLM alone ignores it)"
        found.append(
            (
                codes.LOAD_SLOTS,
                f"--max-parallel-loading-workers {slots}{honour}: {slots} rank(s) stage at once",
                f"the load takes up to {inp.staging_ranks / slots:.1f}x as long",
                replace(inp, staging_slots=slots),
            )
        )
    if inp.on_the_fly and staging_matters:
        found.append(
            (
                codes.PREQUANTIZED_CHECKPOINT,
                "serve a checkpoint of this model quantized ahead of time",
                "needs such a checkpoint (GPTQ/AWQ int4, or a static FP8); nothing is "
                "converted on the host",
                replace(inp, on_the_fly=False),
            )
        )
    if inp.int4_layouts == 2:
        found.append(
            (
                codes.NEWER_IMAGE,
                f"{_one_layout_image(context)} (one device layout per sym_int4 weight, "
                "llm-scaler PR #589)",
                "an image pull; the same vLLM 0.21 line",
                replace(
                    inp,
                    int4_layouts=1,
                    linear_bytes_per_weight=exact(catalog.ONE_LAYOUT, "one layout", Source.GIVEN),
                ),
            )
        )
    if inp.kv_cache_bytes is None and inp.device_bytes and out.verdict != codes.WILL_FAIL:
        value = _utilization(inp)
        if value is not None:
            before, after = inp.kv_cache or 0.0, replace(inp, utilization=value).kv_cache or 0.0
            found.append(
                (
                    codes.GPU_MEMORY_UTILIZATION,
                    f"--gpu-memory-utilization {value:.2f}",
                    f"KV cache per rank {_gib(before)} -> {_gib(after)}: fewer tokens in flight",
                    replace(inp, utilization=value),
                )
            )
    if not inp.kv_headroom and inp.burst is not None and inp.kv_cache_bytes is None:
        on = replace(inp, kv_headroom=True)
        if out.fails_at == {"phase": codes.WARMUP, "where": codes.DEVICE}:
            switch = f"{config.KV_HEADROOM.env}=auto" if inp.plugin else f"install {PLUGIN}"
            found.append(
                (
                    codes.KV_HEADROOM,
                    f"{switch}: its kv_headroom keeps the gathered logits and a slack out of "
                    "the KV cache",
                    f"{size(on.reserve, MiB)} less KV cache per rank",
                    on,
                )
            )
    found += _more_room(context, out)
    found += resizing.context(out)
    found += resizing.higher_utilization(out)
    found += _quantize(out)
    found += resizing.tp_for_gpus(out)
    found += _more_gpus(out)
    return found


def _one_layout_image(context: Context) -> str:
    """The one-layout image; never one older than the image the machine runs."""
    order = [image.tag for image in catalog.IMAGES]
    target = catalog.ONE_LAYOUT_IMAGE.rpartition(":")[2]
    image = context.image
    if image is not None and order.index(image.tag) > order.index(target):
        return f"an llm-scaler image newer than {image.tag}"
    return catalog.ONE_LAYOUT_IMAGE


def _more_room(context: Context, out: model.Outcome) -> list[tuple[str, str, str, model.Inputs]]:
    inp = out.inputs
    host_trouble = out.fails_at is not None and out.fails_at["where"] == codes.HOST
    if inp.room is None or not (host_trouble or out.verdict == codes.AT_RISK):
        return []
    wanted = out.host_need / model.AT_RISK_SHARE
    extra = max(0.0, wanted - inp.room)
    if extra <= 0:
        return []
    room = context.room
    cgroup = room.cgroup.room if room else None
    available = room.mem_available if room else None
    if cgroup is not None and available is not None and cgroup < available:
        return [
            (
                codes.CONTAINER_LIMIT,
                f"raise the container's memory limit by {_gib(extra)} (docker run --memory)",
                "the host must have the memory",
                replace(inp, room=min(float(available), wanted)),
            )
        ]
    return [
        (
            codes.MORE_HOST_RAM,
            f"{_gib(extra)} more host RAM: the need {_gib(out.host_need)} within "
            f"{model.AT_RISK_SHARE:.0%} of the room (now {_gib(inp.room)})",
            "hardware; or fewer GPUs per host",
            replace(inp, room=inp.room + extra),
        )
    ]


@dataclass(frozen=True)
class Judged:
    """The remedies that improve the verdict, ranked, and those that do not."""

    remedies: list[Remedy]
    not_helping: list[Remedy]


_NOT_REMOVED = {codes.PROCESS_BASELINE}
# The remedies of a possible fatal failure: they help only if it holds.
_IF_IT_HOLDS = {codes.NO_PEER_ACCESS, codes.COMPUTE_RUNTIME_26_27, codes.KERNEL_7_1}


def _removed(before: model.Outcome, after: model.Outcome) -> tuple[str, ...]:
    gone = {c.code for c in before.causes} - {c.code for c in after.causes}
    return tuple(c.code for c in before.causes if c.code in gone - _NOT_REMOVED)


def _remedy(out: model.Outcome, code: str, what: str, cost: str, inputs: model.Inputs) -> Remedy:
    if code in _IF_IT_HOLDS and out.memory_verdict is not None:
        what += " (if compute-runtime #916 holds)"
    after = model.run(inputs)
    return Remedy(code, what, cost, after, _removed(out, after))


def _changes(inp: model.Inputs, changed: model.Inputs) -> dict[str, Any]:
    return {
        spec.name: getattr(changed, spec.name)
        for spec in fields(model.Inputs)
        if getattr(changed, spec.name) != getattr(inp, spec.name)
    }


def _combination(
    out: model.Outcome, found: list[tuple[str, str, str, model.Inputs]]
) -> list[Remedy]:
    """Where no one remedy makes the start-up fit: the cheapest pair that does (cost order
    first, then fewest GPUs)."""
    inp = out.inputs
    visible = min(inp.host_ranks, inp.gpus_in_context or inp.host_ranks)
    moves = list(found)
    moves += [(codes.MORE_GPUS, w, c, i) for i, w, c in resizing.gpu_tries(inp, visible)]
    moves += [(codes.QUANTIZE, w, c, i) for i, w, c in _quantize_tries(inp)]
    pairs = [(a, b) for n, a in enumerate(moves) for b in moves[n + 1 :] if a[0] != b[0]]
    pairs.sort(key=lambda p: sorted((COST_ORDER.index(p[0][0]), COST_ORDER.index(p[1][0])))[::-1])
    for a, b in pairs:
        first, second = _changes(inp, a[3]), _changes(inp, b[3])
        if any(first[k] != second[k] for k in first.keys() & second.keys()):
            continue
        merged = replace(inp, **first, **{k: v for k, v in second.items() if k not in first})
        if model.run(merged).memory_fits:
            code = codes.JOINED.join((a[0], b[0]))
            return [_remedy(out, code, f"{a[1]}; and {b[1]}", f"{a[2]}; {b[2]}", merged)]
    return []


def remedies(out: model.Outcome, context: Context | None = None) -> Judged:
    """Each remedy that applies, with the outcome of the model run with it; where none
    makes the start-up fit alone, the cheapest combination that does."""
    if out.verdict == codes.FITS:
        return Judged([], [])
    # vLLM's refusal is not memory's: only a TP that divides the heads answers one.
    refused = out.main_cause == codes.VLLM_REFUSES
    context = context or Context()
    if refused:
        candidates = list(context.accepted) or resizing.tp_for_heads(out)
    else:
        candidates = _candidates(context, out)
    found = [_remedy(out, *candidate) for candidate in candidates]
    if not any(r.after.memory_fits for r in found):
        found += _combination(out, candidates)
    ranked = sorted(
        found,
        key=lambda r: (_RANK[r.after.verdict], _cost(r.code), r.after.host_need),
    )
    return Judged([r for r in ranked if r.helps(out)], [r for r in ranked if not r.helps(out)])


def _cost(code: str) -> int:
    return max(COST_ORDER.index(part) for part in code.split(codes.JOINED))
