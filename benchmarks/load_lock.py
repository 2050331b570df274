"""Host peak of a TP=2 sym_int4 load with the load lock on vs off, on the CPU test bed.

The model is the random ~1 B-parameter Qwen3 (2.3 GB bf16 in 3 shards) of
benchmarks/host_release.py; ``--quantization sym_int4`` runs the test-only replay of
Intel's module (tests/plugins/sym_int4_replay). Arms, in rotating order per round:

- ``0.21 legacy, lock off``: ``SYM_INT4_REPLAY_LAYOUT=0.21``,
  ``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1`` (both ranks buffer their whole BF16 shard on
  the host at once), ``VLLM_XPU_MEMFIX_LOAD_LOCK=off``;
- ``0.21 legacy, lock auto``: the same with the switch at its default: the slots are
  sized from this host's room, which holds both ranks' staging, so no rank waits;
- ``0.21 legacy, lock auto, tight room``: the same with ``VLLM_XPU_MEMFIX_SYSROOT`` at
  the hand-made container tree ``tests/data/proc/container-v2-tight`` (cgroup v2, 2,560
  MiB left under its limit: one rank's 960 MiB staging fits, two do not), so the lock
  decides 1 slot;
- ``0.21 legacy, flag``: the switch left at ``auto`` on a layout auto would not lock
  (streaming), plus vLLM's own ``--max-parallel-loading-workers 1``;
- ``0.26 layerwise, lock off`` and ``0.26 layerwise, lock auto``: auto must stay off.

Each server is sampled from outside every 0.1 s (the plugin's ``monitor`` sampler), and
the workers' ledgers give their RssAnon at every start-up phase. The figure is the peak of
the two workers' summed RssAnon (the higher of the sampled peak and the sum at the ledger's
phases, since a sampler starved of CPU by two loading ranks can miss a plateau) above their
summed RssAnon at process start (the ledger's first phase). ``--kv-cache-memory-bytes``
keeps the KV cache at 64 MiB. Also the start-up time to ``/health``.
Medians over ``--rounds``; ratios against the arm's "lock off"; the slots each run's
ranks decided, from their log line.

    .venv/bin/python benchmarks/load_lock.py --rounds 3 [--model DIR] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import host_release
import report_table

from vllm_xpu_memfix.cli.demo.server import Server
from vllm_xpu_memfix.cli.monitor import Sampler
from vllm_xpu_memfix.core.units import MiB

TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": None}
LEGACY = {"SYM_INT4_REPLAY_LAYOUT": "0.21", "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT": "1"}
STREAMING = {"SYM_INT4_REPLAY_LAYOUT": "0.21", "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT": "0"}
LAYERWISE = {"SYM_INT4_REPLAY_LAYOUT": "0.26"}
TIGHT_ROOM = Path(__file__).resolve().parents[1] / "tests/data/proc/container-v2-tight"
ARMS: dict[str, tuple[dict[str, str], list[str]]] = {
    "0.21 legacy, lock off": ({**LEGACY, "VLLM_XPU_MEMFIX_LOAD_LOCK": "off"}, []),
    "0.21 legacy, lock auto": (LEGACY, []),
    "0.21 legacy, lock auto, tight room": (
        {**LEGACY, "VLLM_XPU_MEMFIX_SYSROOT": str(TIGHT_ROOM)},
        [],
    ),
    "0.21 streaming, --max-parallel-loading-workers 1": (
        STREAMING,
        ["--max-parallel-loading-workers", "1"],
    ),
    "0.21 streaming, lock auto": (STREAMING, []),
    "0.26 layerwise, lock off": ({**LAYERWISE, "VLLM_XPU_MEMFIX_LOAD_LOCK": "off"}, []),
    "0.26 layerwise, lock auto": (LAYERWISE, []),
}
ARGS = [
    "--quantization",
    "sym_int4",
    "--tensor-parallel-size",
    "2",
    "--kv-cache-memory-bytes",
    str(64 * MiB),
]


class PeakWatch(threading.Thread):
    """The peak of the workers' summed RssAnon, sampled until stopped."""

    def __init__(self, server: Server, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        assert server.process is not None
        self.sampler = Sampler(server.process.pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            rows, _ = self.sampler.sample()
            workers = [r["rss_anon"] or 0 for r in rows if str(r["role"]).startswith("worker")]
            self.peak = max(self.peak, sum(workers))
            self.samples += 1


def worker_rows(ledger: Path) -> dict[str, list[dict]]:
    """Each worker's ledger phases, from its JSON lines."""
    workers = {}
    for path in ledger.glob("ledger-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if rows and str(rows[0].get("role", "")).startswith("worker"):
            workers[path.name] = rows
    return workers


def ledger_summed_peak(workers: dict[str, list[dict]]) -> int:
    """The workers' summed RssAnon at every phase any of them recorded (each worker at its
    latest phase): exact at those moments, so a floor under the sampled peak, which a
    sampler starved of CPU by two loading ranks can miss."""
    events = sorted(
        (row["ts"], name, row["rss_anon"]) for name, rows in workers.items() for row in rows
    )
    latest: dict[str, int] = {}
    peak = 0
    for _ts, name, rss in events:
        latest[name] = rss
        peak = max(peak, sum(latest.values()))
    return peak


def measure(model: Path, arm: str, workdir: Path) -> dict[str, float]:
    env, extra = ARMS[arm]
    ledger = Path(tempfile.mkdtemp(dir=workdir, prefix="ledger-"))
    env = {**TP2, **env, "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}
    server = Server(model, ledger / "server.log", extra_args=[*ARGS, *extra], env=env)
    with server:
        watch = PeakWatch(server)
        watch.start()
        server.wait_ready(timeout_s=600)
        watch.stopping.set()
        watch.join()
        server.complete("Hello", max_tokens=2)
        log = server.log_text()
        locked = log.count("load lock: waited")
        decided = [int(n) for n in re.findall(r"-> (\d+) slot\(s\)", log)]
    workers = worker_rows(ledger)
    start = sum(rows[0]["rss_anon"] for rows in workers.values())
    peak = max(watch.peak, ledger_summed_peak(workers))
    return {
        "peak_above_start": (peak - start) / MiB,
        "sampled_missed_mib": max(0, ledger_summed_peak(workers) - watch.peak) / MiB,
        "samples": watch.samples,
        "startup_s": server.ready_after_s or 0.0,
        "ranks_locked": locked,
        "slots": max(decided, default=0),
    }


def same_round_ratios(mine: list[dict], theirs: list[dict], key: str) -> list[float]:
    """Each round's figure over the base arm's of the same round: the rounds drift with the
    machine (other jobs on its cores), two arms of one round less so."""
    return [a[key] / b[key] for a, b in zip(mine, theirs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path)
    parser.add_argument(
        "--arms", default=";".join(ARMS), help="a ';'-separated subset of: " + "; ".join(ARMS)
    )
    default_out = Path(__file__).parent / "results" / f"load-lock-{time.strftime('%Y-%m-%d')}.md"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="load-lock-"))
    model = host_release.given_or_made_model(args.model, workdir)
    arms = [arm.strip() for arm in args.arms.split(";")]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            figures = measure(model, arm, workdir)
            results[arm].append(figures)
            print(f"round {round_ + 1}/{args.rounds} {arm}: {figures}", file=sys.stderr, flush=True)

    def median(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in results[arm])

    rows = []
    for arm in arms:
        base = arm.split(",")[0] + ", lock off"
        base = base if base in results else "0.21 legacy, lock off"
        ratio = median(arm, "peak_above_start") / median(base, "peak_above_start")
        peaks = same_round_ratios(results[arm], results[base], "peak_above_start")
        startups = same_round_ratios(results[arm], results[base], "startup_s")
        rows.append(
            (
                arm,
                f"{median(arm, 'peak_above_start'):,.0f}",
                " / ".join(f"{r['peak_above_start']:,.0f}" for r in results[arm]),
                f"{ratio:.2f}",
                f"{statistics.median(peaks):.2f} ({' / '.join(f'{r:.2f}' for r in peaks)})",
                f"{median(arm, 'startup_s'):.1f}",
                f"{median(arm, 'startup_s') / median(base, 'startup_s'):.2f}",
                f"{statistics.median(startups):.2f} ({' / '.join(f'{r:.2f}' for r in startups)})",
                " / ".join(f"{r['startup_s']:.1f}" for r in results[arm]),
                " / ".join(f"{r['slots']:.0f}" for r in results[arm]) or "-",
                f"{median(arm, 'ranks_locked'):.0f}",
            )
        )
    header = (
        "arm",
        "summed worker RssAnon peak above process start, MiB (median)",
        "each round",
        "median vs lock off's median",
        "median of the ratios to lock off in the same round (each)",
        "start-up s (median)",
        "start-up vs lock off",
        "median of the same-round start-up ratios (each)",
        "start-up each round",
        "slots decided from the room (each round; 0: not sized)",
        "ranks that took the lock",
    )
    lines = [
        f"# Load lock, TP=2, {time.strftime('%Y-%m-%d')}",
        "",
        f"`{' '.join(sys.argv)}`; model {model.name}, {args.rounds} rounds, arms in rotating "
        "order. Streaming and legacy arms are compared with the 0.21 legacy lock-off arm, the "
        "layerwise arms with the 0.26 lock-off arm.",
        "",
        *report_table.table(header, rows),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
