"""What ``import vllm_xpu_memfix; register()`` costs in a fresh interpreter: inside a vLLM
process (after ``vllm.plugins``, and with it torch, is loaded: where vLLM calls it) and in a
bare one. Median, minimum and maximum of ``--rounds`` interpreters each; the target is
under 50 ms inside vLLM. Prints a Markdown table; ``--out FILE`` writes it too.

Moved out of tests/test_register.py, where the timing failed on a loaded machine (issue 47);
the test keeps what register() must not import.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from markdown_table import arguments, emit, this_machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CASES = {"inside vLLM (after import vllm.plugins)": "import vllm.plugins", "bare interpreter": ""}


def main() -> int:
    from test_register import measure_register

    parser = arguments(__doc__, rounds=9)
    args = parser.parse_args()
    rows = [
        f"register() cost, {args.rounds} fresh interpreters each, {this_machine()}",
        "",
        "| where | median ms | min ms | max ms |",
        "|---|---|---|---|",
    ]
    for case, preload in CASES.items():
        costs = [measure_register(preload)["ms"] for _ in range(args.rounds)]
        rows.append(
            f"| {case} | {statistics.median(costs):.1f} | {min(costs):.1f} | {max(costs):.1f} |"
        )
    return emit(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
