"""Host peak of a TP 2 start with ``--safetensors-load-strategy eager``, on the CPU test bed.

``eager`` reads each safetensors shard whole into host memory before handing its tensors
out (``weight_utils.safetensors_weights_iterator``, v0.32.0 and v0.34.0), on every rank at
once: the one in-tree load where slots (``--max-parallel-loading-workers``) would bound the
node's peak. Arms, in rotating order per round, on the ~1 B-parameter random Qwen3 of
benchmarks/host_release.py (2.3 GB bf16, 3 shards):

- ``lazy, plugin off``: vLLM as is, its default strategy;
- ``eager, plugin off``: ``--safetensors-load-strategy eager``, as is;
- ``eager, load_lock 1 slot``: the same with this plugin and ``--max-parallel-loading-workers
  1``, which its ``load_lock`` honours (the plugin's other fixes at their defaults).

The figure: the peak of the two workers' summed RssAnon, sampled every 0.1 s from outside,
above the first sample that saw both; and the start-up time to ``/health``.

    flock /tmp/memfix-heavy.lock .venv/bin/python benchmarks/eager_tp2.py --rounds 2 \
        [--model DIR] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import host_release
import load_lock

from vllm_xpu_memfix.cli.demo.server import Server
from vllm_xpu_memfix.cli.monitor import Sampler
from vllm_xpu_memfix.core.units import MiB

ARGS = ["--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(64 * MiB)]
EAGER = ["--safetensors-load-strategy", "eager"]
OFF = {"VLLM_XPU_MEMFIX": "0", "VLLM_PLUGINS": ""}
ARMS: dict[str, tuple[dict[str, str], list[str]]] = {
    "lazy, plugin off": (OFF, []),
    "eager, plugin off": (OFF, EAGER),
    "eager, load_lock 1 slot": ({}, [*EAGER, "--max-parallel-loading-workers", "1"]),
}


class SummedPeak(threading.Thread):
    """Peak of the workers' summed RssAnon above the first sample that saw both."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        assert server.process is not None
        self.sampler = Sampler(server.process.pid)
        self.start_sum: int | None = None
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            rows, _ = self.sampler.sample()
            rss = [r["rss_anon"] or 0 for r in rows if str(r["role"]).startswith("worker")]
            if len(rss) >= 2 and self.start_sum is None:
                self.start_sum = sum(rss)
            self.peak = max(self.peak, sum(rss))


def measure(model: Path, arm: str, workdir: Path) -> dict[str, float]:
    env, extra = ARMS[arm]
    log = Path(tempfile.mkdtemp(dir=workdir)) / "server.log"
    with Server(model, log, env={**load_lock.TP2, **env}, extra_args=[*ARGS, *extra]) as server:
        watch = SummedPeak(server)
        watch.start()
        server.wait_ready(timeout_s=600)
        watch.stopping.set()
        watch.join()
        server.complete("Hello", max_tokens=2)
    return {
        "peak": (watch.peak - (watch.start_sum or 0)) / MiB,
        "startup_s": server.ready_after_s or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="eager-tp2-") as tmp:
        model = host_release.given_or_made_model(args.model, Path(tmp))
        arms = list(ARMS)
        for round_ in range(args.rounds):
            for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
                results[arm].append(measure(model, arm, Path(tmp)))
                print(f"round {round_ + 1} {arm}: {results[arm][-1]}", file=sys.stderr)
    base = statistics.median(r["peak"] for r in results["lazy, plugin off"])
    lines = [
        f"# TP 2 start with --safetensors-load-strategy eager ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{' '.join(sys.argv)}`; vLLM's CPU build on the test bed, the ~1 B random Qwen3 "
        f"(3 shards), {args.rounds} rounds in rotating order.",
        "",
        "| arm | summed worker RssAnon peak MiB | vs lazy | each round | start-up s |",
        "|---|---|---|---|---|",
    ]
    for arm, rows in results.items():
        peak = statistics.median(r["peak"] for r in rows)
        each = " / ".join(f"{r['peak']:,.0f}" for r in rows)
        lines.append(
            f"| {arm} | {peak:,.0f} | {peak / base:.2f} "
            f"| {each} "
            f"| {statistics.median(r['startup_s'] for r in rows):.1f} |"
        )
    text = "\n".join([*lines, ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
