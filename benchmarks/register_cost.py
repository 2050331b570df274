"""What ``import vllm_xpu_memfix; register()`` costs in a fresh interpreter: inside a vLLM
process (after ``vllm.plugins``, and with it torch, is loaded: where vLLM calls it) and in a
bare one. Median, minimum and maximum of ``--rounds`` interpreters each; the target is
under 50 ms inside vLLM. Prints a Markdown table; ``--out FILE`` writes it too.

Moved out of tests/test_register.py, where the timing failed on a loaded machine (issue 47);
the test keeps what register() must not import.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CASES = {"inside vLLM (after import vllm.plugins)": "import vllm.plugins", "bare interpreter": ""}


def main() -> int:
    from test_register import measure_register

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [
        f"register() cost, {args.rounds} fresh interpreters each, "
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        "",
        "| where | median ms | min ms | max ms |",
        "|---|---|---|---|",
    ]
    for case, preload in CASES.items():
        costs = [measure_register(preload)["ms"] for _ in range(args.rounds)]
        rows.append(
            f"| {case} | {statistics.median(costs):.1f} | {min(costs):.1f} | {max(costs):.1f} |"
        )
    table = "\n".join(rows) + "\n"
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
