"""Anonymous memory of reading a ``.bin`` checkpoint as vLLM does, with and without ``mmap=True``.

vLLM's default loader reads a ``pytorch_model.bin`` with ``torch.load(bin_file,
map_location="cpu", weights_only=True)`` (``weight_utils.pt_weights_iterator``, v0.34.0
line 908): the whole file lands in anonymous memory, on every TP rank at once; that is
what ``--max-parallel-loading-workers`` slots would bound. ``torch.load(..., mmap=True)``
maps the file instead: its tensors are page cache, shared by the ranks and reclaimable.

Each arm runs in a fresh process: write nothing, ``torch.load`` the file, touch every
tensor (a sum, as a copy to the device would read it), and report the peak of RssAnon
above the process's RssAnon before the load, sampled every 2 ms, with VmHWM's growth.

    .venv/bin/python benchmarks/bin_mmap.py --mib 512 --rounds 3 [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAKE = """
import sys, torch
torch.manual_seed(0)
count, mib = 32, int(sys.argv[2])
rows = mib * 2**20 // (count * 4096 * 2)
torch.save({f"layer.{i}.weight": torch.randn(rows, 4096, dtype=torch.bfloat16)
            for i in range(count)}, sys.argv[1])
"""

READ = r"""
import json, sys, threading, time, torch

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

peak, stop = [0], threading.Event()
def sample():
    while not stop.wait(0.002):
        peak[0] = max(peak[0], status("RssAnon"))
base, hwm = status("RssAnon"), status("VmHWM")
threading.Thread(target=sample, daemon=True).start()
started = time.monotonic()
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=sys.argv[2] == "1")
total = sum(float(t.sum()) for t in state.values())  # reads every byte, no copy
seconds = time.monotonic() - started
stop.set()
peak[0] = max(peak[0], status("RssAnon"))
print(json.dumps({"peak_anon": peak[0] - base, "hwm_growth": status("VmHWM") - hwm,
                  "seconds": seconds}))
"""


def measure(path: Path, mmap: bool) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", READ, str(path), "1" if mmap else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    arms: dict[str, list[dict[str, float]]] = {"torch.load": [], "torch.load(mmap=True)": []}
    with tempfile.TemporaryDirectory(prefix="bin-mmap-") as tmp:
        path = Path(tmp) / "pytorch_model.bin"
        subprocess.run([sys.executable, "-c", MAKE, str(path), str(args.mib)], check=True)
        size = path.stat().st_size
        for round_ in range(args.rounds):
            for arm in arms if round_ % 2 == 0 else reversed(list(arms)):
                arms[arm].append(measure(path, arm.endswith("(mmap=True)")))
    mib = 2**20
    lines = [
        f"# `.bin` read with and without mmap ({time.strftime('%Y-%m-%d')})",
        "",
        f"torch {torch.__version__}; a {size / mib:,.1f} MiB `pytorch_model.bin` of 32 bf16 "
        f"tensors; medians of {args.rounds}, a fresh process each.",
        "",
        f"`.venv/bin/python benchmarks/bin_mmap.py --mib {args.mib} --rounds {args.rounds}`",
        "",
        "| arm | peak RssAnon MiB | VmHWM growth MiB | read + touch s |",
        "|---|---|---|---|",
    ]
    for arm, rows in arms.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        lines.append(
            f"| {arm} | {med['peak_anon'] / mib:,.1f} | {med['hwm_growth'] / mib:,.1f} "
            f"| {med['seconds']:.2f} |"
        )
    text = "\n".join([*lines, ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
