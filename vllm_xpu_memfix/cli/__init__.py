"""``vllm-xpu-memfix`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_xpu_memfix import __version__, config, fixes
from vllm_xpu_memfix.cli import compat


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    settings = config.load()
    root = Path(args.source) if args.source else compat.installed_vllm_root()
    if root is None:
        print("vLLM is not installed in this environment; pass --source DIR to scan a source tree.")
        return 2
    if not (root / "vllm").is_dir():
        print(f"{root} holds no vllm/ package directory.", file=sys.stderr)
        return 2
    print(
        f"vllm-xpu-memfix {__version__}; plugin {'enabled' if settings.enabled else 'DISABLED'}"
        f" ({config.MASTER.name}); vLLM source: {root / 'vllm'}\n"
    )
    rows = [("fix", "switch", "value", "target", "status")]
    missing = 0
    for fix in config.FIXES:
        patches = fixes.MODULES[fix.key].PATCHES
        if not patches:
            rows.append(
                (
                    fix.key,
                    fix.env,
                    settings.mode(fix.key).value,
                    "(none: acts at registration)",
                    "-",
                )
            )
        for patch in patches:
            status = compat.target_status(root, patch.target, patch.params)
            missing += status != compat.PRESENT and patch.module not in compat.INTEL_IMAGE_MODULES
            rows.append((fix.key, fix.env, settings.mode(fix.key).value, patch.target, status))
    print(_table(rows))
    return 1 if missing and args.strict else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from vllm_xpu_memfix.cli.demo import run_demo

    return run_demo(Path(args.workdir))


def cmd_monitor(args: argparse.Namespace) -> int:
    from vllm_xpu_memfix.cli import monitor

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    out = Path(args.out or time.strftime("vllm-xpu-memfix-monitor-%Y%m%d-%H%M%S"))
    return monitor.main(command, out, args.interval)


def cmd_plot(args: argparse.Namespace) -> int:
    from vllm_xpu_memfix.cli.plot import PlotError, plot

    csv_path = Path(args.csv)
    if not csv_path.is_file():
        print(f"plot: no such file: {csv_path}", file=sys.stderr)
        return 2
    ledger = Path(args.ledger) if args.ledger else None
    if ledger is not None and not ledger.is_dir():
        print(f"plot: --ledger {ledger} is not a directory", file=sys.stderr)
        return 2
    try:
        print(f"plot: wrote {plot(csv_path, Path(args.output), ledger)}")
    except PlotError as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 2
    return 0


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def cmd_doctor(args: argparse.Namespace) -> int:
    import os

    from vllm_xpu_memfix.cli import doctor
    from vllm_xpu_memfix.memory.checkpoint import CheckpointError

    serve = doctor.ServeArgs(
        model=Path(args.model) if args.model else None,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        dtype=args.dtype,
        device_memory_gib=args.device_memory_gib,
    )
    try:
        report = doctor.diagnose(config.load(), serve, os.environ)
    except CheckpointError as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else doctor.render(report, serve))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-xpu-memfix", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="list fixes, switches and whether their vLLM targets exist"
    )
    check.add_argument(
        "--source", help="directory holding a vllm/ source tree (default: installed vLLM)"
    )
    check.add_argument("--strict", action="store_true", help="exit 1 when a target is missing")
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser(
        "demo", help="serve a tiny local model with the plugin and show its report"
    )
    demo.add_argument(
        "--workdir",
        default="vllm-xpu-memfix-demo",
        help="model, server log, monitor CSV, ledger and PNG go here (default: %(default)s)",
    )
    demo.set_defaults(func=cmd_demo)
    mon = sub.add_parser(
        "monitor",
        help="run a command (e.g. vllm serve) and sample its process tree's host memory to CSV",
        usage="vllm-xpu-memfix monitor [--interval S] [--out DIR] -- COMMAND...",
    )
    mon.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    mon.add_argument("--out", help="output directory (default: ./vllm-xpu-memfix-monitor-<time>)")
    mon.add_argument("command_line", nargs=argparse.REMAINDER, help="the command, after --")
    mon.set_defaults(func=cmd_monitor)
    doc = sub.add_parser(
        "doctor",
        help="predict whether a serve command fits in host memory, and why not",
        description="Takes the arguments of `vllm serve` that matter for memory. "
        "Reads files only: never loads the model or starts the driver.",
    )
    doc.add_argument("model", nargs="?", help="checkpoint directory (safetensors)")
    doc.add_argument("--model", dest="model_option", help=argparse.SUPPRESS)
    doc.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    doc.add_argument("--gpu-memory-utilization", type=_unit_interval, default=0.92)
    doc.add_argument("--quantization", "-q")
    doc.add_argument("--dtype")
    doc.add_argument("--device-memory-gib", type=float, help="per-GPU memory if sysfs lacks it")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.set_defaults(func=cmd_doctor)
    plt = sub.add_parser("plot", help="draw a monitor CSV as a PNG, with ledger phases marked")
    plt.add_argument("csv", help="monitor.csv written by 'monitor'")
    plt.add_argument("--ledger", help="directory of ledger JSON lines (VLLM_XPU_MEMFIX_LEDGER_DIR)")
    plt.add_argument("-o", "--output", default="host-memory.png", help="PNG to write")
    plt.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if args.command != "doctor" and unknown:
        build_parser().parse_args(argv)  # reports the unknown arguments and exits
    if args.command == "doctor":
        args.model = args.model or args.model_option
        if unknown:
            # Other `vllm serve` flags do not change the host-memory estimate.
            print(f"doctor: ignoring {' '.join(unknown)}", file=sys.stderr)
    try:
        return int(args.func(args))
    except config.ConfigError as exc:
        print(f"vllm-xpu-memfix: {exc}", file=sys.stderr)
        return 2

