"""``vllm-xpu-memfix monitor``: run a command and sample its process tree's host memory.

Writes one CSV row per process per sample plus one ``system`` row per sample.
A process whose /proc files the kernel refuses to us (``hidepid``, another
user's) stays in the tree with empty figures and the refused files in ``denied``;
the report names it once. Only a process that is gone leaves the tree.
The system row carries "outside any process": the MemAvailable drop since the
first sample minus the growth of the tree's anonymous + shmem PSS
(``memory.attribution.outside_any_process``); once the tree has a DRM client, the
driver's host copy as the host committed it (the kernel's ``GPUActive`` rise where it
counts GPU memory, else "outside any process"); and the tree's peer imports, the rise of
its summed ``drm-total-gtt``, which is not host memory by itself
(``memory.attribution.driver_host_copy``).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil

from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.attribution import driver_host_copy, outside_any_process
from vllm_xpu_memfix.memory.others import OtherProcesses, OthersSample
from vllm_xpu_memfix.memory.pss_budget import Pss, PssCache
from vllm_xpu_memfix.memory.snapshot import LIVE, ProcReader, Snapshot
from vllm_xpu_memfix.memory.tree import role_of

COLUMNS = (
    "ts",
    "t",
    "pid",
    "label",
    "role",
    "rss",
    "rss_anon",
    "rss_file",
    "rss_shmem",
    "pss",
    "anon_pss",
    "drm_cards",
    "drm_total_gtt",
    "drm_total_vram",
    "mem_total",
    "mem_free",
    "mem_available",
    "cached",
    "committed_as",
    "swap_used",
    "cgroup_current",
    "cgroup_max",
    "gpu_active",
    "other_processes",
    "others_unseen",
    "outside_processes",
    "driver_host_copy",
    "peer_imports",
    "denied",
)
_TITLE = re.compile(r"\w+::(\S+)")
T = TypeVar("T")


def label_of(pid: int, cmdline: list[str], name: str) -> str:
    """``Worker_TP0 (pid)`` from vLLM's process title, else the role, else the program name."""
    match = _TITLE.search(" ".join(cmdline[:1]))
    role = role_of(cmdline)
    return f"{match.group(1) if match else role if role != 'other' else name} ({pid})"


@dataclass
class Peaks:
    summed_rss: int = 0
    summed_pss: int = 0
    mem_available_drop: int = 0
    other_processes: int = 0
    outside_processes: int = 0
    # What of the other processes could not be read, as last said; empty: all were.
    others_unseen: str = ""
    # None until the tree has a DRM client.
    driver_host_copy: int | None = None
    peer_imports: int | None = None
    per_process: dict[int, int] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    # Processes whose files the kernel refused, with the files, as last seen.
    unreadable: dict[int, str] = field(default_factory=dict)

    def update(self, rows: list[dict[str, Any]], system: dict[str, Any]) -> None:
        self.summed_rss = max(self.summed_rss, sum(r["rss"] or 0 for r in rows))
        self.summed_pss = max(self.summed_pss, sum(r["pss"] or 0 for r in rows))
        self.other_processes = max(self.other_processes, system["other_processes"] or 0)
        self.outside_processes = max(self.outside_processes, system["outside_processes"] or 0)
        self.others_unseen = system["others_unseen"] or self.others_unseen
        self.driver_host_copy = _peak(self.driver_host_copy, system["driver_host_copy"])
        self.peer_imports = _peak(self.peer_imports, system["peer_imports"])
        for r in rows:
            self.labels[r["pid"]] = r["label"]
            if r["denied"]:
                self.unreadable[r["pid"]] = r["denied"]
            if r["rss"] is not None:
                self.per_process[r["pid"]] = max(self.per_process.get(r["pid"], 0), r["rss"])

    def report(self) -> str:
        bound = f" (an upper bound: not seen: {self.others_unseen})" if self.others_unseen else ""
        lines = [
            f"peak summed RSS {self.summed_rss / MiB:,.0f} MiB, "
            f"largest MemAvailable drop {self.mem_available_drop / MiB:,.0f} MiB",
            f"peak tree PSS {self.summed_pss / MiB:,.0f} MiB, "
            f"peak growth of other processes {self.other_processes / MiB:,.0f} MiB, "
            f"peak not in any process {self.outside_processes / MiB:,.0f} MiB{bound}",
        ]
        if self.driver_host_copy is not None:
            lines.append(
                f"peak driver host copy (committed) {self.driver_host_copy / MiB:,.0f} MiB, "
                f"peak peer imports {(self.peer_imports or 0) / MiB:,.0f} MiB "
                "(drm-total-gtt: not host memory by itself)"
            )
        lines.append("peak RSS per process:")
        for pid, rss in sorted(self.per_process.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {self.labels[pid]:<32} {rss / MiB:>10,.0f} MiB")
        if self.unreadable:
            lines.append(
                f"not allowed to read {len(self.unreadable)} process(es) (hidepid, or another "
                "user's); kept in the tree with their figures left empty:"
            )
            for pid, denied in sorted(self.unreadable.items()):
                lines.append(f"  {self.labels[pid]:<32} refused: {denied}")
        return "\n".join(lines)


def _peak(peak: int | None, value: int | None) -> int | None:
    """The larger of the two; ``None`` while neither was seen."""
    if value is None:
        return peak
    return value if peak is None else max(peak, value)


def _allowed(read: Callable[[], T], default: T) -> T:
    """``read()``, or ``default`` where the kernel refuses it; a gone process still raises."""
    try:
        return read()
    except psutil.AccessDenied:
        return default


def _rss(snap: Snapshot) -> int | None:
    parts = (snap.rss_anon, snap.rss_file, snap.rss_shmem)
    return None if all(v is None for v in parts) else sum(v or 0 for v in parts)


class Sampler:
    """Samples a process and its descendants as they appear and vanish, and the others."""

    def __init__(self, root_pid: int, reader: ProcReader = LIVE) -> None:
        self.root = psutil.Process(root_pid)
        self.pss = PssCache(reader)
        self.others = OtherProcesses(reader, self.pss)
        self.reader = reader
        self.t0 = time.time()
        # The system, the tree and the others at the first sample, which later samples
        # are measured from.
        self.first: Snapshot | None = None
        self.first_tree_anon_pss = 0
        self.first_others = 0
        self.first_imports = 0
        self.peaks = Peaks()
        # A worker's title is set a while after it starts; keep the most telling label.
        self.labels: dict[int, str] = {}

    @property
    def reader(self) -> ProcReader:
        return self._reader

    @reader.setter
    def reader(self, reader: ProcReader) -> None:
        self._reader = self.pss.reader = self.others.reader = reader

    def processes(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def sample(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        now = time.time()
        self.pss.tick()
        rows: list[dict[str, Any]] = []
        for proc in self.processes():
            try:
                cmdline: list[str] = _allowed(proc.cmdline, [])
                name = _allowed(proc.name, "unknown")
                if proc.pid not in self.pss.parents:
                    self.pss.born(proc.pid, _allowed(proc.ppid, 0))
            except psutil.NoSuchProcess:  # and zombies: exited after listing
                continue
            snap = self.reader.take(proc.pid, pss=False, system=False)
            if snap.gone:  # exited between listing and reading
                continue
            role = role_of(cmdline)
            if role != "other" or proc.pid not in self.labels:
                self.labels[proc.pid] = label_of(proc.pid, cmdline, name)
            rss = _rss(snap)
            pss = Pss(None, None)
            if rss is not None:
                pss = self.pss.get(proc.pid, rss, (snap.rss_anon or 0) + (snap.rss_shmem or 0))
            rows.append(
                {
                    "ts": now,
                    "t": now - self.t0,
                    "pid": proc.pid,
                    "label": self.labels[proc.pid],
                    "role": role,
                    "anon_pss": pss.anon_pss,
                    "rss": rss,
                    "rss_anon": snap.rss_anon,
                    "rss_file": snap.rss_file,
                    "rss_shmem": snap.rss_shmem,
                    "pss": pss.pss,
                    "drm_cards": snap.drm.cards if snap.drm else None,
                    "drm_total_gtt": snap.drm.total_gtt if snap.drm else None,
                    "drm_total_vram": snap.drm.total_vram if snap.drm else None,
                    "denied": ", ".join((*snap.denied, *(["smaps_rollup"] if pss.refused else []))),
                }
            )
        listed = self.others.pids()
        others = self.others.sample({r["pid"] for r in rows}, listed)
        self.pss.keep_only(listed)
        system = self._system_row(now, rows, others)
        self.peaks.update(rows, system)
        return rows, system

    def _system_row(
        self, now: float, rows: list[dict[str, Any]], others: OthersSample
    ) -> dict[str, Any]:
        snap = self.reader.take(self.root.pid, pss=False)
        tree_anon_pss = sum(r["anon_pss"] or 0 for r in rows)
        imports = sum(r["drm_total_gtt"] or 0 for r in rows)
        if self.first is None:
            self.first, self.first_tree_anon_pss, self.first_imports = snap, tree_anon_pss, imports
            self.first_others = others.anon
        # What MemAvailable lost that no process maps: the tree's growth and the others'
        # are both taken out.
        outside = outside_any_process(
            self.first.available,
            snap.available,
            self.first_tree_anon_pss + self.first_others,
            tree_anon_pss + others.anon,
        )
        cards = max((r["drm_cards"] or 0 for r in rows), default=0)
        copy = driver_host_copy(
            self.first,
            snap,
            outside,
            gpu_driver=cards > 0,
            peer_imports=imports - self.first_imports,
            cards=cards,
        )
        if outside.mem_available_drop is not None:
            self.peaks.mem_available_drop = max(
                self.peaks.mem_available_drop, outside.mem_available_drop
            )
        swap_used = None
        if snap.swap_total is not None and snap.swap_free is not None:
            swap_used = snap.swap_total - snap.swap_free
        return {
            "ts": now,
            "t": now - self.t0,
            "pid": "system",
            "label": "system",
            "role": "system",
            "rss": sum(r["rss"] or 0 for r in rows),
            "pss": sum(r["pss"] or 0 for r in rows),
            "anon_pss": tree_anon_pss,
            "mem_total": snap.mem_total,
            "mem_free": snap.mem_free,
            "mem_available": snap.mem_available,
            "cached": snap.cached,
            "committed_as": snap.committed_as,
            "swap_used": swap_used,
            "cgroup_current": snap.cgroup_current,
            "cgroup_max": snap.cgroup_max,
            "gpu_active": snap.gpu_active,
            "other_processes": others.anon - self.first_others,
            "others_unseen": others.unseen,
            "outside_processes": outside.outside_processes,
            "driver_host_copy": copy.committed,
            "peer_imports": copy.peer_imports if cards else None,
        }


def _status_line(t: float, rows: list[dict[str, Any]], system: dict[str, Any]) -> str:
    available = system["mem_available"]
    avail = "-" if available is None else f"{available / MiB:,.0f}"
    return (
        f"\r[{t:7.1f} s] {len(rows)} processes, RSS {system['rss'] / MiB:,.0f} MiB, "
        f"MemAvailable {avail} MiB "
    )


def sample_to_csv(
    pid: int,
    csv_path: Path,
    keep_going: Callable[[], bool],
    interval: float = 0.5,
    live: IO[str] | None = None,
) -> Peaks:
    """Sample ``pid``'s tree into ``csv_path`` every ``interval`` s while ``keep_going()``."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        sampler = Sampler(pid)
    except psutil.NoSuchProcess:
        csv_path.write_text(",".join(COLUMNS) + "\n", encoding="utf-8")
        return Peaks()
    return record(sampler, csv_path, keep_going, interval, live)


def record(
    sampler: Sampler,
    csv_path: Path,
    keep_going: Callable[[], bool],
    interval: float = 0.5,
    live: IO[str] | None = None,
) -> Peaks:
    """Write ``sampler``'s samples into ``csv_path`` every ``interval`` s while
    ``keep_going()``."""
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        while keep_going():
            started = time.monotonic()
            rows, system = sampler.sample()
            writer.writerows([*rows, system])
            f.flush()
            if live is not None:
                live.write(_status_line(system["t"], rows, system))
                live.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    if live is not None:
        live.write("\n")
    return sampler.peaks


class CannotStart(RuntimeError):
    """The command could not be started (it was checked just before)."""


def run(
    command: Sequence[str], out_dir: Path, interval: float = 0.5, live: IO[str] | None = None
) -> tuple[int, Path, Peaks]:
    """Run ``command`` to its end while sampling; returns (exit code, CSV path, peaks)."""
    csv_path = out_dir / "monitor.csv"
    try:
        # Its own process group: a terminal's Ctrl-C reaches only us, and we forward it once.
        child = subprocess.Popen(list(command), start_new_session=True)
    except OSError as exc:
        raise CannotStart(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None

    def forward(signum: int, _frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        peaks = sample_to_csv(child.pid, csv_path, lambda: child.poll() is None, interval, live)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        child.wait()
    code = child.returncode
    return (128 - code if code < 0 else code), csv_path, peaks


def _claim_output(out_dir: Path) -> str | None:
    """Create ``out_dir`` and an empty ``monitor.csv`` in it, or say why not. An existing
    ``monitor.csv`` (or a link there) is never replaced."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"--out {out_dir} exists and is not a directory"
    except OSError as exc:
        return f"--out {out_dir}: cannot create it ({exc.strerror or exc})"
    csv_path = out_dir / "monitor.csv"
    try:
        os.close(os.open(csv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except FileExistsError:
        return f"{csv_path} exists; give another --out or move it away"
    except OSError as exc:
        return f"--out {out_dir}: cannot write {csv_path.name} there ({exc.strerror or exc})"
    return None


def _unrunnable(program: str) -> str | None:
    """Why ``program`` cannot be started, if so (looked up on PATH as exec would)."""
    if os.sep not in program:
        found = shutil.which(program)
        return None if found else f"cannot run {program!r}: not found on PATH"
    path = Path(program)
    if not path.exists():
        return f"cannot run {program!r}: no such file"
    if path.is_dir():
        return f"cannot run {program!r}: it is a directory"
    if not os.access(path, os.X_OK):
        return f"cannot run {program!r}: not executable"
    return None


def main(args: argparse.Namespace) -> int:
    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    out_dir = Path(args.out or time.strftime("vllm-xpu-memfix-monitor-%Y%m%d-%H%M%S"))
    if not command:
        print(
            "monitor: give the command to run after --, e.g. "
            "vllm-xpu-memfix monitor -- vllm serve MODEL",
            file=sys.stderr,
        )
        return 2
    # Every check before the command starts: a bad --out must not cost a whole run.
    fresh = not os.path.lexists(out_dir)
    refusal = _unrunnable(command[0]) or _claim_output(out_dir)
    if refusal is not None:
        print(f"monitor: {refusal}; nothing was started", file=sys.stderr)
        return 2
    live = sys.stderr if sys.stderr.isatty() else None
    try:
        code, csv_path, peaks = run(command, out_dir, args.interval, live)
    except CannotStart as exc:
        (out_dir / "monitor.csv").unlink()  # what _claim_output made
        if fresh:
            out_dir.rmdir()
        print(f"monitor: {exc}; nothing was started", file=sys.stderr)
        return 2
    print(f"monitor: {csv_path} ({' '.join(command)} exited with {code})")
    print(peaks.report())
    return code
