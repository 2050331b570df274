"""What ``monitor``'s sampling costs: the CPU time (user + system) of the sampling process
per second of wall time at the default interval (0.5 s), sampling a real process tree and
every other process of the host (issue 61: at most 2 % of one core).

Trees (``--tree``, both by default): ``sleepers``, a parent and ``--sleepers`` Python
children each holding ``--hold-mib`` of touched memory; ``server``, vLLM's OpenAI server on
the demo's tiny model, idle after ready (API server, EngineCore, worker). ``--rounds``
samplings of ``--seconds`` each per tree, CSV rows written as ``monitor`` writes them;
medians. Prints a Markdown table; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from markdown_table import arguments, emit, this_machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from vllm_xpu_memfix.cli import monitor  # noqa: E402

INTERVAL = 0.5  # monitor's default
SLEEPER = "import sys, time; block = bytearray({size}); time.sleep({seconds})"
PARENT = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", {child!r}]) for _ in range({count})]
print("up", flush=True)
for child in children:
    child.wait()
"""


@contextlib.contextmanager
def sleepers(count: int, hold_mib: int, seconds: float) -> Iterator[int]:
    """The parent's pid, once its children hold their memory."""
    child = SLEEPER.format(size=hold_mib * 2**20, seconds=seconds)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(child=child, count=count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        time.sleep(3)  # the children's interpreters up and their blocks written
        yield parent.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            for proc in psutil.Process(parent.pid).children(recursive=True):
                proc.kill()
        parent.kill()
        parent.wait()


@contextlib.contextmanager
def server(workdir: Path) -> Iterator[int]:
    from vllm_xpu_memfix.cli.demo.server import Server
    from vllm_xpu_memfix.cli.demo.tiny_model import make_model

    model = make_model(workdir / "model")
    with Server(model, workdir / "server.log") as running:
        running.wait_ready()
        assert running.process is not None
        yield running.process.pid


def sampling_cost(pid: int, seconds: float, csv_path: Path) -> tuple[float, int, int, float]:
    """(% of one core, tree processes, host processes, % of one core in PSS reads) of one
    sampling of ``pid``'s tree for ``seconds``."""
    sampler = monitor.Sampler(pid)
    end = time.monotonic() + seconds
    cpu, wall = time.process_time(), time.monotonic()
    monitor.record(sampler, csv_path, lambda: time.monotonic() < end, INTERVAL)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    rows, _ = sampler.sample()
    return 100 * cpu / wall, len(rows), len(sampler.others.pids()), 100 * sampler.pss.spent_s / wall


def main() -> int:
    parser = arguments(__doc__, rounds=5)
    parser.add_argument("--tree", choices=("sleepers", "server", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--sleepers", type=int, default=8)
    parser.add_argument("--hold-mib", type=int, default=256)
    args = parser.parse_args()
    trees = ("sleepers", "server") if args.tree == "both" else (args.tree,)
    rows = [
        f"monitor's sampling cost at a {INTERVAL} s interval, {args.rounds} samplings of "
        f"{args.seconds:.0f} s per tree, {this_machine()}",
        "",
        "| tree | processes in the tree | on the host | median % of one core | min | max "
        "| of which PSS reads, median % |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        for tree in trees:
            lifetime = args.rounds * (args.seconds + 5) + 60
            start = (
                sleepers(args.sleepers, args.hold_mib, lifetime)
                if tree == "sleepers"
                else server(Path(scratch))
            )
            with start as pid:
                runs = [
                    sampling_cost(pid, args.seconds, Path(scratch) / f"{tree}-{i}.csv")
                    for i in range(args.rounds)
                ]
            shares = [r[0] for r in runs]
            name = (
                f"{args.sleepers} sleepers of {args.hold_mib} MiB"
                if tree == "sleepers"
                else ("vLLM server, tiny model, idle")
            )
            rows.append(
                f"| {name} | {runs[-1][1]} | {runs[-1][2]} | {statistics.median(shares):.2f} "
                f"| {min(shares):.2f} | {max(shares):.2f} "
                f"| {statistics.median(r[3] for r in runs):.2f} |"
            )
    return emit(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
