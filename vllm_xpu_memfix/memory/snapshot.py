"""Host-memory facts of one process and of the system, read from the kernel.

Every figure is in bytes, or ``None`` where the kernel does not offer it (an
older kernel, a file we may not read, no DRM client). Nothing here raises on a
missing or unreadable file. All paths are rooted at ``root`` so tests and bug
reports can point the reader at a recorded tree.

As psutil tells ``NoSuchProcess`` from ``AccessDenied``, a snapshot tells a
process that is gone (``gone``) from one whose files the kernel refuses to us
(``denied``: ``hidepid``, or another user's process).

Sources:

- ``/proc/<pid>/status``: RssAnon, RssFile, RssShmem, VmHWM, VmSwap
- ``/proc/<pid>/smaps_rollup``: Pss, Pss_Anon, Pss_File
- ``/proc/meminfo``: MemTotal, MemFree, MemAvailable, Cached, Committed_AS, SwapTotal,
  SwapFree, and ``GPUActive`` where the kernel has it (Linux 7.1 on; a kernel commit after
  v7.0-rc7, docs/research/intel-images-and-driver.md)
- ``/proc/vmstat``: ``nr_gpu_active`` (pages), where the kernel has it: the same count as
  ``GPUActive`` (system memory the GPU drivers hold for their objects), read where
  meminfo lacks it
- the memory cgroup of the process, v2 (``memory.current``/``memory.max``) or v1
- ``/proc/<pid>/fdinfo/*``: DRM client usage stats (``drm-total-gtt``, ...), as
  documented in the kernel's ``Documentation/gpu/drm-usage-stats.rst`` and
  printed by Intel's xe and i915 drivers
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_xpu_memfix.core import files
from vllm_xpu_memfix.core.numbers import shown

_UNITS = {"": 1, "b": 1, "kb": 1024, "kib": 1024, "mb": 1024**2, "mib": 1024**2, "gib": 1024**3}
# cgroup v1 reports "no limit" as a page-aligned LONG_MAX.
_V1_UNLIMITED = 1 << 62
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# The lines of /proc/<pid>/status a snapshot keeps.
STATUS_KEYS = frozenset({"RssAnon", "RssFile", "RssShmem", "VmHWM", "VmSwap"})
_DIGITS = re.compile(r"[0-9]{1,20}", re.ASCII)


def _count(text: str) -> int | None:
    """A plain count of up to 20 ASCII digits (``2**64`` has 20); None for anything else."""
    return int(text) if _DIGITS.fullmatch(text) else None


def parse_size(text: str) -> int | None:
    """``"1234 kB"`` -> 1263616; ``"12 MiB"``; a bare number is bytes. ``None`` if unparsable."""
    parts = text.split()
    count = _count(parts[0]) if parts else None
    if count is None:
        return None
    unit = parts[1].lower() if len(parts) > 1 else ""
    factor = _UNITS.get(unit)
    return None if factor is None else count * factor


def parse_key_sizes(text: str, keys: Collection[str] | None = None) -> dict[str, int]:
    """``Key:   value [unit]`` lines (status, smaps_rollup, meminfo) -> bytes per key; only
    ``keys`` where given (a sampler reading many processes parses what it keeps)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        key = key.strip()
        if not sep or (keys is not None and key not in keys):
            continue
        size = parse_size(rest)
        if size is not None:
            values[key] = size
    return values


def parse_vmstat(text: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        count = _count(parts[1]) if len(parts) == 2 else None
        if count is not None:
            values[parts[0]] = count
    return values


@dataclass(frozen=True)
class DrmUsage:
    """DRM client memory of one process, summed over its distinct DRM clients."""

    drivers: tuple[str, ...]
    clients: int
    # The GPUs the process has clients on (distinct ``drm-pdev``; clients where no pdev).
    cards: int = 1
    total_gtt: int = 0
    total_vram: int = 0
    total_system: int = 0
    resident: int = 0


def parse_drm_fdinfo(texts: Iterator[str] | list[str]) -> DrmUsage | None:
    """Sum DRM memory keys over fdinfo texts, counting each ``drm-client-id`` once.

    Several fds can share one DRM client (dup, fork); the client id is the key
    the kernel documents for avoiding double counting.
    """
    seen: set[tuple[str, str]] = set()
    cards: set[str] = set()
    drivers: list[str] = []
    totals = {"gtt": 0, "vram": 0, "system": 0, "resident": 0}
    for text in texts:
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.startswith("drm-"):
                fields[key.strip()] = value.strip()
        driver = fields.get("drm-driver")
        if driver is None:
            continue
        client = (driver, fields.get("drm-client-id", f"anon-{len(seen)}"))
        if client in seen:
            continue
        seen.add(client)
        cards.add(fields.get("drm-pdev") or ":".join(client))
        if driver not in drivers:
            drivers.append(driver)
        for key, value in fields.items():
            size = parse_size(value)
            if size is None:
                continue
            if key == "drm-total-gtt":
                totals["gtt"] += size
            elif key.startswith(("drm-total-vram", "drm-total-local")):
                totals["vram"] += size
            elif key.startswith("drm-total-system"):
                totals["system"] += size
            elif key.startswith("drm-resident-"):
                totals["resident"] += size
    if not seen:
        return None
    return DrmUsage(
        drivers=tuple(drivers),
        clients=len(seen),
        cards=len(cards),
        total_gtt=totals["gtt"],
        total_vram=totals["vram"],
        total_system=totals["system"],
        resident=totals["resident"],
    )


def anon_pss(pss_anon: int | None, pss_shmem: int | None) -> int | None:
    """PSS of anonymous and shared-memory pages: what MemAvailable cannot reclaim.

    File pages are left out: they are page cache, which MemAvailable counts as
    available. ``None`` when the kernel gives no ``Pss_Anon``.
    """
    return None if pss_anon is None else pss_anon + (pss_shmem or 0)


@dataclass(frozen=True)
class CgroupMemory:
    """A process's memory cgroup: bytes used, the limit (None: unlimited or no memory
    cgroup), and why a file of it could not be used (then neither figure is trusted)."""

    usage: int | None = None
    limit: int | None = None
    problem: str | None = None

    @property
    def room(self) -> int | None:
        """What the cgroup may still charge before its limit; None without a limit."""
        if self.limit is None or self.usage is None or self.problem:
            return None
        return self.limit - self.usage


@dataclass(frozen=True)
class Snapshot:
    ts: float
    pid: int
    rss_anon: int | None = None
    rss_file: int | None = None
    rss_shmem: int | None = None
    vm_hwm: int | None = None
    vm_swap: int | None = None
    pss: int | None = None
    pss_anon: int | None = None
    pss_file: int | None = None
    pss_shmem: int | None = None
    mem_total: int | None = None
    mem_free: int | None = None
    mem_available: int | None = None
    cached: int | None = None
    committed_as: int | None = None
    swap_total: int | None = None
    swap_free: int | None = None
    cgroup_current: int | None = None
    cgroup_max: int | None = None
    # System memory the GPU drivers hold (GPUActive, else nr_gpu_active), system-wide.
    gpu_active: int | None = None
    drm: DrmUsage | None = field(default=None)
    # The process exited (or never was) before its files could be read.
    gone: bool = False
    # Its /proc files the kernel refused to us (EACCES/EPERM), e.g. ("status", "smaps_rollup").
    denied: tuple[str, ...] = ()

    @property
    def anon_pss(self) -> int | None:
        """Anonymous + shmem PSS (see :func:`anon_pss`); ``None`` without ``pss=True``."""
        return anon_pss(self.pss_anon, self.pss_shmem)

    @property
    def available(self) -> int | None:
        """MemAvailable; on a kernel without it (before 3.14), MemFree + Cached, as ``free``
        counted page cache as available then."""
        if self.mem_available is not None:
            return self.mem_available
        return None if self.mem_free is None else self.mem_free + (self.cached or 0)

    def as_dict(self) -> dict[str, object]:
        """Flat mapping of the figures for JSON and CSV: DRM figures become ``drm_*`` keys;
        ``gone`` and ``denied`` are left out."""
        flat = {k: v for k, v in asdict(self).items() if k not in ("drm", "gone", "denied")}
        drm = self.drm
        flat["drm_driver"] = ",".join(drm.drivers) if drm else None
        for name in ("cards", "total_gtt", "total_vram", "total_system", "resident"):
            flat[f"drm_{name}"] = getattr(drm, name) if drm else None
        return flat


def gpu_active(meminfo: Mapping[str, int], vmstat_text: str | None) -> int | None:
    """Bytes of system memory the GPU drivers hold: meminfo's ``GPUActive``, else vmstat's
    ``nr_gpu_active`` pages; ``None`` on a kernel with neither."""
    if "GPUActive" in meminfo:
        return meminfo["GPUActive"]
    counted = vmstat_text is not None and "nr_gpu_active" in vmstat_text
    pages = parse_vmstat(vmstat_text or "").get("nr_gpu_active") if counted else None
    return None if pages is None else pages * PAGE_SIZE


def _exited(status: str) -> bool:
    """A zombie (``Z``) or dead (``X``) process has exited; its memory is released."""
    for line in status.splitlines():
        if line.startswith("State:"):
            return line.split(":", 1)[1].strip()[:1] in ("Z", "X")
    return False


def _under_the_mount(path: str) -> list[str]:
    """Where the cgroup ``path`` of /proc/<pid>/cgroup may be under the cgroup mount: the
    whole path (the host's view), then each shorter tail down to the mount's root. Inside a
    container without a private cgroup namespace the path is the host's
    (``/system.slice/docker-<id>.scope``) while the mount's root is that cgroup itself."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[i:]) for i in range(len(parts) + 1)]


class ProcessFiles:
    """The files of one process under ``/proc``, with why a read failed.

    A read the kernel refuses (EACCES, EPERM) is noted in ``denied``. ESRCH, a failed
    read once ``/proc/<pid>`` is gone, or a zombie's status sets ``gone``, after which
    nothing more is read. Any other failure (a file this kernel lacks) leaves only
    that figure unknown.
    """

    def __init__(self, reader: ProcReader, pid: str) -> None:
        self.reader = reader
        self.pid = pid
        self.directory = reader.root / "proc" / pid
        self.gone = False
        self.denied: list[str] = []

    def _failed(self, name: str, error: OSError) -> None:
        if error.errno in (errno.EACCES, errno.EPERM):
            self.denied.append(name)
        elif error.errno == errno.ESRCH or not (self.pid == "self" or self.directory.is_dir()):
            self.gone = True

    def read(self, name: str) -> str | None:
        if self.gone:
            return None
        try:
            text = self.reader.read_text(self.directory / name)
        except OSError as error:
            self._failed(name, error)
            return None
        if name == "status" and _exited(text):
            self.gone = True
            return None
        return text

    def entries(self, name: str) -> list[Path]:
        if self.gone:
            return []
        try:
            return self.reader.list_dir(self.directory / name)
        except OSError as error:
            self._failed(name, error)
            return []


class ProcReader:
    """Reads kernel files under ``root`` (``/`` on a live system)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def read_text(self, path: Path) -> str:
        """Every file is read here, by the one rule for files the plugin did not write
        (``core.files``: regular files only, at most ``LIST_CAP``); raises ``OSError`` as
        the kernel answers, or for a file that breaks the rule."""
        return files.read_text(path, files.LIST_CAP)

    def list_dir(self, path: Path) -> list[Path]:
        return [Path(entry.path) for entry in os.scandir(path)]

    def _read(self, *parts: str) -> str | None:
        try:
            return self.read_text(self.root.joinpath(*parts))
        except OSError:
            return None

    def _keys(self, *parts: str) -> Mapping[str, int]:
        text = self._read(*parts)
        return parse_key_sizes(text) if text is not None else {}

    def meminfo(self) -> Mapping[str, int]:
        """``/proc/meminfo`` in bytes per key; empty where it cannot be read."""
        return self._keys("proc", "meminfo")

    def vmstat(self) -> dict[str, int]:
        """``/proc/vmstat`` (counters, e.g. ``oom_kill``); empty where it cannot be read."""
        text = self._read("proc", "vmstat")
        return parse_vmstat(text) if text is not None else {}

    def cgroup_memory(self, pid: int | str = "self") -> CgroupMemory:
        """The usage and limit of a process's memory cgroup, v2 or v1."""
        return self._cgroup_memory(ProcessFiles(self, str(pid)))

    def _cgroup_memory(self, files: ProcessFiles) -> CgroupMemory:
        text = files.read("cgroup")
        if text is None and "cgroup" in files.denied:
            return CgroupMemory(problem=f"{files.directory / 'cgroup'}: permission denied")
        for line in (text or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                return CgroupMemory(problem=f"{files.directory / 'cgroup'}: {shown(line)}")
            _, controllers, path = parts
            bases: tuple[str, ...]
            if controllers == "":
                bases = ("sys/fs/cgroup", "sys/fs/cgroup/unified")
                names = ("memory.current", "memory.max")
            elif "memory" in controllers.split(","):
                bases, names = (
                    ("sys/fs/cgroup/memory",),
                    ("memory.usage_in_bytes", "memory.limit_in_bytes"),
                )
            else:
                continue
            for base in bases:
                for directory in _under_the_mount(path):
                    found = self._cgroup_files(base, directory, *names)
                    if found is not None:
                        return found
        return CgroupMemory()

    def _cgroup_files(self, base: str, rel: str, usage: str, limit: str) -> CgroupMemory | None:
        """The cgroup at ``base/rel``, None where it has no ``usage`` file. An unlimited
        limit (v2 ``max``, v1's page-aligned LONG_MAX) is None; a file that is unreadable
        or holds no number sets ``problem``."""
        usage_path = self.root.joinpath(base, rel, usage)
        try:
            usage_text = self.read_text(usage_path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return CgroupMemory(problem=f"{usage_path}: {exc.strerror or exc}")
        limit_path = self.root.joinpath(base, rel, limit)
        try:
            limit_text = self.read_text(limit_path).strip()
        except OSError as exc:
            return CgroupMemory(problem=f"{limit_path}: {exc.strerror or exc}")
        used = _count(usage_text.strip())
        if used is None:
            return CgroupMemory(
                problem=f"{usage_path} holds {shown(usage_text.strip())}, not a byte count"
            )
        if limit_text == "max":
            return CgroupMemory(used, None)
        bound = _count(limit_text)
        if bound is None:
            return CgroupMemory(
                used, problem=f"{limit_path} holds {shown(limit_text)}, not a byte count"
            )
        return CgroupMemory(used, None if bound >= _V1_UNLIMITED else bound)

    def drm_usage(self, pid: str) -> DrmUsage | None:
        return self._drm_usage(ProcessFiles(self, pid))

    def _drm_usage(self, files: ProcessFiles) -> DrmUsage | None:
        entries = files.entries("fdinfo")

        def texts() -> Iterator[str]:
            for entry in entries:
                try:
                    text = self.read_text(entry)
                except OSError:
                    continue
                if "drm-driver" in text:
                    yield text

        return parse_drm_fdinfo(texts())

    def process_anon_pss(self, pid: str) -> int | None:
        """:func:`anon_pss` of one process, reading only its ``smaps_rollup``."""
        rollup = self._keys("proc", pid, "smaps_rollup")
        return anon_pss(rollup.get("Pss_Anon"), rollup.get("Pss_Shmem"))

    def take(self, pid: int | str = "self", pss: bool = True, system: bool = True) -> Snapshot:
        """Read every figure; ``pss=False`` skips ``smaps_rollup``, whose cost grows with RSS
        (about 10 ms per GiB mapped), leaving the Pss fields ``None``; ``system=False`` skips
        the system's and the cgroup's figures (a sampler of many processes reads them once)."""
        pid_s = str(pid)
        files = ProcessFiles(self, pid_s)
        status_text = files.read("status")
        status = parse_key_sizes(status_text, STATUS_KEYS) if status_text is not None else {}
        rollup_text = files.read("smaps_rollup") if pss else None
        rollup = parse_key_sizes(rollup_text) if rollup_text is not None else {}
        cgroup = self._cgroup_memory(files) if system else CgroupMemory()
        drm = self._drm_usage(files)
        meminfo = self.meminfo() if system else {}
        return Snapshot(
            ts=time.time(),
            pid=os.getpid() if pid_s == "self" else int(pid_s),
            rss_anon=status.get("RssAnon"),
            rss_file=status.get("RssFile"),
            rss_shmem=status.get("RssShmem"),
            vm_hwm=status.get("VmHWM"),
            vm_swap=status.get("VmSwap"),
            pss=rollup.get("Pss"),
            pss_anon=rollup.get("Pss_Anon"),
            pss_file=rollup.get("Pss_File"),
            pss_shmem=rollup.get("Pss_Shmem"),
            mem_total=meminfo.get("MemTotal"),
            mem_free=meminfo.get("MemFree"),
            mem_available=meminfo.get("MemAvailable"),
            cached=meminfo.get("Cached"),
            committed_as=meminfo.get("Committed_AS"),
            swap_total=meminfo.get("SwapTotal"),
            swap_free=meminfo.get("SwapFree"),
            cgroup_current=cgroup.usage,
            cgroup_max=cgroup.limit,
            gpu_active=gpu_active(meminfo, self._read("proc", "vmstat")) if system else None,
            drm=drm,
            gone=files.gone,
            denied=tuple(files.denied),
        )


LIVE = ProcReader("/")


def take_self(pss: bool = True) -> Snapshot:
    return LIVE.take("self", pss)


def take(pid: int | str = "self", pss: bool = True) -> Snapshot:
    """Snapshot of a live process (default: this one) and of the system."""
    return LIVE.take(pid, pss)
