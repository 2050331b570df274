"""What ``doctor ... -- vllm serve DIR ...`` costs in a fresh interpreter: wall time and
peak RSS (the process's ``ru_maxrss``) on vLLM's path (the installed vLLM's parser and
``create_engine_config``, ``cli.doctor.vllmline``), on doctor's own parser (as without
vLLM: ``vllmline.installed`` answering None) and, for reference, a bare
``import vllm.engine.arg_utils``. The arms alternate, ``--rounds`` each; medians. The model
is a directory holding tests/data/configs/qwen3-32b.json as its config.json (no weights).
Targets (issue 51): vLLM's path at most the import plus 2 s; doctor's own under 1.5 s.
Prints a Markdown table; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from markdown_table import arguments, emit, this_machine

ROOT = Path(__file__).resolve().parent.parent
PEAK = (
    "import resource, sys; "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
)
DOCTOR = (
    "import atexit, sys; atexit.register(lambda: exec({peak!r})); {hide}"
    "from vllm_xpu_memfix.cli import main; sys.exit(main())"
)
HIDE = "from vllm_xpu_memfix.cli.doctor import vllmline; vllmline.installed = lambda: None; "


def _run(code: str, argv: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, check=True
    )
    seconds = time.perf_counter() - started
    return seconds, int(result.stderr.strip().splitlines()[-1]) / 1024


def main() -> int:
    parser = arguments(__doc__, rounds=3)
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp(prefix="doctor-cost-"))
    shutil.copy(ROOT / "tests/data/configs/qwen3-32b.json", model / "config.json")
    line = ["doctor", "--params", "32B", "--json", "--", "vllm", "serve", str(model)]
    line += ["-tp", "2", "--max-model-len", "8192", "--enforce-eager"]
    arms = {
        "doctor, vLLM's parser and configuration": (DOCTOR.format(peak=PEAK, hide=""), line),
        "doctor, its own parser (as without vLLM)": (DOCTOR.format(peak=PEAK, hide=HIDE), line),
        "import vllm.engine.arg_utils alone": (f"import vllm.engine.arg_utils; {PEAK}", []),
    }
    _run(*arms["doctor, vLLM's parser and configuration"])  # vLLM's model-info cache, once
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (code, argv) in arms.items():
            found[name].append(_run(code, argv))
    shutil.rmtree(model)
    rows = [
        f"doctor's cost, {args.rounds} fresh interpreters per arm, alternating, {this_machine()}",
        "",
        "| arm | median s | min s | max s | median peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for name, runs in found.items():
        seconds = [s for s, _ in runs]
        rss = statistics.median(m for _, m in runs)
        rows.append(
            f"| {name} | {statistics.median(seconds):.2f} | {min(seconds):.2f} | "
            f"{max(seconds):.2f} | {rss:.0f} |"
        )
    return emit(rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
