"""Phase-by-phase record of host memory in one vLLM process."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core.causes import DRIVER_HOST_COPY
from vllm_xpu_memfix.core.log import see
from vllm_xpu_memfix.core.process import start_identity
from vllm_xpu_memfix.core.units import GiB, MiB
from vllm_xpu_memfix.memory import ledger_files, snapshot
from vllm_xpu_memfix.memory.attribution import Attribution, HostCopy, attribute
from vllm_xpu_memfix.memory.snapshot import Snapshot

PHASES = (
    "process start",
    "weights loaded",
    "weights processed",
    "KV cache sized",
    "KV cache allocated",
    "warm-up done",
    "ready",
)
# PSS (the process's and the vLLM tree's) is read only at the ends of start-up: the
# kernel walks every mapped page for it, tens of ms per phase on a large worker.
PSS_PHASES = frozenset({PHASES[0], PHASES[-1]})


@dataclass(frozen=True)
class Entry:
    phase: str
    snapshot: Snapshot
    tree_anon_pss: int | None
    cost_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def host_copy_parts(copy: HostCopy) -> list[str]:
    """The driver's committed host copy and the peer imports, as the summary line says them."""
    parts = []
    if copy.committed is not None:
        parts.append(
            f"driver host copy (committed, {copy.counted_by}): {copy.committed / GiB:+,.1f} GiB"
        )
    if copy.peer_imports:
        imports = f"peer imports: {copy.peer_imports / GiB:,.1f} GiB (not host memory by itself"
        parts.append(imports + ("; the host holds no copy)" if copy.imports_without_copy else ")"))
    return parts


def _mib_known(value: int) -> str:
    """A known part in MiB, with a decimal where it is small (a tiny model's weights)."""
    return f"{value / MiB:,.1f}" if value < 10 * MiB else f"{value / MiB:,.0f}"


def prune(directory: Path, older_than_s: float) -> int:
    """Remove the ledger files of ``directory`` not written to for ``older_than_s``; how
    many. One that cannot be removed stays (another user's, in a shared directory)."""
    removed = 0
    cutoff = time.time() - older_than_s
    for path in directory.glob(ledger_files.PATTERN):
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:
            continue
    return removed


class Ledger:
    """Snapshots at start-up phases; each phase is recorded once, in the order it happens.

    ``take(pss)`` snapshots this process; ``tree_anon_pss()`` sums the vLLM tree's PSS.
    """

    def __init__(
        self,
        role: str,
        jsonl_dir: Path | None = None,
        take: Callable[[bool], Snapshot] = snapshot.take_self,
        tree_anon_pss: Callable[[], int | None] | None = None,
    ) -> None:
        self.role = role
        self.rank: int | None = None
        self.entries: list[Entry] = []
        self._take = take
        self._tree_anon_pss = tree_anon_pss
        self.jsonl_path = (
            jsonl_dir / f"ledger-{socket.gethostname()}-{os.getpid()}.jsonl" if jsonl_dir else None
        )
        self.write_error: str | None = None
        # The vLLM start-up this process belongs to: its rows are read apart from another
        # server's that shares the directory.
        self.start = start_identity()

    def has(self, phase: str) -> bool:
        return any(e.phase == phase for e in self.entries)

    def record(self, phase: str, **extra: Any) -> Entry | None:
        """Snapshot ``phase``; a phase already recorded is left as it was (returns ``None``)."""
        if self.has(phase):
            return None
        started = time.perf_counter()
        with_pss = phase in PSS_PHASES
        snap = self._take(with_pss)
        tree_anon_pss = self._vllm_tree_anon_pss() if with_pss else None
        entry = Entry(phase, snap, tree_anon_pss, time.perf_counter() - started, extra)
        self.entries.append(entry)
        self._append_jsonl(entry)
        return entry

    def _vllm_tree_anon_pss(self) -> int | None:
        if self._tree_anon_pss is None:
            from vllm_xpu_memfix.memory.tree import tree_anon_pss  # psutil, only when needed

            self._tree_anon_pss = tree_anon_pss
        return self._tree_anon_pss()

    def _append_jsonl(self, entry: Entry) -> None:
        if self.jsonl_path is None or self.write_error:
            return
        row = {
            "phase": entry.phase,
            "pid": entry.snapshot.pid,
            "role": self.role,
            "rank": self.rank,
            "start": self.start,
            "ts": entry.snapshot.ts,
            **entry.snapshot.as_dict(),
            "tree_anon_pss": entry.tree_anon_pss,
            "ledger_cost_s": entry.cost_s,
            **entry.extra,
        }
        try:
            self.jsonl_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with self.jsonl_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as exc:
            self.write_error = f"cannot write {self.jsonl_path}: {exc}"

    @property
    def cpu_backend(self) -> bool:
        """Whether the worker runs on vLLM's CPU backend (its KV cache lives on the host)."""
        return any(e.extra.get("kv_cache_device") == "cpu" for e in self.entries)

    def known_host_parts(self) -> dict[str, int]:
        """Host memory the ledger knows the owner of, recorded after the first phase: the
        KV cache where it lives in host memory (vLLM's byte figure, once it is allocated)
        and the weights the model holds in host memory."""
        later = {e.phase: e.extra for e in self.entries[1:]}
        known = {}
        kv = later.get("KV cache sized", {})
        if (
            "KV cache allocated" in later
            and self.cpu_backend
            and isinstance(kv.get("kv_cache_bytes"), int)
        ):
            known["KV cache"] = kv["kv_cache_bytes"]
        weights = later.get("weights processed", {}).get("host_weight_bytes")
        if isinstance(weights, int) and weights > 0:
            known["weights"] = weights
        return known

    def attribution(self) -> Attribution | None:
        if len(self.entries) < 2:
            return None
        first, last = self.entries[0], self.entries[-1]
        return attribute(
            first.snapshot,
            last.snapshot,
            first.tree_anon_pss,
            last.tree_anon_pss,
            self.known_host_parts(),
            self.cpu_backend,
        )

    def table(self) -> str:
        """Phase x host figures in MiB: MemAvailable as the drop and the kernel's GPU-held
        memory as the rise since the first phase; ``drm-total-gtt`` as the GTT imports."""
        if not self.entries:
            return ""
        first = self.entries[0].snapshot
        has_drm = any(e.snapshot.drm for e in self.entries)
        has_gpu_count = first.gpu_active is not None
        header = ["phase", "t (s)", "RssAnon", "RssFile", "Pss", "tree anon Pss", "MemAvail drop"]
        if has_gpu_count:
            header += ["GPUActive rise"]
        if has_drm:
            header += ["GTT imports", "VRAM"]
        rows = [header]
        for e in self.entries:
            s = e.snapshot
            row = [
                e.phase,
                f"{s.ts - first.ts:.1f}",
                _mib(s.rss_anon),
                _mib(s.rss_file),
                _mib(s.pss),
                _mib(e.tree_anon_pss),
                _mib(_minus(first.available, s.available)),
            ]
            if has_gpu_count:
                row += [_mib(_minus(s.gpu_active, first.gpu_active))]
            if has_drm:
                row += [_mib(s.drm.total_gtt if s.drm else None)]
                row += [_mib(s.drm.total_vram if s.drm else None)]
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
        return "\n".join(lines)

    def summary_lines(self) -> list[str]:
        """The attribution as the ledger logs it, one record each: the growth by kind, the
        driver's host copy and peer imports where there are any, and the likely cause."""
        a = self.attribution()
        if a is None:
            return ["attribution: not enough phases recorded"]
        anon = f"anon {a.anon / MiB:+,.0f} MiB"
        if a.known:
            owners = ", ".join(f"{name} {_mib_known(size)} MiB" for name, size in a.known.items())
            anon += f" (known: {owners}; unexplained {a.unexplained_anon / MiB:+,.0f} MiB)"
        parts = [
            anon,
            f"file {a.file / MiB:+,.0f} MiB",
            f"page cache {a.page_cache / MiB:+,.0f} MiB",
        ]
        if a.outside_processes is not None:
            parts.append(f"outside any process {a.outside_processes / MiB:+,.0f} MiB")
        since = self.entries[0].phase
        lines = [f"attribution since {since}: {', '.join(parts)}"]
        if copy := host_copy_parts(a.host_copy):
            lines.append(", ".join(copy))
        pointer = f" ({see(DRIVER_HOST_COPY)})" if a.cause == "outside" else ""
        return [*lines, f"likely cause: {a.explanation}{pointer}"]
