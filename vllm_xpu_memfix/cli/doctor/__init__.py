"""``vllm-xpu-memfix doctor``: will this serve command fit, phase by phase, and if not, why.

Reads only files: /proc, the cgroup, sysfs, dpkg's status, library names and
the checkpoint's safetensors headers. It never loads the model or starts the
driver, so it runs in seconds. The figures are estimates; the ledger of a real
start is the measurement.

The machine is this one, or one described in a TOML file (``--host FILE``, judged as it
would run without the plugin unless the file says it is installed); ``--write-host FILE``
writes this machine's file. The command is doctor's own flags, or a whole ``vllm serve``
line after ``--``.

The model is a directory, a GGUF file or a Hugging Face id: read from the local Hugging
Face cache, else its metadata from the Hub by range request (never its weights). Whatever
doctor could not see or refused is said in the report; a checkpoint it cannot read at all,
or whose format and size nothing tells, exits 2 with one line saying why.

One module a step: ``facts`` reads the host and the model (``hostfile`` and ``described``
a machine in a file; a pasted command ``vllmline``, by the installed vLLM's parser and
configuration, else ``serveline``, doctor's own); the start-up model
(``vllm_xpu_memfix.startup``: ``sizing`` makes its inputs, ``phases`` judges, ``remedies``
re-runs it with each remedy) gives one outcome; ``advice`` says what could not be seen,
``sections`` and ``render`` give the report; this module wires them to the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from vllm_xpu_memfix.cli.doctor import (
    advice,
    deadline,
    described,
    facts,
    hostfile,
    render,
    sections,
    serveline,
    target,
    vllmline,
)
from vllm_xpu_memfix.core import config, files, redact
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.memory import hub_reach
from vllm_xpu_memfix.memory.checkpoint import CheckpointError
from vllm_xpu_memfix.startup import phases, remedies, sizing
from vllm_xpu_memfix.startup.sizing import ServeArgs
from vllm_xpu_memfix.vllm_code import releases


def outcome_for(measured: facts.Measurement, args: ServeArgs) -> phases.Outcome:
    """The start-up model's judgement of ``args`` on the measured machine."""
    return phases.run(sizing.inputs_for(measured.machine(), args, measured.ckpt))


def _accepted(
    measured: facts.Measurement, reading: vllmline.Reading | None
) -> tuple[tuple[str, str, str, phases.Inputs], ...]:
    """The changes of a refused line that vLLM accepts, as the model's inputs."""
    if reading is None:
        return ()
    machine = measured.machine()
    return tuple(
        (fix.code, fix.what, fix.cost, sizing.inputs_for(machine, fix.args, measured.ckpt))
        for fix in reading.fixes
    )


def report_for(
    measured: facts.Measurement, args: ServeArgs, reading: vllmline.Reading | None = None
) -> render.Report:
    outcome = outcome_for(measured, args)
    context = remedies.Context(
        measured.guard.user_set, measured.room, measured.image, _accepted(measured, reading)
    )
    judged = remedies.remedies(outcome, context)
    return render.Report(
        host=sections.host_section(measured.snap, measured.room),
        gpus=sections.gpu_section(measured),
        environment={k: measured.environ[k] for k in facts.RELEVANT_ENV if k in measured.environ},
        plugin=sections.plugin_section(measured),
        model=sections.model_section(measured, outcome, args),
        per_rank=sections.per_rank_section(outcome),
        total=sections.total_section(measured, outcome),
        verdict=outcome.verdict,
        main_cause=outcome.main_cause,
        why=outcome.why,
        not_judged=outcome.not_judged,
        notes=advice.notes_for(measured, outcome, args),
        machine=measured.described or "this machine",
        fails_at=outcome.fails_at,
        phases=sections.phases_section(outcome),
        causes=sections.causes_section(outcome),
        remedies=[remedy.as_dict() for remedy in judged.remedies],
        not_helping=[remedy.as_dict() for remedy in judged.not_helping],
        assumed=sections.assumed_section(measured, args, outcome),
        not_modelled=list(args.not_modelled),
        driver_guard_lines=driver_env.summary_lines(measured.guard),
        serve_line=None if reading is None else reading.as_dict(),
    )


def _serve_args(args: argparse.Namespace, goal: target.Target | None = None) -> vllmline.Reading:
    """doctor's own flags, then the pasted serve line (read by the installed vLLM's parser
    unless none is installed, or it cannot answer for the release and platform judged for:
    ``goal``); a value given in both must agree."""
    goal = goal or target.Target(None, None)
    option = getattr(args, "model_option", None)
    if args.model and option and args.model != option:
        raise serveline.ServeLineError(
            f"two models: {args.model!r} and --model {option!r}; give one"
        )
    given = {"model": args.model or option or None}
    given.update({name: getattr(args, name, None) for name in serveline.FIELDS})
    quantization = given.get("quantization")
    if quantization is not None:
        try:
            serveline.value_of("quantization", str(quantization))
        except ValueError as exc:
            raise serveline.ServeLineError(f"-q/--quantization {exc}") from None
    own = {name: value for name, value in given.items() if value is not None and name != "model"}
    doctors = {"device_memory_gib": args.device_memory_gib, "params": args.params}
    base = ServeArgs(**serveline.fitted(own), model=given["model"], **doctors)
    line = getattr(args, "serve_line", None)
    if line is None:
        return vllmline.Reading(base, "doctor's own flags")
    here = goal.platform != target.XPU or bool(driver.intel_gpus(config.load().sysroot))
    version = vllmline.reader_for(goal.vllm, here)
    own_parser = vllmline.own_parser(goal.vllm, None if here else goal.platform)
    if version is not None:
        try:
            reading = vllmline.read(line, {**own, "model": given["model"]}, version, goal.platform)
        except vllmline.Unavailable as exc:
            own_parser = f"doctor's own parser ({exc})"
        else:
            fixes = tuple(replace(fix, args=replace(fix.args, **doctors)) for fix in reading.fixes)
            return replace(reading, args=replace(reading.args, **doctors), fixes=fixes)
    parsed, ignored = serveline.read(line, replace(base, model=None))
    fitted = parsed.max_model_len_fitted and given.get("max_model_len") == serveline.FITTED
    for name, value in given.items():
        if name == "max_model_len" and fitted:
            continue
        if value is not None and getattr(parsed, name) != value:
            raise serveline.ServeLineError(
                f"{name} is {value!r} in doctor's flags but {getattr(parsed, name)!r} in the "
                "serve line; give it in one place"
            )
    return vllmline.Reading(parsed, own_parser, ignored)


def _one_line(message: str) -> str:
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _write_host(args: argparse.Namespace, text: str) -> None:
    """``--write-host``: never through a symlink, into a FIFO or a device, or over a file
    without ``--force``; a temporary file beside it is renamed into place, mode 0644."""
    path = Path(args.write_host)
    try:
        files.write_file(path, text, replace=args.force)
    except OSError as exc:
        raise hostfile.HostFileError(f"{path}: {exc.strerror or exc}") from None
    print(f"doctor: wrote {path}", file=sys.stderr)


def _image(args: argparse.Namespace) -> catalog.Image | None:
    """``--image``'s row; an image not in the table is one line."""
    name = getattr(args, "image", None)
    if not name:
        return None
    image = catalog.image_named(name)
    if image is None:
        raise serveline.ServeLineError(f"--image: {catalog.not_in_table(name)}")
    return image


def _asks_hub(args: argparse.Namespace) -> bool:
    """The run may ask the Hub: a pasted line (vLLM reads a tokenizer, a draft model) or a
    model that is not a path here."""
    model = args.model or getattr(args, "model_option", None)
    return getattr(args, "serve_line", None) is not None or bool(model and not Path(model).exists())


def main(args: argparse.Namespace) -> int:
    redact.redact_log_records(os.environ)  # huggingface_hub's and vLLM's records too
    with deadline.run(getattr(args, "deadline", deadline.DEFAULT_S)):
        try:
            return _judged(args)
        except deadline.PastDeadline as past:
            print(f"doctor: stopped {deadline.GRACE:g} s past {past}; not judged", file=sys.stderr)
            return 2


def _judged(args: argparse.Namespace) -> int:
    if _asks_hub(args) and (why := hub_reach.unreachable()):
        hub_reach.go_offline(why)  # once, for vLLM's path and doctor's own reader
    try:
        if args.host and args.write_host:
            raise hostfile.HostFileError("--write-host writes this machine: drop --host")
        flag = _image(args)
        machine = hostfile.load(args.host, getattr(args, "image", None)) if args.host else None
        image = machine.image if machine is not None else flag
        gpus = None if machine is None else sum(kind.count for kind in machine.gpus)
        goal = target.target(image, gpus)
        with releases.judged_for(goal.vllm):
            reading = _serve_args(args, goal)
            serve = reading.args
            if machine is not None:
                measured = described.measurement(machine, serve)
            else:
                measured = facts.measure(config.load(), serve, os.environ, image)
            if args.write_host:
                _write_host(args, described.write_host(measured))
            line = reading if getattr(args, "serve_line", None) else None
            report = report_for(measured, serve, line)
    except (CheckpointError, hostfile.HostFileError, serveline.ServeLineError) as exc:
        # One line, whatever a hostile file name holds.
        print(f"doctor: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else render.render(report, serve))
    return 0
