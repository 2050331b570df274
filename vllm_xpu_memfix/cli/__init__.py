"""``vllm-xpu-memfix`` command line: check, compat, demo, doctor, monitor, plot, ray-env.

May import every other part of the package; nothing imports it but the entry point.
"""

# The parser lives here; each command is the module of its name in this package
# (check, demo, doctor, monitor, plot, ray-env as ray_env), imported only when that command runs and
# called as ``main(args)``.

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from vllm_xpu_memfix import __version__
from vllm_xpu_memfix.core import numbers
from vllm_xpu_memfix.core.numbers import Bounds


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (exit 2), naming the option and what it accepts."""

    def error(self, message: str) -> NoReturn:
        line = message.replace("\n", "\\n")
        self.exit(2, f"{self.prog}: error: {line}; see {self.prog} --help\n")


def _number(bounds: Bounds) -> Callable[[str], float]:
    """An argparse type holding an option to the same rule as the plugin's variables."""

    def parse(text: str) -> float:
        value = bounds.value_of(text)
        if value is None:
            raise argparse.ArgumentTypeError(bounds.refusal(text))
        return value

    return parse


RANKS = Bounds(1, 1024, integer=True)
UTILIZATION = Bounds(0, 1, above_minimum=True)
DEVICE_GIB = Bounds(0, 16_384, above_minimum=True, unit="GiB")
INTERVAL_S = Bounds(0.01, 3600, unit="seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-xpu-memfix", description=__doc__)
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
    monitor.add_argument(
        "--interval",
        type=_number(INTERVAL_S),
        default=0.5,
        help=f"seconds between samples, {INTERVAL_S.accepted} (default: %(default)s)",
    )
    monitor.add_argument(
        "--out", help="output directory (default: ./vllm-xpu-memfix-monitor-<time>)"
    )
    monitor.add_argument("command_line", nargs=argparse.REMAINDER, help="the command, after --")
    doctor = sub.add_parser(
        "doctor",
        help="predict whether a serve command fits, phase by phase, and why not",
        usage="vllm-xpu-memfix doctor [--host FILE] [--write-host FILE] [--params N] [--json] "
        "[MODEL] [FLAGS] [-- vllm serve MODEL ARGS...]",
        description="Takes the arguments of `vllm serve` that matter for memory, or the whole "
        "serve line after --. Judges this machine, or one described in a TOML file (--host). "
        "Reads files only: never loads the model or starts the driver.",
    )
    doctor.add_argument(
        "--host",
        metavar="FILE",
        help="judge the machine this TOML file describes (docs/doctor.md), not this one",
    )
    doctor.add_argument(
        "--write-host",
        metavar="FILE",
        help="write this machine's host file (--host on it gives the same answer)",
    )
    doctor.add_argument(
        "model",
        nargs="?",
        help="checkpoint directory (safetensors), or a Hugging Face id read from the local cache",
    )
    doctor.add_argument("--model", dest="model_option", help=argparse.SUPPRESS)
    doctor.add_argument(
        "--params",
        type=_parameter_count,
        help="the model's parameter count (8e9, 8B, 500M) where its weights cannot be read",
    )
    doctor.add_argument("--tensor-parallel-size", "-tp", type=_number(RANKS))
    doctor.add_argument("--gpu-memory-utilization", type=_number(UTILIZATION))
    doctor.add_argument("--quantization", "-q")
    doctor.add_argument("--dtype")
    doctor.add_argument(
        "--device-memory-gib",
        type=_number(DEVICE_GIB),
        help=f"per-GPU memory if sysfs lacks it, {DEVICE_GIB.accepted}",
    )
    doctor.add_argument("--max-parallel-loading-workers", type=_number(RANKS))
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
    plot.add_argument(
        "-o",
        "--output",
        help="file to write (.png, .svg or .pdf), or a directory to write host-memory.png "
        "into (default: ./host-memory.png)",
    )
    return parser


_COUNT_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
PARAMS = Bounds(1, 10**15)
SCALED = Bounds(0, 10**15, above_minimum=True)  # before K, M, B or T


def _parameter_count(text: str) -> int:
    """A parameter count under the one number rule, optionally scaled by K, M, B (or G), T."""
    scale = _COUNT_SUFFIX.get(text.strip()[-1:].upper(), 1)
    mantissa = SCALED.value_of(text.strip()[:-1] if scale > 1 else text)
    count = None if mantissa is None else PARAMS.value_of(repr(mantissa * scale))
    if count is None:
        raise argparse.ArgumentTypeError(f"{PARAMS.refusal(text)}, optionally with K, M, B or T")
    return round(count)


def _split_serve_line(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``doctor ... -- vllm serve ...``: doctor's own arguments, and the serve line."""
    if argv[:1] == ["doctor"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, None


def main(argv: Sequence[str] | None = None) -> int:
    argv, serve_line = _split_serve_line(list(sys.argv[1:] if argv is None else argv))
    args, unknown = build_parser().parse_known_args(argv)
    args.serve_line = serve_line
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
    except numbers.ConfigError as exc:
        print(f"vllm-xpu-memfix: {exc}", file=sys.stderr)
        return 2
