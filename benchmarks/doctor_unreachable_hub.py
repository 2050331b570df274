"""What an unreachable Hub costs ``doctor`` against offline: the same pasted line
(``doctor --params 8B -- vllm serve Qwen/Qwen3-8B``, a CPU host file, an empty Hugging Face
cache) in fresh interpreters, with ``HF_HUB_OFFLINE=1``, with ``HF_ENDPOINT`` at a closed
port of 127.0.0.1 (connection refused), and, for reference, the closed port with doctor's
probe of the Hub turned off (``memory.hub_reach.unreachable`` answering None: the run as
before issue 59, huggingface_hub retrying). The arms alternate, ``--rounds`` each; medians.
Target (issue 59): the closed port at most 2 s over offline. Prints a Markdown table;
``--out FILE`` writes it too.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from markdown_table import arguments, emit, this_machine

ROOT = Path(__file__).resolve().parent.parent
DOCTOR = "import sys; {hide}from vllm_xpu_memfix.cli import main; sys.exit(main())"
NO_PROBE = "from vllm_xpu_memfix.memory import hub_reach; hub_reach.unreachable = lambda: None; "


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(code: str, argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, *argv],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        check=True,
        timeout=300,
    )
    return time.perf_counter() - started


def main() -> int:
    parser = arguments(__doc__, rounds=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doctor-unreachable-"))
    host = work / "cpu-host.toml"
    host.write_text("gpu = []\n\n[host]\nram_gib = 64\n")
    line = ["doctor", "--host", str(host), "--params", "8B", "--json", "--"]
    line += ["vllm", "serve", "Qwen/Qwen3-8B"]
    cache = {"HF_HUB_CACHE": str(work / "hf-cache"), "HF_HOME": str(work / "hf-home")}
    closed = {**cache, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    arms = {
        "HF_HUB_OFFLINE=1": (DOCTOR.format(hide=""), {**cache, "HF_HUB_OFFLINE": "1"}),
        "HF_ENDPOINT at a closed port": (DOCTOR.format(hide=""), closed),
        "closed port, doctor's probe off (as before)": (DOCTOR.format(hide=NO_PROBE), closed),
    }
    code, env = arms["HF_HUB_OFFLINE=1"]
    _run(code, line, env)  # vLLM's caches, once
    found: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (code, env) in arms.items():
            found[name].append(_run(code, line, env))
    offline = statistics.median(found["HF_HUB_OFFLINE=1"])
    rows = [
        f"doctor with an unreachable Hub against offline, {args.rounds} fresh interpreters per "
        f"arm, alternating, {this_machine()}",
        "",
        "| arm | median s | min s | max s | median over offline s |",
        "|---|---|---|---|---|",
    ]
    for name, runs in found.items():
        median = statistics.median(runs)
        rows.append(
            f"| {name} | {median:.2f} | {min(runs):.2f} | {max(runs):.2f} | "
            f"{median - offline:+.2f} |"
        )
    return emit(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
