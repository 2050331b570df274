"""``vllm-xpu-memfix`` command line."""

# The parser lives here; each command is the module of its name in this package
# (check, demo, doctor, monitor, plot, ray-env as ray_env), imported only when that command runs and
# called as ``main(args)``.

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vllm_xpu_memfix import __version__, config


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
    demo = sub.add_parser(
        "demo", help="serve a tiny local model with the plugin and show its report"
    )
    demo.add_argument(
        "--workdir",
        default="vllm-xpu-memfix-demo",
        help="model, server log, monitor CSV, ledger and PNG go here (default: %(default)s)",
    )
    monitor = sub.add_parser(
        "monitor",
        help="run a command (e.g. vllm serve) and sample its process tree's host memory to CSV",
        usage="vllm-xpu-memfix monitor [--interval S] [--out DIR] -- COMMAND...",
    )
    monitor.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    monitor.add_argument(
        "--out", help="output directory (default: ./vllm-xpu-memfix-monitor-<time>)"
    )
    monitor.add_argument("command_line", nargs=argparse.REMAINDER, help="the command, after --")
    doctor = sub.add_parser(
        "doctor",
        help="predict whether a serve command fits in host memory, and why not",
        description="Takes the arguments of `vllm serve` that matter for memory. "
        "Reads files only: never loads the model or starts the driver.",
    )
    doctor.add_argument("model", nargs="?", help="checkpoint directory (safetensors)")
    doctor.add_argument("--model", dest="model_option", help=argparse.SUPPRESS)
    doctor.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1)
    doctor.add_argument("--gpu-memory-utilization", type=_unit_interval, default=0.92)
    doctor.add_argument("--quantization", "-q")
    doctor.add_argument("--dtype")
    doctor.add_argument("--device-memory-gib", type=float, help="per-GPU memory if sysfs lacks it")
    doctor.add_argument("--max-parallel-loading-workers", type=_positive_int)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    ray_env = sub.add_parser(
        "ray-env",
        help="print the driver variables each Ray node needs (export lines, runtime_env)",
        description="Decides from this node's sysfs and compute-runtime, as the driver guard "
        "does. Run it on each node; vLLM's Ray workers start the driver before the plugin "
        "loads, so the variables must be in their environment from the start.",
    )
    ray_env.add_argument("--json", action="store_true", help="print only the runtime_env JSON")
    plot = sub.add_parser("plot", help="draw a monitor CSV as a PNG, with ledger phases marked")
    plot.add_argument("csv", help="monitor.csv written by 'monitor'")
    plot.add_argument(
        "--ledger", help="directory of ledger JSON lines (VLLM_XPU_MEMFIX_LEDGER_DIR)"
    )
    plot.add_argument("-o", "--output", default="host-memory.png", help="PNG to write")
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
    command = importlib.import_module(f"{__name__}.{args.command.replace('-', '_')}")
    try:
        return int(command.main(args))
    except config.ConfigError as exc:
        print(f"vllm-xpu-memfix: {exc}", file=sys.stderr)
        return 2
