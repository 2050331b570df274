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
    EngineCore and the workers are spawned: run the start-up model (``startup``) on that
    configuration and this machine, and log one line (INFO where it fits, else WARNING):
    the verdict, where it runs out, the main cause and the first remedy; the doctor
    ``--json``-like dict follows at DEBUG, in records of at most 320 characters. The
    machine is read as doctor reads it (``startup.host``, under the sysroot). The driver
    guard's keys are taken from ``os.environ``: the guard runs earlier in this same process
    (it is installed first) and sets them there, so that environment is exactly what the
    spawned processes inherit; a fix may not import another fix, and re-deciding here would
    be a second copy of the guard's decision. The checkpoint is read from its directory
    (safetensors headers; a directory with config.json only is sized from its sizes), or
    from the Hugging Face cache for a model id. Any internal error is one DEBUG line and no
    verdict. The ``oom_kill`` counter of /proc/vmstat is read at the same time; if the
    engine's start-up then fails and the counter has risen, one line names the process
    the kernel most likely killed (the largest by its last ledger RssAnon, as the OOM
    killer ranks), its last ledger phase (``VLLM_XPU_MEMFIX_LEDGER_DIR``), the host memory
    then and the likely cause code, and the API server's ledger records it (EngineCore where
    vLLM reports its exit code as -9, else a worker).
    When the API server's engine is ready, one INFO line puts the predicted host (and device)
    need beside what was measured then, as a ratio (``startup.prediction_check``).
Targets
    ``vllm.engine.arg_utils:EngineArgs.create_engine_config`` (``vllm serve``'s API server,
    ``LLM`` and ``AsyncLLM`` call it before spawning anything);
    ``vllm.v1.engine.utils:wait_for_engine_startup`` (where the API server learns that the
    engine's start-up failed);
    ``vllm.entrypoints.launchers.api_server.entry:build_and_serve`` (the API server's engine
    is ready: the prediction beside the measurement, ``startup.prediction_check``).
Switch
    ``VLLM_XPU_MEMFIX_PREFLIGHT``: auto (the line; on a host without Intel GPUs it says the
    device is not judged), on (the same), off (nothing is judged or logged), refuse (the
    line, then an error that stops the start-up when the verdict is "will run out of
    memory" or "will fail"; never by default).
Upstream
    None: vLLM has no host-memory model of its start-up. The judgement needs the start-up
    model of this plugin, so it stays here.
Remove when
    vLLM judges a start-up's host and device memory before it spawns workers
    (``arg_utils`` mentions ``oom_kill`` or a preflight).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import get_logger, see
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.units import GiB

if TYPE_CHECKING:
    from vllm_xpu_memfix.startup.host import HostFacts
    from vllm_xpu_memfix.startup.prediction_check import Prediction
    from vllm_xpu_memfix.startup.sizing import Machine

logger = get_logger("preflight")

FIX = config.PREFLIGHT
REMOVE_WHEN = RemoveWhen(
    "vLLM judges the start-up's memory before it spawns workers",
    "vllm.engine.arg_utils",
    ("oom_kill", "preflight"),
)
MAX_RECORD = 320
# vLLM 0.32's API server calls it once its engine is up (startup.prediction_check).
READY = "vllm.entrypoints.launchers.api_server.entry:build_and_serve"
NOT_FITTING = ("will run out of memory", "will fail")


class PreflightRefused(RuntimeError):
    """``VLLM_XPU_MEMFIX_PREFLIGHT=refuse`` and the start-up will not fit."""


@dataclass
class Judgement:
    """What the preflight said, kept for the after-the-fact line."""

    line: str
    verdict: str | None
    cause: str | None
    oom_kills: int | None
    started: float
    prediction: Prediction | None = None


def _fit(text: str, limit: int = MAX_RECORD) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def serve_args(vllm_config: Any) -> Any:
    """The engine arguments the start-up model reads, from the engine's configuration."""
    from vllm_xpu_memfix.startup.sizing import ServeArgs

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    kv_bytes = getattr(cache, "kv_cache_memory_bytes", None)
    return ServeArgs(
        model=str(model.model),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        gpu_memory_utilization=float(cache.gpu_memory_utilization),
        quantization=model.quantization,
        dtype=str(model.dtype).removeprefix("torch."),
        max_parallel_loading_workers=getattr(parallel, "max_parallel_loading_workers", None),
        max_model_len=getattr(model, "max_model_len", None),
        max_num_seqs=getattr(sched, "max_num_seqs", None),
        max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None),
        kv_cache_memory_bytes=int(kv_bytes) if kv_bytes else None,
        kv_cache_dtype=getattr(cache, "cache_dtype", None),
    )


def checkpoint(vllm_config: Any) -> tuple[Any, str]:
    """The checkpoint (its directory, else the Hugging Face cache), else sized from the
    engine's hf_config; and where it came from."""
    from vllm_xpu_memfix.memory import hub_cache
    from vllm_xpu_memfix.memory.checkpoint import Checkpoint, read_checkpoint, read_config
    from vllm_xpu_memfix.startup.sizing import params_from_config

    name = str(vllm_config.model_config.model)
    directory = Path(name)
    if not directory.is_dir() and hub_cache.looks_like_repo_id(name):
        with contextlib.suppress(hub_cache.HubCacheError):
            directory = hub_cache.find_cached(name).snapshot
    if directory.is_dir():
        params = None
        if not any(directory.glob("*.safetensors")):
            params = params_from_config(read_config(directory)[0])
        return read_checkpoint(directory, params, name=name), str(directory)
    hf = vllm_config.model_config.hf_config.to_dict()
    params = params_from_config(hf)
    if params is None:
        return None, "hf_config (weights not sized)"
    return Checkpoint(None, (), (), hf, params * 2, f"{params:,} parameters from hf_config"), (
        "hf_config"
    )


def _device_words(facts: HostFacts, machine: Machine, tp: int) -> str:
    from vllm_xpu_memfix.startup import host

    used = host.used_gpus(facts, tp)
    if not used:
        return "no Intel GPU visible"
    size = machine.device_bytes
    memory = f", {size / GiB:,.1f} GiB" if size else ""
    return f"{len(used)}x {used[0].product}{memory}"


def _host_cause(outcome: Any) -> str:
    from vllm_xpu_memfix.startup import codes

    host = [c for c in outcome.causes if codes.CAUSE_SIDE.get(c.code) == codes.HOST]
    return max(host, key=lambda c: c.gib).code if host else outcome.main_cause


def this_machine(
    settings: Settings, args: Any, ckpt: Any, environ: Mapping[str, str]
) -> tuple[HostFacts, Machine]:
    """This host's facts and, from them, the machine the start-up model judges (built as
    doctor builds it: ``startup.host.machine``). ``environ`` already holds the guard's keys."""
    from vllm_xpu_memfix.startup import host

    facts = host.read(settings.sysroot, environ)
    tp = args.tensor_parallel_size
    device, _ = host.device_bytes(host.used_gpus(facts, tp), args.device_memory_gib)
    slots = host.load_slots(settings, args, False, facts.room, ckpt)
    machine = host.machine(facts, settings, environ, device_bytes=device, load_slots=slots)
    return facts, machine


def judge(vllm_config: Any, settings: Settings, environ: Mapping[str, str]) -> tuple[str, Any]:
    """The preflight line and the outcome, for ``vllm_config`` on this host."""
    from vllm_xpu_memfix.startup import codes, phases, remedies, sizing

    args = serve_args(vllm_config)
    ckpt, source = checkpoint(vllm_config)
    facts, machine = this_machine(settings, args, ckpt, environ)
    outcome = phases.run(sizing.inputs_for(machine, args, ckpt))
    judged = remedies.remedies(outcome, remedies.Context(room=facts.room))
    device = _device_words(facts, machine, args.tensor_parallel_size)
    where = ""
    if outcome.fails_at:
        where = f" at {outcome.fails_at['phase']} on the {outcome.fails_at['where']}"
    head = f"vllm-xpu-memfix preflight: {outcome.verdict.upper()}{where}"
    parts = [f"{head} (TP {args.tensor_parallel_size}, {device})"]
    if outcome.why:
        parts.append(outcome.why)
    if machine.device_bytes is None:
        parts.append("device not judged (its memory is unknown)")
    if outcome.host_judged and machine.room is not None:
        parts.append(f"host need {outcome.host_need / GiB:,.1f} GiB of {machine.room / GiB:,.1f}")
    parts.append(f"main cause {outcome.main_cause}")
    if outcome.verdict != codes.FITS and judged.remedies:
        first = judged.remedies[0]
        parts.append(f"first remedy {first.code}: {first.what}")
    tail = f"; see {see(outcome.main_cause)}"
    line = _fit("; ".join(parts), MAX_RECORD - len(tail)) + tail
    details = {
        "verdict": outcome.verdict,
        "fails_at": outcome.fails_at,
        "why": outcome.why,
        "main_cause": outcome.main_cause,
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
    return line, (outcome, details)


def _log_details(details: dict[str, Any]) -> None:
    """The dict at DEBUG, split so that no record exceeds 320 characters."""
    text = json.dumps(details, separators=(",", ":"))
    width = MAX_RECORD - 40
    chunks = [text[i : i + width] for i in range(0, len(text), width)]
    for index, chunk in enumerate(chunks, 1):
        logger.debug("vllm-xpu-memfix preflight json %d/%d: %s", index, len(chunks), chunk)


def _oom_kills(settings: Settings) -> int | None:
    from vllm_xpu_memfix.memory.snapshot import ProcReader

    return ProcReader(settings.sysroot).vmstat().get("oom_kill")


def run_preflight(vllm_config: Any, settings: Settings, state: dict[str, Judgement]) -> None:
    """Judge, log, and remember; raises only :class:`PreflightRefused`."""
    from vllm_xpu_memfix.startup import codes

    started = time.time()
    try:
        line, (outcome, details) = judge(vllm_config, settings, os.environ)
        state["last"] = Judgement(
            line, outcome.verdict, _host_cause(outcome), _oom_kills(settings), started
        )
    except Exception as exc:  # never into vLLM
        logger.debug(_fit(f"vllm-xpu-memfix preflight: no verdict (internal error: {exc!r})"))
        state["last"] = Judgement("", None, None, _safe_oom_kills(settings), started)
        return
    (logger.info if outcome.verdict == codes.FITS else logger.warning)("%s", line)
    _log_details(details)
    from vllm_xpu_memfix.startup import prediction_check

    state["last"].prediction = _guarded(
        "prediction", prediction_check.predicted, settings, outcome, line
    )
    if settings.mode(FIX) is Mode.REFUSE and outcome.verdict in NOT_FITTING:
        raise PreflightRefused(
            _fit(f"{line.removeprefix('vllm-xpu-memfix preflight: ')} ({FIX.env}=refuse)")
        )


def _guarded(what: str, call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception as exc:  # never into vLLM
        logger.debug(_fit(f"vllm-xpu-memfix preflight: no {what} (internal error: {exc!r})"))
        return None


def _safe_oom_kills(settings: Settings) -> int | None:
    try:
        return _oom_kills(settings)
    except Exception:
        return None


def _ledger_rows(directory: Path | None, since: float) -> dict[int, list[dict[str, Any]]]:
    """This start's ledger rows by process, other than this one's."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    if directory is None or not directory.is_dir():
        return by_pid
    for path in directory.glob("ledger-*.jsonl"):
        for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(text)
            except ValueError:
                continue
            pid = row.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and row.get("ts", 0) >= since - 1:
                by_pid.setdefault(pid, []).append(row)
    return by_pid


def after_the_fact(settings: Settings, judgement: Judgement | None, error: BaseException) -> None:
    """After a failed engine start-up: one line if the kernel's OOM killer acted since
    the preflight, and a ledger row."""
    if judgement is None or judgement.oom_kills is None:
        return
    now = _oom_kills(settings)
    if now is None or now <= judgement.oom_kills:
        return
    rows = _ledger_rows(settings.ledger_dir, judgement.started)
    last = [r[-1] for r in rows.values() if r]
    # EngineCore killed: vLLM names it with exit code -9; else a worker was (EngineCore
    # then exits with 1), the largest by RssAnon as the OOM killer ranks them.
    role = "engine" if ": -9" in str(error) else "worker"
    of_role = [r for r in last if str(r.get("role", "")).startswith(role)]
    victim = max(of_role or last, key=lambda r: r.get("rss_anon") or 0, default=None)
    if victim is None:
        who = "a vLLM process (phase unknown: set VLLM_XPU_MEMFIX_LEDGER_DIR to record phases)"
        memory = ""
    else:
        who = f"{victim.get('role')} pid={victim.get('pid')} after phase '{victim.get('phase')}'"
        available, total = victim.get("mem_available"), victim.get("mem_total")
        memory = (
            f"; host then MemAvailable {available / GiB:,.1f} of {total / GiB:,.1f} GiB"
            if available is not None and total
            else ""
        )
    cause = judgement.cause or "unknown (no preflight verdict)"
    line = _fit(
        f"vllm-xpu-memfix: start-up failed after the kernel's OOM killer acted (oom_kill "
        f"{judgement.oom_kills} -> {now}): likely {who}{memory}; likely cause {cause}"
        + (f"; see {see(judgement.cause)}" if judgement.cause else "")
    )
    logger.error("%s", line)
    if settings.ledger_dir is not None:
        from vllm_xpu_memfix.core.process import current_role
        from vllm_xpu_memfix.memory.ledger import Ledger

        Ledger(str(current_role()), settings.ledger_dir).record(
            "killed by the OOM killer",
            oom_kill_before=judgement.oom_kills,
            oom_kill_after=now,
            victim_pid=None if victim is None else victim.get("pid"),
            victim_role=None if victim is None else victim.get("role"),
            victim_phase=None if victim is None else victim.get("phase"),
            likely_cause=judgement.cause,
            error=_fit(str(error), 200),
        )


def patches(settings: Settings) -> tuple[Patch, ...]:
    state: dict[str, Judgement] = {}

    def after_config(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        vllm_config = wrapped(*args, **kwargs)
        run_preflight(vllm_config, settings, state)
        return vllm_config

    def around_startup(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except Exception as exc:
            try:
                after_the_fact(settings, state.get("last"), exc)
            except Exception as inner:  # never into vLLM
                logger.debug(_fit(f"vllm-xpu-memfix: OOM-kill check failed: {inner!r}"))
            raise

    def at_ready(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        last = state.get("last")
        if last is not None and last.prediction is not None:
            from vllm_xpu_memfix.startup import prediction_check

            line = _guarded("ready line", prediction_check.at_ready, settings, last.prediction)
            if line:
                logger.info("%s", _fit(line))
        return wrapped(*args, **kwargs)

    return (
        Patch(FIX.key, "vllm.engine.arg_utils:EngineArgs.create_engine_config", after_config),
        Patch(FIX.key, "vllm.v1.engine.utils:wait_for_engine_startup", around_startup),
        Patch(FIX.key, READY, at_ready, once=True, optional=True),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(patches(settings))
