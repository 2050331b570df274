"""``vllm-xpu-memfix`` command line: check, demo, doctor, explain, monitor, plot, ray-env, report.

May import every other part of the package; nothing imports it but the entry point.
"""

# The parser lives here; each command is the module of its name in this package (ray-env
# as ray_env), imported only when that command runs and called as ``main(args)``.

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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
DEADLINE_S = Bounds(1, 3600, unit="s")
DEADLINE_DEFAULT_S = 30.0  # cli.doctor.deadline.DEFAULT_S, without importing doctor here
INTERVAL_S = Bounds(0.01, 3600, unit="seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vllm-xpu-memfix",
        description="The vllm-xpu-memfix plugin's commands; each has --help, and "
        "`vllm-xpu-memfix explain CODE` explains a code a log record names.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="list fixes, switches and whether their vLLM targets exist",
        description="Reads vLLM's source (the installed one, or --source) without importing "
        "it: each fix, its switch, and whether each vLLM symbol it patches is present, absent "
        "where the release does without it, or missing; then the driver guard's decision "
        "on this host.",
    )
    check.add_argument(
        "--source", help="directory holding a vllm/ source tree (default: installed vLLM)"
    )
    check.add_argument("--strict", action="store_true", help="exit 1 when a target is missing")
    demo = sub.add_parser(
        "demo",
        help="serve a tiny local model with the plugin and show its report",
        description="Makes a tiny random model, serves it with vLLM and the plugin, sends one "
        "request, and shows what the plugin logged and a picture of host memory. Needs vLLM "
        "and torch in this Python; writes only into --workdir.",
    )
    demo.add_argument(
        "--workdir",
        default="vllm-xpu-memfix-demo",
        help="model, server log, monitor CSV, ledger and PNG go here (default: %(default)s)",
    )
    explain = sub.add_parser(
        "explain",
        help="print the troubleshooting entry for a cause or remedy code",
        description="Prints the troubleshooting guide's entry for a code that a log record, "
        "doctor or the preflight names; without a code, lists them. Reads the guide shipped "
        "in this package: needs neither vLLM nor a GPU.",
    )
    explain.add_argument("code", nargs="?", help="the code a log record names (none: list them)")
    monitor = sub.add_parser(
        "monitor",
        help="run a command (e.g. vllm serve) and sample its process tree's host memory to CSV",
        usage="vllm-xpu-memfix monitor [--interval S] [--out DIR] -- COMMAND...",
        description="Runs COMMAND and samples its process tree's host memory (RSS and its "
        "parts, PSS, the GPU driver's) and the system's into monitor.csv until it exits; "
        "`plot` draws it.",
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
        usage="vllm-xpu-memfix doctor [--host FILE] [--image TAG] [--write-host FILE [--force]]\n"
        "       [--params N] [--deadline S] [--json] [MODEL] [FLAGS] [-- vllm serve MODEL ARGS...]",
        description="Takes the arguments of `vllm serve` that matter for memory, or the whole "
        "serve line after --. Judges this machine, or one described in a TOML file (--host). "
        "Reads headers (local or the Hub's), imports vLLM; never weights, never the driver.",
    )
    doctor.add_argument(
        "--host",
        metavar="FILE",
        type=_path("--host"),
        help="judge the machine this TOML file describes (--write-host writes one), not this one",
    )
    doctor.add_argument(
        "--write-host",
        metavar="FILE",
        type=_path("--write-host"),
        help="write this machine's host file (--host on it gives the same answer)",
    )
    doctor.add_argument(
        "--image",
        metavar="TAG",
        help="judge for the vLLM of this Intel llm-scaler image (intel/llm-scaler-vllm:TAG "
        "or TAG): -q is checked against that vLLM's methods",
    )
    doctor.add_argument(
        "--force",
        action="store_true",
        help="let --write-host replace an existing file",
    )
    doctor.add_argument(
        "model",
        nargs="?",
        help="checkpoint directory (safetensors), a .gguf file, or a Hugging Face id (read from "
        "the local cache, else its metadata from the Hub)",
    )
    doctor.add_argument(
        "--params",
        metavar="N",
        type=_parameter_count,
        help="the model's parameter count (8e9, 8B, 500M) where nothing else gives its size",
    )
    _serve_flags(doctor)
    doctor.add_argument(
        "--device-memory-gib",
        type=_number(DEVICE_GIB),
        help=f"per-GPU memory if sysfs lacks it, {DEVICE_GIB.accepted}",
    )
    doctor.add_argument(
        "--deadline",
        metavar="SECONDS",
        type=_number(DEADLINE_S),
        default=DEADLINE_DEFAULT_S,
        help="the longest the whole run may take (vLLM, the Hub); "
        f"past it the rest is not read, and said so; {DEADLINE_S.accepted}, default 30",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    ray_env = sub.add_parser(
        "ray-env",
        help="print the driver variables each Ray node needs (export lines, runtime_env)",
        description="Decides from this node's sysfs and compute-runtime, as the driver guard "
        "does. Run it on each node; vLLM's Ray workers start the driver before the plugin "
        "loads, so the variables must be in their environment from the start.",
    )
    ray_env.add_argument("--json", action="store_true", help="print only the runtime_env JSON")
    report = sub.add_parser(
        "report",
        help="one Markdown block for an issue: versions, GPUs, driver, memory, last start",
        description="Prints one Markdown block to paste into an issue: versions, GPUs, driver, "
        "host memory and the last start-up the ledger recorded. Secret values, home "
        "directories and the host name (unless --hostname) are redacted.",
    )
    report.add_argument(
        "--ledger",
        help="ledger directory (default: VLLM_XPU_MEMFIX_LEDGER_DIR, else the plugin's "
        "default under ~/.cache)",
    )
    report.add_argument(
        "--start", type=int, help="show start-up N of the ledger (1 = oldest; default: the last)"
    )
    report.add_argument("--hostname", action="store_true", help="show this host's name")
    plot = sub.add_parser(
        "plot",
        help="draw a monitor CSV as a PNG, with ledger phases marked",
        description="Draws host memory over time from a monitor CSV, with the start-up phases "
        "the ledger recorded marked on it. Needs matplotlib (the plot extra).",
    )
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


def _path(option: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"an empty path; give a file for {option}")
        return text

    return parse


class _Once(argparse.Action):
    """An option given twice with two different values is refused, not the last taken."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            parser.error(
                f"argument {'/'.join(self.option_strings)}: given twice, {before!r} and "
                f"{values!r}; give it once"
            )
        setattr(namespace, self.dest, values)


_METAVAR = {
    "ranks": "N",
    "count": "N",
    "human": "N",
    "length": "N|auto",
    "bytes": "BYTES",
    "utilization": "FRACTION",
    "quantization": "METHOD",
    "dtype": "DTYPE",
    "text": "VALUE",
}


def _serve_flags(doctor: argparse.ArgumentParser) -> None:
    """doctor's own serve flags: the serve line's table, one option per field, each read by
    the serve line's rule, so a flag means the same before and after ``--``."""
    from vllm_xpu_memfix.cli.doctor import serveline

    by_field: dict[str, list[str]] = {}
    for flag, (field, _kind) in serveline.MODELLED.items():
        by_field.setdefault(field, []).append(flag)
    for field, flags in by_field.items():
        kind = serveline.MODELLED[flags[0]][1]

        def parse(text: str, kind: str = kind) -> Any:
            # -q is checked in doctor.main, against the vLLM it judges for (--image, --host).
            checked = "text" if kind == "quantization" else kind
            try:
                return serveline.value_of(checked, text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        if field == "model":  # the positional MODEL; --model as in the module form
            doctor.add_argument(*flags, dest="model_option", help=argparse.SUPPRESS)
            continue
        doctor.add_argument(
            *flags,
            dest=field,
            type=parse,
            action=_Once,
            metavar=_METAVAR[kind],
            help=serveline.HELP[field],
        )


def _split_serve_line(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``doctor ... -- vllm serve ...``: doctor's own arguments, and the serve line."""
    if argv[:1] == ["doctor"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # The reader left (`| head`): no traceback, and none at exit's flush either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    argv, serve_line = _split_serve_line(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = (
            "; other vllm serve flags go in the serve line, after --"
            if args.command == "doctor"
            else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args.serve_line = serve_line
    command = importlib.import_module(f"{__name__}.{args.command.replace('-', '_')}")
    try:
        return int(command.main(args))
    except numbers.ConfigError as exc:
        print(f"vllm-xpu-memfix: {exc}", file=sys.stderr)
        return 2
