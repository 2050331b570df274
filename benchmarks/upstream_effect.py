"""The vLLM patch series' effect through vLLM alone, with this plugin off, on the CPU test bed.

Both arms run with the plugin off (``VLLM_PLUGINS`` names only the test-only replay of
Intel's ``sym_int4`` where it is needed, never ``vllm_xpu_memfix``). The "patched" arm
runs vLLM from a copy of the installed package with docs/upstream/patches applied
(``scripts/upstream_check.py`` builds it), put first on ``PYTHONPATH``; the "as is" arm
runs the installed vLLM. Rounds alternate the arms' order; figures are medians.

- ``load``: TP 2, ``--quantization sym_int4`` through the replay's 0.21 legacy load
  (both ranks buffer their whole BF16 shard on the host, as in benchmarks/load_lock.py).
  As is (the flag does nothing in vLLM 0.32) vs patched with
  ``--max-parallel-loading-workers 1``. Figure: the peak of the two workers' summed
  RssAnon, sampled every 0.1 s from outside, above the first sample that saw both.
- ``release`` and ``release-fp32``: TP 1, the bf16 checkpoint as is and with
  ``--dtype float32``; as is vs patched. Figure: RssAnon of the
  worker process at ready, after one request, read from outside (the figure
  benchmarks/host_release.py reads from the plugin's ledger inside the worker).

    .venv/bin/python benchmarks/upstream_effect.py --rounds 3 [--cases load,release] \
        [--model DIR] [--out FILE.md]

(``--cases release,release-fp32`` for the host release alone.)
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import upstream_check

PLUGIN_OFF = {"VLLM_XPU_MEMFIX": "0"}
CASES: dict[str, dict[str, tuple[dict[str, str], list[str]]]] = {
    "load": {
        "as is": ({**load_lock.LEGACY, "VLLM_PLUGINS": "sym_int4_replay"}, []),
        "patched, --max-parallel-loading-workers 1": (
            {**load_lock.LEGACY, "VLLM_PLUGINS": "sym_int4_replay"},
            ["--max-parallel-loading-workers", "1"],
        ),
    },
    "release": {
        "as is": ({"VLLM_PLUGINS": ""}, []),
        "patched": ({"VLLM_PLUGINS": ""}, []),
    },
    "release-fp32": {
        "as is": ({"VLLM_PLUGINS": ""}, ["--dtype", "float32"]),
        "patched": ({"VLLM_PLUGINS": ""}, ["--dtype", "float32"]),
    },
}


class WorkerPeak(threading.Thread):
    """Peak of the workers' summed RssAnon above the first sample that saw all of them."""

    def __init__(self, server: Server, workers: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        assert server.process is not None
        self.sampler = Sampler(server.process.pid)
        self.workers, self.interval = workers, interval
        self.start_sum: int | None = None
        self.peak = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            rows, _ = self.sampler.sample()
            rss = [r["rss_anon"] or 0 for r in rows if r["role"] == "worker"]
            if len(rss) < self.workers:
                continue
            if self.start_sum is None:
                self.start_sum = sum(rss)
            self.peak = max(self.peak, sum(rss))


def worker_rss_anon(server: Server) -> int:
    """RssAnon of the worker process (the CPU build runs one beside the engine core even
    at TP 1), else of the engine core that holds the worker."""
    assert server.process is not None
    rows, _ = Sampler(server.process.pid).sample()
    workers = [r["rss_anon"] or 0 for r in rows if r["role"] == "worker"]
    cores = [r["rss_anon"] or 0 for r in rows if r["role"] == "engine_core"]
    return sum(workers or cores)


def measure(case: str, arm: str, model: Path, patched: Path, workdir: Path) -> float:
    env, extra = CASES[case][arm]
    env = {**PLUGIN_OFF, **env}
    if arm.startswith("patched"):
        env["PYTHONPATH"] = str(patched)
    log = Path(tempfile.mkdtemp(dir=workdir)) / "server.log"
    if case == "load":
        env = {**load_lock.TP2, **env}
        with Server(model, log, env=env, extra_args=[*load_lock.ARGS, *extra]) as server:
            watch = WorkerPeak(server, workers=2)
            watch.start()
            server.wait_ready(timeout_s=600)
            watch.stopping.set()
            watch.join()
            server.complete("Hello", max_tokens=2)
        return (watch.peak - (watch.start_sum or 0)) / MiB
    with Server(model, log, env=env, extra_args=extra) as server:
        server.wait_ready(timeout_s=400)
        server.complete("Hello", max_tokens=4)
        time.sleep(1)
        return worker_rss_anon(server) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="load,release")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="upstream-effect-") as tmp:
        workdir = Path(tmp)
        model = host_release.given_or_made_model(args.model, workdir)
        patched = workdir / "patched"
        installed = upstream_check.installed_vllm_root()
        outcomes = upstream_check.check(
            upstream_check.series(upstream_check.release_version(installed)),
            installed,
            patched,
            apply_only=True,
        )
        if not all(isinstance(o, upstream_check.Outcome) and o.applied for o in outcomes):
            raise SystemExit("the patch series does not apply; run make upstream-check")
        lines = []
        for case in args.cases.split(","):
            arms = list(CASES[case])
            figures: dict[str, list[float]] = {arm: [] for arm in arms}
            for round_ in range(args.rounds):
                for arm in arms[round_ % 2 :] + arms[: round_ % 2]:
                    figures[arm].append(measure(case, arm, model, patched, workdir))
                    print(f"{case} / {arm}: {figures[arm][-1]:,.0f} MiB", flush=True)
            base = statistics.median(figures[arms[0]])
            for arm in arms:
                median = statistics.median(figures[arm])
                each = " / ".join(f"{value:,.0f}" for value in figures[arm])
                lines.append(
                    f"| {case} | {arm} | {median:,.0f} | {each} | {median - base:+,.0f} "
                    f"| {median / base:.2f} |"
                )
    table = "\n".join(
        [
            "| case | arm | MiB (median) | each round | vs as is | ratio |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
