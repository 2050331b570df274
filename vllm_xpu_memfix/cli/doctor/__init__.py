"""``vllm-xpu-memfix doctor``: will this serve command fit in host memory, and if not, why.

Reads only files: /proc, the cgroup, sysfs, dpkg's status, library names and
the checkpoint's safetensors headers. It never loads the model or starts the
driver, so it runs in seconds. The figures are estimates; the ledger of a real
start is the measurement.

The model is a directory or a Hugging Face id, read from the local Hugging Face
cache (never the network). Whatever doctor could not see or refused is said in the
report; a checkpoint it cannot read at all exits 2 with one line saying why.

One module a step: ``facts`` reads the host and the model, ``predict`` turns them into
the need and the verdict, ``advice`` says what to change and what was assumed,
``sections`` and ``render`` give the report; this module wires them to the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from vllm_xpu_memfix.cli.doctor import advice, facts, predict, render, sections
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.config import Settings
from vllm_xpu_memfix.memory.checkpoint import CheckpointError


def diagnose(
    settings: Settings, args: facts.ServeArgs, environ: Mapping[str, str]
) -> render.Report:
    measured = facts.measure(settings, args, environ)
    estimate = predict.decide(measured, args, environ)
    return render.Report(
        host=sections.host_section(measured.snap, measured.room),
        gpus=sections.gpu_section(measured),
        environment={k: environ[k] for k in facts.RELEVANT_ENV if k in environ},
        plugin=sections.plugin_section(settings),
        model=sections.model_section(measured, estimate, args),
        per_rank=estimate.per_rank,
        total=estimate.total,
        verdict=estimate.verdict,
        main_cause=estimate.main_cause,
        changes=advice.advise(measured, estimate, args, environ),
        notes=advice.notes_for(measured, estimate, args),
    )


def main(args: argparse.Namespace) -> int:
    serve = facts.ServeArgs(
        model=args.model or None,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        dtype=args.dtype,
        device_memory_gib=args.device_memory_gib,
        max_parallel_loading_workers=args.max_parallel_loading_workers,
        params=args.params,
    )
    try:
        report = diagnose(config.load(), serve, os.environ)
    except CheckpointError as exc:
        # One line, whatever a hostile file name holds.
        message = str(exc).replace("\r", "\\r").replace("\n", "\\n")
        print(f"doctor: {message}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else render.render(report, serve))
    return 0
