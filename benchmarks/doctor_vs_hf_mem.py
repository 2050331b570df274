"""doctor beside hf-mem 0.5.6 on the same stand-in Hub (tests/helpers/hub_standin.py,
serving recorded real metadata), for 5 models: wall time and peak RSS (the process's
``VmHWM``) of a fresh interpreter each, the arms alternating, ``--rounds`` each;
medians, and doctor's time over hf-mem's; each run's CPU time too, steadier than the wall
time on a loaded host. A first, untimed round writes both tools'
bytecode caches, as ``pip install`` does (``PYTHONDONTWRITEBYTECODE`` is dropped).

doctor plans an XPU host from this CPU machine (``--image``, a 24 GiB device), so the
vLLM installed here cannot answer for the image's release and platform and is not
imported: the recorded facts answer (issue 57, item 4; target: at most twice hf-mem's
time). Each doctor run starts with an empty Hugging Face cache and says whether vllm,
torch or transformers were imported. hf-mem runs with ``--experimental`` (its KV cache
estimate, the nearest to doctor's question) at the same ``--max-model-len``; it reads
``https://huggingface.co`` only, so its client's URLs are pointed at the stand-in. Its
exit status is given: it fails on some formats. hf-mem is not a dependency: install it
apart (``pip install --target DIR hf-mem==0.5.6``) and pass ``--hf-mem-site DIR``.
Prints a Markdown table; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from markdown_table import arguments, emit, this_machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.hub_standin import Server  # noqa: E402

MODELS = (
    "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-32B-AWQ",
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8",
    "openai/gpt-oss-20b",
)
IMAGE = "intel/llm-scaler-vllm:0.26.0-b2"
CONTEXT = "8192"
HEAVY = ("vllm", "torch", "transformers")
# VmHWM, not ru_maxrss: Linux carries the forking parent's peak (this process, holding the
# stand-in's data) into the child's ru_maxrss across exec; VmHWM is the new image's own.
PEAK = (
    "import atexit, json, re, sys; atexit.register(lambda: print(json.dumps({'kb': int("
    "re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)), "
    f"'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)); "
)
DOCTOR = PEAK + "from vllm_xpu_memfix.cli import main; sys.exit(main())"
HF_MEM = PEAK + (
    "import os, httpx2; build = httpx2.AsyncClient.build_request; "
    "httpx2.AsyncClient.build_request = lambda self, method, url, *a, **k: build("
    "self, method, str(url).replace('https://huggingface.co', os.environ['HF_ENDPOINT']), "
    "*a, **k); sys.argv[0] = 'hf-mem'; from hf_mem.cli import main; main()"
)


def _run(
    code: str, argv: list[str], env: dict[str, str]
) -> tuple[float, float, int, list[str], float]:
    """(seconds, peak RSS in MB, exit status, heavy modules imported, CPU seconds) of one
    interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, **env},
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    last = json.loads(result.stderr.strip().splitlines()[-1])
    return seconds, last["kb"] / 1024, result.returncode, last["heavy"], cpu


def main() -> int:
    parser = arguments(__doc__, rounds=3)
    parser.add_argument("--hf-mem-site", type=Path, required=True)
    args = parser.parse_args()
    found: dict[tuple[str, str], list[tuple[float, float, int, list[str], float]]] = {}
    with Server() as hub, tempfile.TemporaryDirectory(prefix="doctor-vs-hf-mem-") as scratch:
        online = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
        for round_ in range(-1, args.rounds):  # -1: untimed, writes the bytecode caches
            for model in MODELS:
                cache = str(Path(scratch) / f"{round_}-{model.replace('/', '--')}")
                line = ["doctor", "--image", IMAGE, "--device-memory-gib", "24", "--json"]
                line += ["--", "vllm", "serve", model, "--max-model-len", CONTEXT]
                env = {**online, "HF_HUB_CACHE": cache, "PYTHONPATH": str(ROOT)}
                ours = _run(DOCTOR, line, env)
                flags = ["--model-id", model, "--experimental", "--max-model-len", CONTEXT]
                env = {**online, "PYTHONPATH": str(args.hf_mem_site)}
                theirs = _run(HF_MEM, flags, env)
                if round_ >= 0:
                    found.setdefault(("doctor", model), []).append(ours)
                    found.setdefault(("hf-mem", model), []).append(theirs)
        weights = len(hub.downloads)
    rows = [
        f"doctor (--image {IMAGE}, planning an XPU host) beside hf-mem 0.5.6 --experimental, "
        f"--max-model-len {CONTEXT}, on the stand-in Hub; {args.rounds} fresh interpreters "
        f"per arm and model, alternating; {this_machine()}; "
        f"weight files asked for whole: {weights}",
        "",
        "| model | doctor median s | hf-mem median s | doctor / hf-mem | CPU s, doctor / hf-mem "
        "| doctor peak RSS MB | hf-mem peak RSS MB | doctor exit | hf-mem exit "
        "| imported by doctor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for model in MODELS:
        ours, theirs = found[("doctor", model)], found[("hf-mem", model)]
        mine, other = (statistics.median(r[0] for r in runs) for runs in (ours, theirs))
        ratios.append(mine / other)
        heavy = sorted({m for r in ours for m in r[3]}) or ["none of vllm, torch, transformers"]
        rows.append(
            f"| {model} | {mine:.2f} | {other:.2f} | {mine / other:.2f} | "
            f"{statistics.median(r[4] for r in ours):.2f} / "
            f"{statistics.median(r[4] for r in theirs):.2f} | "
            f"{statistics.median(r[1] for r in ours):.0f} | "
            f"{statistics.median(r[1] for r in theirs):.0f} | "
            f"{','.join(sorted({str(r[2]) for r in ours}))} | "
            f"{','.join(sorted({str(r[2]) for r in theirs}))} | {', '.join(heavy)} |"
        )
    rows += ["", f"Largest doctor / hf-mem: {max(ratios):.2f} (target: at most 2)."]
    return emit(rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
