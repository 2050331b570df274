"""The preflight's predicted host need against what the start-up measured at ready, on the
CPU test bed: the ratio the at-ready line logs (``startup.prediction_check``).

For each model (the demo's tiny Qwen3, the 134 M ``SMALL`` and the 1.04 B ``ONE_B`` of
``cli/demo/tiny_model``), ``--rounds`` fresh starts of the real vLLM server with the plugin
(defaults) and a ledger directory each; the API server's ``ready`` ledger row gives the
predicted host need (on the CPU backend: weights + KV cache + the processes' own memory,
``startup.cpu_backend.processes``) and the measured one (the vLLM
tree's anon + shmem PSS at ready; no GPU here, so no GPUActive rise and no device figure).
Medians, with the range, go to ``benchmarks/results/prediction-ratio-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3
MODELS = ("TINY", "SMALL", "ONE_B")


def one_start(model: Path, work: Path) -> dict[str, float]:
    from vllm_xpu_memfix.cli.demo.server import Server
    from vllm_xpu_memfix.startup import prediction_check

    ledger = work / "ledger"
    with Server(model, work / "server.log", env={"VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}) as s:
        s.wait_ready(timeout_s=900)
    rows = [
        json.loads(x) for p in ledger.glob("ledger-*.jsonl") for x in p.read_text().splitlines()
    ]
    (ready,) = [r for r in rows if r["phase"] == prediction_check.READY and "predicted_host" in r]
    return {
        "predicted": ready["predicted_host"] / GiB,
        "measured": ready["measured_host"] / GiB,
        "ratio": ready["measured_host"] / ready["predicted_host"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--suffix", default="", help="appended to the result file's name")
    args = parser.parse_args()
    from vllm_xpu_memfix.cli.demo import tiny_model

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = tiny_model.make_model(Path(tmp) / name, getattr(tiny_model, name))
            runs = []
            for index in range(args.rounds):
                runs.append(one_start(model, Path(tempfile.mkdtemp(dir=tmp))))
                print(f"{name} round {index + 1}: {runs[-1]}", file=sys.stderr, flush=True)
            ratios = [r["ratio"] for r in runs]
            lines.append(
                f"| {name} | {len(runs)} | {statistics.median(r['predicted'] for r in runs):.2f} | "
                f"{statistics.median(r['measured'] for r in runs):.2f} | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
            )
    today = datetime.date.today().isoformat()
    out = ROOT / "benchmarks" / "results" / f"prediction-ratio-{today}{args.suffix}.md"
    out.write_text(
        f"# Predicted host need against measured at ready ({today})\n\n"
        f"`python benchmarks/prediction_ratio.py --rounds {args.rounds}`. Machine: "
        f"{platform.machine()}, Python {platform.python_version()}, vLLM CPU build, TP 1, "
        "`VLLM_CPU_KVCACHE_SPACE=1`. Predicted: the preflight's need on vLLM's CPU backend, "
        "weights + KV cache + the processes' own memory (an estimate from the test bed's "
        "process baseline, startup/cpu_backend.py). Measured: the "
        "vLLM tree's anon + shmem PSS when the API server's engine is ready. Ratio: measured "
        "/ predicted, median (range).\n\n"
        "| model | starts | predicted GiB | measured GiB | ratio |\n|---|---|---|---|---|\n"
        + "\n".join(lines)
        + "\n"
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
