"""Preflight: doctor's answer inside ``vllm serve``, before any weight is read.

Problem
    Users run ``vllm serve``, not ``doctor``. In llm-scaler #703 the host ran out of memory
    and went down during start-up; where the kernel's OOM killer takes a worker instead,
    vLLM says only that the engine core failed (0.32: ``wait_for_engine_startup`` raises
    "Engine core initialization failed ... Failed core proc(s)"), not which process, at which
    phase, or why.
Mechanism
    In the process that builds the ``VllmConfig`` (the API server of ``vllm serve``, the
    process of ``LLM(...)``), right after ``create_engine_config`` returns and before
    EngineCore and the workers are spawned, judge what vLLM resolved, on the devices vLLM's
    platform will use. Under the XPU platform: the start-up model (``startup``) on the
    engine's own hf_config, context, parallel layout, quantization and KV dtype, the
    checkpoint's headers (``startup.engine_weights``: its directory, the Hugging Face
    cache, else the Hub by range request within 5 s, else parameters estimated from
    hf_config, a quantized one's width a range), and on this host as doctor reads it
    (``startup.host``, under the sysroot: the Intel devices Level Zero will enumerate,
    the room, the legacy sym_int4 load, the int4 layouts).
    Under the CPU backend: the weights and the KV cache against the room
    (``startup.cpu_backend``). Any other platform: one INFO line, nothing judged. One line
    (INFO where it fits, else WARNING): the verdict, where it runs out, the main cause,
    the first remedy and what is not certain; the figures follow at DEBUG. An input not
    read (the room) or a dimension not modelled caps the verdict at "at risk". The driver
    guard's keys are taken from ``os.environ``: the guard runs earlier in this process and
    sets them there, so that environment is what the spawned processes inherit. Any
    internal error is one DEBUG line and no verdict. The ``oom_kill`` counter of
    /proc/vmstat is read at the same time; if the engine's start-up then fails and it
    rose, one line names the process the kernel most likely killed (of the ledger's
    processes no longer alive, the largest by its last RssAnon, as the OOM killer ranks),
    its last phase, the host memory then and the likely cause; the ledger files are read
    through ``core.files`` (bounded, regular files only), their strings escaped.
Targets
    ``vllm.engine.arg_utils:EngineArgs.create_engine_config`` (``vllm serve``'s API server,
    ``LLM`` and ``AsyncLLM`` call it before spawning anything);
    ``vllm.v1.engine.utils:wait_for_engine_startup`` (where the API server learns that the
    engine's start-up failed);
    ``vllm.entrypoints.launchers.api_server.entry:build_and_serve`` (from vLLM 0.29) and
    ``vllm.entrypoints.openai.api_server:build_and_serve`` (0.26 to 0.28, a re-export
    after): the ready point, ``prediction_check``; each release has one, which serves.
Switch
    ``VLLM_XPU_MEMFIX_PREFLIGHT``: auto and on (the line), off (nothing judged or logged),
    refuse (on a certain "will run out of memory" or "will fail": one ERROR record naming
    the switch and the first remedy, then :class:`PreflightRefused`, a ``RuntimeError`` a
    caller of ``LLM(...)`` can catch; uncaught, as in ``vllm serve``, exit status 1 without
    a traceback; never by default).
Upstream
    None: vLLM has no host-memory model of its start-up. The judgement needs the start-up
    model of this plugin, so it stays here.
Remove when
    vLLM judges a start-up's host and device memory before it spawns workers
    (``arg_utils`` mentions ``oom_kill`` or a preflight).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import fit, get_logger, listed, see
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.units import GiB
from vllm_xpu_memfix.startup import prediction_check

if TYPE_CHECKING:
    from vllm_xpu_memfix.startup.host import HostFacts
    from vllm_xpu_memfix.startup.sizing import Machine, ServeArgs

logger = get_logger("preflight")

FIX = config.PREFLIGHT
REMOVE_WHEN = RemoveWhen(
    "vLLM judges the start-up's memory before it spawns workers",
    "vllm.engine.arg_utils",
    ("oom_kill", "preflight"),
)
MAX_RECORD = 320
HEAD = "vllm-xpu-memfix preflight:"
NOT_FITTING = ("will run out of memory", "will fail")
# The longest the preflight waits for the Hub's metadata of a model not yet downloaded.
HUB_DEADLINE = 5.0


class PreflightRefused(RuntimeError):
    """``VLLM_XPU_MEMFIX_PREFLIGHT=refuse`` and the start-up certainly will not fit.

    An ordinary exception, so a library caller (``LLM(...)``, ``AsyncLLMEngine``) can catch
    it and its program goes on. Left uncaught, as in ``vllm serve``, the process exits with
    Python's status 1 and no traceback (:func:`_quiet_when_uncaught`): the one ERROR record
    already said it."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def _quiet_when_uncaught() -> None:
    """Install, once, a ``sys.excepthook`` that prints nothing for an uncaught refusal."""
    previous = sys.excepthook
    if getattr(previous, "quiet_refusal", False):
        return

    def hook(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        if not isinstance(value, PreflightRefused):
            previous(kind, value, trace)

    hook.quiet_refusal = True  # type: ignore[attr-defined]
    sys.excepthook = hook


@dataclass
class Judgement:
    """What the preflight said, kept for the after-the-fact line."""

    line: str
    verdict: str | None
    cause: str | None
    oom_kills: int | None
    started: float


@dataclass(frozen=True)
class Verdict:
    """The line's parts: ``essential`` survive any cut, ``details`` fill what is left;
    ``uncertain`` names each input not read or dimension not modelled (no refusal then)."""

    verdict: str
    essential: list[str]
    details: list[str]
    uncertain: list[str]
    cause: str | None
    json: dict[str, Any]
    host_cause: str | None = None  # the OOM-kill line's likely cause: the host's largest


def platform_of(vllm_config: Any) -> str:
    """The device type of vLLM's platform for this engine (``xpu``, ``cpu``, ``cuda``...)."""
    return str(vllm_config.device_config.device_type)


def _device_words(gpus: list[Any], machine: Machine) -> str:
    if not gpus:
        return "no Intel GPU visible"
    counts = Counter(gpu.product for gpu in gpus)
    size = machine.device_bytes
    memory = f", {size / GiB:,.1f} GiB" if size else ""
    return " + ".join(f"{count}x {product}" for product, count in counts.items()) + memory


def _host_cause(outcome: Any) -> str:
    from vllm_xpu_memfix.startup import codes

    host = [c for c in outcome.causes if codes.CAUSE_SIDE.get(c.code) == codes.HOST]
    return max(host, key=lambda c: c.gib).code if host else outcome.main_cause


def this_machine(
    settings: Settings, args: ServeArgs, ckpt: Any, environ: Mapping[str, str]
) -> tuple[HostFacts, Machine]:
    """This host's facts and, from them, the machine the start-up model judges (built as
    doctor builds it: ``startup.host.machine``, with the same legacy-load and int4-layout
    readers). ``environ`` already holds the guard's keys."""
    from vllm_xpu_memfix.startup import host

    facts = host.read(settings.sysroot, environ)
    device, _ = host.device_bytes(host.used_gpus(facts, args), args.device_memory_gib)
    sym_int4 = host.installed_sym_int4()
    legacy = host.legacy_load(environ, sym_int4)
    slots = host.load_slots(settings, args, legacy[0], facts.room, ckpt)
    machine = host.machine(
        facts,
        settings,
        environ,
        device_bytes=device,
        load_slots=slots,
        legacy_load=legacy,
        int4_layouts=host.int4_layouts(args.quantization, sym_int4)[0],
    )
    return facts, machine


def judge_xpu(
    args: ServeArgs, ckpt: Any, source: str, settings: Settings, environ: Mapping[str, str]
) -> Verdict:
    """The start-up model on this host's Intel GPUs, as doctor runs it."""
    from vllm_xpu_memfix.startup import codes, engine_weights, host, phases, remedies, sizing

    facts, machine = this_machine(settings, args, ckpt, environ)
    inputs = engine_weights.widen_unread(sizing.inputs_for(machine, args, ckpt), ckpt, source)
    outcome = phases.run(inputs)
    judged = remedies.remedies(outcome, remedies.Context(room=facts.room))
    # The model caps what a not-modelled flag changes at "at risk" (phases.unmodelled_on);
    # what was not read is capped here.
    uncertain = []
    if facts.room.problem:
        uncertain.append("host room unreadable")
    if ckpt is None:
        uncertain.append("weights not sized")
    if outcome.main_cause == codes.DRIVER_HOST_COPY and machine.runtime is None:
        uncertain.append("compute-runtime unknown")
    verdict = outcome.verdict
    if verdict in NOT_FITTING and uncertain:
        verdict = codes.AT_RISK
    where = ""
    if outcome.fails_at:
        where = f" at {outcome.fails_at['phase']} on the {outcome.fails_at['where']}"
    gpus = host.used_gpus(facts, args)
    essential = [f"{verdict.upper()}{where} (TP {args.tensor_parallel_size})"]
    details = [_device_words(gpus, machine)]
    if outcome.why:
        details.append(outcome.why)
    if machine.device_bytes is None:
        details.append("device not judged (its memory is unknown)")
    if facts.room.problem:
        details.append(f"host not judged: {facts.room.problem}")
    if codes.HOST not in outcome.not_judged and machine.room is not None:
        details.append(f"host need {outcome.host_need / GiB:,.1f} GiB of {machine.room / GiB:,.1f}")
    essential.append(f"main cause {outcome.main_cause}")
    if outcome.verdict != codes.FITS and judged.remedies:
        first = judged.remedies[0]
        essential.append(f"first remedy {first.code}")
        details.insert(1, f"{first.code}: {first.what}")
    if uncertain:
        essential.append(f"not certain: {listed(uncertain, 100)}")
    details_json = {
        "platform": "xpu",
        "host_includes": "the processes (assumed), staging, the driver's host copy",
        "verdict": outcome.verdict,
        "fails_at": outcome.fails_at,
        "why": outcome.why,
        "main_cause": outcome.main_cause,
        "uncertain": uncertain,
        "checkpoint": source,
        "phases": {
            name: {
                "host_gib": round(p.host / GiB, 2),
                "device_gib": None if p.device is None else round(p.device / GiB, 2),
            }
            for name, p in outcome.phases.items()
        },
        "causes": [{"code": c.code, "gib": round(c.gib, 2)} for c in outcome.causes],
        "remedies": [r.code for r in judged.remedies],
        "not_helping": [r.code for r in judged.not_helping],
    }
    host_cause = _host_cause(outcome)
    return Verdict(
        verdict, essential, details, uncertain, outcome.main_cause, details_json, host_cause
    )


def judge_cpu(vllm_config: Any, args: ServeArgs, ckpt: Any, settings: Settings) -> Verdict:
    """vLLM's CPU backend in its own terms (``startup.cpu_backend``): host memory only."""
    from vllm_xpu_memfix.memory.room import host_room
    from vllm_xpu_memfix.startup import codes, cpu_backend, domain, limits

    room = host_room(settings.sysroot)
    workers = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
    kv = float(args.kv_cache_memory_bytes or 0) * workers
    outcome = cpu_backend.judge(float(ckpt.total_bytes) if ckpt else 0.0, kv, room, workers)
    if outcome is None:
        line = "NOT JUDGED on vLLM's CPU backend: host room unreadable"
        json_ = {"platform": "cpu", "room": None}
        return Verdict(codes.FITS, [line], [str(room.problem)], [], None, json_)
    flags = [f for f in args.not_modelled if domain.side_of(f) in (codes.HOST, domain.BOTH)]
    if outcome.phase is not None:  # only a flag that could lower the failing phase
        flags = limits.rescuing(flags, outcome.phase)
    uncertain = [f"{listed(flags, 60)} not modelled"] if flags else []
    if ckpt is None or args.quantization:
        uncertain.append("weights not sized")
    verdict = codes.AT_RISK if outcome.verdict in NOT_FITTING and uncertain else outcome.verdict
    where = f" at {outcome.phase} on the host" if outcome.phase else ""
    essential = [f"{verdict.upper()}{where} on vLLM's CPU backend"]
    details = [outcome.why]
    if outcome.remedy:
        essential.append(f"first remedy {outcome.remedy}")
        if outcome.remedy in codes.REMEDIES:
            details.append(f"{outcome.remedy}: {codes.REMEDIES[outcome.remedy]}")
    if uncertain:
        essential.append(f"not certain: {listed(uncertain, 100)}")
    json_ = {"platform": "cpu", "verdict": outcome.verdict, "phase": outcome.phase, **outcome.gib}
    return Verdict(verdict, essential, details, uncertain, None, {**json_, "why": outcome.why})


def judge(
    vllm_config: Any,
    settings: Settings,
    environ: Mapping[str, str],
    not_modelled: tuple[str, ...] = (),
) -> Verdict | None:
    """The preflight's verdict for ``vllm_config`` on this host; None where vLLM's platform
    is neither XPU nor CPU (one INFO line says so)."""
    from vllm_xpu_memfix.startup import engine_config, engine_weights

    platform = platform_of(vllm_config)
    if platform not in ("xpu", "cpu"):
        logger.info(
            "%s not judged: vLLM runs on its %s platform; the preflight judges Intel GPUs "
            "under vLLM's XPU platform and the host under its CPU backend",
            HEAD,
            platform,
        )
        return None
    args = engine_config.serve_args(vllm_config, not_modelled)
    ckpt, source = engine_weights.checkpoint(vllm_config, HUB_DEADLINE)
    if platform == "cpu":
        return judge_cpu(vllm_config, args, ckpt, settings)
    return judge_xpu(args, ckpt, source, settings, environ)


def line_of(verdict: Verdict, prefix: str = HEAD) -> str:
    """One record of at most 320 characters: the essential parts whole, the details in
    what is left, then the pointer to the main cause's section."""
    tail = f"; see {see(verdict.cause)}" if verdict.cause else ""
    head = f"{prefix} {'; '.join(verdict.essential)}"
    room = MAX_RECORD - len(head) - len(tail)
    details = "; ".join(verdict.details)
    if details and room > 8:
        head += fit(f"; {details}", room)
    return fit(head + tail)


def _log_details(details: dict[str, Any]) -> None:
    """The dict at DEBUG, split so that no record exceeds 320 characters."""
    text = json.dumps(details, separators=(",", ":"))
    width = MAX_RECORD - 40
    chunks = [text[i : i + width] for i in range(0, len(text), width)]
    for index, chunk in enumerate(chunks, 1):
        logger.debug("vllm-xpu-memfix preflight json %d/%d: %s", index, len(chunks), chunk)


def _oom_kills(settings: Settings) -> int | None:
    from vllm_xpu_memfix.memory.snapshot import ProcReader

    try:
        return ProcReader(settings.sysroot).vmstat().get("oom_kill")
    except Exception:
        return None


def run_preflight(
    vllm_config: Any,
    settings: Settings,
    state: dict[str, Judgement],
    not_modelled: tuple[str, ...] = (),
) -> None:
    """Judge, log, and remember; raises only :class:`PreflightRefused`, and only on a
    verdict that every input was read for and every dimension modelled."""
    from vllm_xpu_memfix.startup import codes

    started = time.time()
    try:
        verdict = judge(vllm_config, settings, os.environ, not_modelled)
    except Exception as exc:  # never into vLLM
        logger.debug(fit(f"{HEAD} no verdict (internal error: {exc!r})"))
        verdict = None
    line = "" if verdict is None else line_of(verdict)
    said, cause = (verdict.verdict, verdict.host_cause) if verdict else (None, None)
    state["last"] = Judgement(line, said, cause, _oom_kills(settings), started)
    if verdict is None:
        return
    refuse = settings.mode(FIX) is Mode.REFUSE
    if refuse and verdict.verdict in NOT_FITTING and not verdict.uncertain:
        stopped = line_of(verdict, f"{HEAD} stopped by {FIX.env}=refuse:")
        logger.error("%s", stopped)
        _log_details(verdict.json)
        _quiet_when_uncaught()
        raise PreflightRefused(stopped)
    (logger.info if verdict.verdict == codes.FITS else logger.warning)("%s", line)
    _log_details(verdict.json)
    prediction_check.keep(settings, verdict, line)


def after_the_fact(settings: Settings, judgement: Judgement | None, error: BaseException) -> None:
    """After a failed engine start-up: one line if the kernel's OOM killer acted since
    the preflight, and a ledger row."""
    from vllm_xpu_memfix.memory import oom_victim

    if judgement is None or judgement.oom_kills is None:
        return
    now = _oom_kills(settings)
    if now is None or now <= judgement.oom_kills:
        return
    rows = oom_victim.ledger_rows(settings.ledger_dir, judgement.started)
    victim = oom_victim.likely_victim(rows, error)
    cause = judgement.cause or "unknown (no preflight verdict)"
    skipped = f"; {rows.skipped} ledger row(s) skipped, unreadable" if rows.skipped else ""
    pointer = f"; see {see(judgement.cause)}" if judgement.cause else ""
    who = oom_victim.victim_words(victim, settings.ledger_dir is not None)
    line = fit(
        f"vllm-xpu-memfix: start-up failed after the kernel's OOM killer acted (oom_kill "
        f"{judgement.oom_kills} -> {now}): likely {who}; likely cause {cause}{skipped}{pointer}"
    )
    logger.error("%s", line)
    if settings.ledger_dir is not None:
        from vllm_xpu_memfix.core.process import current_role
        from vllm_xpu_memfix.memory.ledger import Ledger

        Ledger(str(current_role()), settings.ledger_dir).record(
            "killed by the OOM killer",
            oom_kill_before=judgement.oom_kills,
            oom_kill_after=now,
            victim_pid=None if victim is None else victim["pid"],
            victim_role=None if victim is None else victim.get("role"),
            victim_phase=None if victim is None else victim.get("phase"),
            likely_cause=judgement.cause,
            ledger_rows_skipped=rows.skipped,
            error=fit(str(error), 200),
        )


def not_modelled_flags(engine_args: Any) -> tuple[str, ...]:
    """The EngineArgs fields set away from their default that the model does not cover
    (``startup.domain``), as flags; none where they cannot be read."""
    from vllm_xpu_memfix.startup import domain

    try:
        return domain.not_modelled(engine_args)
    except Exception as exc:  # never into vLLM
        logger.debug(fit(f"{HEAD} engine arguments not classified: {exc!r}"))
        return ()


def patches(settings: Settings) -> tuple[Patch, ...]:
    state: dict[str, Judgement] = {}

    def after_config(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        # Before the call: vLLM fills some fields in place (enable_chunked_prefill), and
        # those are its resolution, not the user's flags.
        flags = not_modelled_flags(instance)
        vllm_config = wrapped(*args, **kwargs)
        run_preflight(vllm_config, settings, state, flags)
        return vllm_config

    def around_startup(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except Exception as exc:
            try:
                after_the_fact(settings, state.get("last"), exc)
            except Exception as inner:  # never into vLLM
                logger.debug(fit(f"vllm-xpu-memfix: OOM-kill check failed: {inner!r}"))
            raise

    return (
        Patch(FIX.key, "vllm.engine.arg_utils:EngineArgs.create_engine_config", after_config),
        Patch(FIX.key, "vllm.v1.engine.utils:wait_for_engine_startup", around_startup),
        *prediction_check.patches(FIX.key, settings),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(patches(settings))
