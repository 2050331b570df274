"""How much a second gc.collect() + malloc_trim(0) gives back once the worker is ready.

Serves the ~1 B-parameter test model with host_release on and off. A
``sitecustomize`` put on the servers' PYTHONPATH installs a handler for a
real-time signal in every vLLM process; at ready (after one request) the script
signals them, and each one writes its RssAnon before and after the plugin's own
release (``gc.collect()``, ``empty_cache()``, ``malloc_trim(0)`` or the preloaded
allocator's equivalent). A near-zero figure with the fix on means no freed
memory is left in the allocator for anyone to return.

    .venv/bin/python benchmarks/trim_at_ready.py [--model DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import host_release
import report_table

from vllm_xpu_memfix.cli.demo.server import Server

PROBE_SIGNAL = signal.SIGRTMIN + 6
MiB = 1024**2
# Runs in every server process. It measures and releases with the plugin's own code, the same
# calls host_release makes (gc, empty_cache, the detected allocator's release).
SITECUSTOMIZE = textwrap.dedent(
    f"""
    import os, signal

    def _probe(signum, frame):
        from vllm_xpu_memfix.memory import allocator
        from vllm_xpu_memfix.memory.snapshot import take_self

        before = take_self(pss=False).rss_anon
        allocator.release_free_memory()
        after = take_self(pss=False).rss_anon
        with open("/proc/self/comm") as comm:
            name = comm.read().strip()
        with open(os.path.join(os.environ["TRIM_PROBE_DIR"], f"{{os.getpid()}}.txt"), "w") as out:
            out.write(f"{{name}} {{before}} {{after}}\\n")

    if os.environ.get("TRIM_PROBE_DIR"):
        open(os.path.join(os.environ["TRIM_PROBE_DIR"], f"{{os.getpid()}}.pid"), "w").close()
        signal.signal({int(PROBE_SIGNAL)}, _probe)
    """
)


def probe(model: Path, release: str, workdir: Path) -> tuple[float, float]:
    """Worker RssAnon (MiB) at ready, before and after the second release."""
    results = Path(tempfile.mkdtemp(dir=workdir, prefix=f"trim-{release}-"))
    hooks = workdir / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        "VLLM_XPU_MEMFIX_HOST_RELEASE": release,
        "TRIM_PROBE_DIR": str(results),
        "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
    }
    with Server(model, results / "server.log", env=env) as server:
        server.wait_ready(timeout_s=400)
        server.complete("Hello", max_tokens=4)
        for pid_file in results.glob("*.pid"):
            with contextlib.suppress(ProcessLookupError):  # e.g. a finished helper
                os.kill(int(pid_file.stem), PROBE_SIGNAL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = [p.read_text().split() for p in results.glob("*.txt")]
            workers = [row for row in rows if row and "Worker" in row[0]]
            if workers:
                _, before, after = workers[0]
                return int(before) / MiB, int(after) / MiB
            time.sleep(0.5)
    raise RuntimeError(f"the worker did not answer the probe; see {results / 'server.log'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: make one)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trim-at-ready-"))
    model = host_release.given_or_made_model(args.model, workdir)
    rows = []
    for release in ("on", "off"):
        before, after = probe(model, release, workdir)
        rows.append([release, *(f"{mib:,.0f} MiB" for mib in (before, after, before - after))])
    header = ("host_release", "worker RssAnon at ready", "after a second gc + trim", "returned")
    print("\n".join(report_table.table(header, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
