"""Intel GPUs and the compute-runtime on this host, read from files only.

Nothing here loads Level Zero or any driver library: process 0 must be able to
decide whether to set driver variables before the driver is started. Every
host path is rooted at a sysroot (``VLLM_XPU_MEMFIX_SYSROOT``), so tests and bug
reports can point it at a recorded tree; only :func:`loaded_driver_libraries`
reads this process's own ``/proc/self/maps``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.intel import driver_facts as facts

INTEL_VENDOR = 0x8086

RUNTIME_PACKAGES = ("intel-opencl-icd", "libze-intel-gpu1", "intel-level-zero-gpu")
LOADER_PACKAGES = ("libze1", "level-zero")
# Shared objects whose presence in /proc/self/maps means Level Zero has been started.
DRIVER_LIBRARIES = ("libze_intel_gpu", "libze_loader")
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "usr/local/lib",
    "opt/intel/oneapi/redist/lib",
)
_OLD_PACKAGE_VERSION = re.compile(r"1\.\d+\.(\d+)")
_LIB = re.compile(r"libze_intel_gpu\.so\.1\.(\d+)\.(\d+)")


@dataclass(frozen=True)
class Gpu:
    card: str
    device_id: int
    pci_slot: str
    vram_bytes: int | None

    @property
    def family(self) -> str | None:
        return catalog.family(self.device_id)

    @property
    def is_battlemage(self) -> bool:
        return self.family is not None

    @property
    def product(self) -> str:
        return catalog.product(self.device_id)


@dataclass(frozen=True)
class Runtime:
    """compute-runtime version as found: ``build`` is the third field (37435 in
    26.09.37435.1; 0 where only year.week is known), ``release`` the first two (None
    where only the driver file's build number is known)."""

    version: str
    build: int
    source: str
    release: tuple[int, int] | None = None

    def _at_least(self, ref: facts.Release) -> bool:
        return facts.at_least(self.build, self.release, ref)

    @property
    def pins_host_copy(self) -> bool:
        """In the releases whose peer imports pin a host copy (defer backing on BMG)."""
        if not self._at_least(facts.HOST_COPY_FROM):
            return False
        return facts.HOST_COPY_FIXED is None or not self._at_least(facts.HOST_COPY_FIXED)

    @property
    def in_xe_peer_oom_range(self) -> bool:
        """In the releases that meet compute-runtime #916 on kernels before 7.1."""
        return self._at_least(facts.XE_PEER_OOM_FROM) and not self._at_least(
            facts.XE_PEER_OOM_FIXED
        )


def runtime_from_version(text: str, source: str) -> Runtime | None:
    """A runtime from its version as written (``26.14.37833.4``, ``26.14``); None if not one."""
    release = facts.parse_release(text)
    if release is None:
        return None
    return Runtime(text.strip(), release.build, source, (release.year, release.week))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def intel_gpus(sysroot: Path) -> list[Gpu]:
    """Intel display/compute devices under ``/sys/class/drm/card*``, in PCI order."""
    gpus = []
    drm = sysroot / "sys/class/drm"
    try:
        cards = sorted(p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name))
    except OSError:
        return []
    for card in cards:
        vendor, device = _read(card / "device/vendor"), _read(card / "device/device")
        if vendor is None or device is None or int(vendor, 16) != INTEL_VENDOR:
            continue
        slot = (_read(card / "device/uevent") or "").partition("PCI_SLOT_NAME=")[2].split("\n")[0]
        vram = _read(card / "device/tile0/physical_vram_size_bytes")
        gpus.append(Gpu(card.name, int(device, 16), slot or card.name, int(vram) if vram else None))
    return sorted(gpus, key=lambda g: g.pci_slot)


def _selected_indices(count: int, environ: Mapping[str, str]) -> set[int]:
    """Indices of the GPUs left visible by ``ZE_AFFINITY_MASK`` and ``ONEAPI_DEVICE_SELECTOR``."""
    visible = set(range(count))
    mask = environ.get("ZE_AFFINITY_MASK", "").strip()
    if mask:
        # "0,1" or "0.0,1.1" (sub-devices): the root index is before the dot.
        visible &= {int(p.split(".")[0]) for p in mask.split(",") if p.split(".")[0].isdigit()}
    selector = environ.get("ONEAPI_DEVICE_SELECTOR", "").strip()
    if selector:
        accepted: set[int] = set()
        discarded: set[int] = set()
        for term in selector.split(";"):
            negate = term.startswith("!")
            backend, _, devices = term.lstrip("!").partition(":")
            if backend.lower() not in ("level_zero", "*"):
                continue
            chosen: set[int] = set()
            for device in devices.split(","):
                head = device.split(".")[0].strip().lower()
                if head in ("*", "gpu"):
                    chosen |= set(range(count))
                elif head.isdigit():
                    chosen.add(int(head))
            (discarded if negate else accepted).update(chosen)
        only_negative = all(t.startswith("!") for t in selector.split(";"))
        visible &= (set(range(count)) if only_negative else accepted) - discarded
    return visible


def visible_gpus(gpus: list[Gpu], environ: Mapping[str, str]) -> list[Gpu]:
    """The GPUs vLLM will see, in Level Zero's order (PCI order of the Intel devices)."""
    keep = _selected_indices(len(gpus), environ)
    return [gpu for i, gpu in enumerate(gpus) if i in keep]


def _dpkg_versions(sysroot: Path) -> dict[str, str]:
    text = _read(sysroot / "var/lib/dpkg/status") or ""
    versions = {}
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if "install ok installed" in fields.get("Status", "") and "Package" in fields:
            versions[fields["Package"]] = fields.get("Version", "")
    return versions


def compute_runtime(sysroot: Path) -> Runtime | None:
    """The installed compute-runtime, from dpkg's status or the Level Zero driver's file name."""
    installed = _dpkg_versions(sysroot)
    for package in RUNTIME_PACKAGES:
        version, source = installed.get(package, ""), f"dpkg: {package}"
        runtime = runtime_from_version(version, source)
        if runtime is not None and runtime.build:
            return runtime
        # The older level-zero-gpu package is versioned 1.x.BUILD.
        old = _OLD_PACKAGE_VERSION.match(version)
        if old:
            return Runtime(version, int(old.group(1)), source)
    for directory in LIBRARY_DIRS:
        try:
            names = sorted(p.name for p in (sysroot / directory).iterdir())
        except OSError:
            continue
        for name in names:
            lib = _LIB.fullmatch(name)
            if lib:
                return Runtime(f"build {lib.group(2)}", int(lib.group(2)), f"{directory}/{name}")
    return None


@dataclass(frozen=True)
class Kernel:
    """The running kernel's release; ``version`` is None where it could not be read or
    parsed, and ``problem`` then says which."""

    release: str | None
    version: tuple[int, int] | None
    problem: str | None = None

    @property
    def has_xe_peer_fix(self) -> bool | None:
        return None if self.version is None else facts.kernel_has_xe_fix(self.version)


def kernel(sysroot: Path) -> Kernel:
    """The kernel release from ``/proc/sys/kernel/osrelease`` (in a container: the host's)."""
    path = sysroot / "proc/sys/kernel/osrelease"
    text = _read(path)
    if text is None:
        return Kernel(None, None, f"{path} could not be read")
    return kernel_from_release(text)


def kernel_from_release(text: str) -> Kernel:
    # Shown in one-line messages: a release with control characters is shown escaped.
    shown = text if text.isprintable() else ascii(text)
    version = facts.parse_kernel(text)
    if version is None:
        return Kernel(shown, None, f"kernel release {text!r} is not major.minor[...]")
    return Kernel(shown, version)


@dataclass(frozen=True)
class XePeerOom:
    """compute-runtime #916's condition as far as it could be read: 2+ Intel GPUs in one
    context with peer access between them, a runtime in its range, a kernel before 7.1.
    ``unknown`` names the parts that could not be read (the others hold); empty where all
    are known to hold."""

    intel_gpus: int
    runtime: str
    kernel: str
    unknown: tuple[str, ...] = ()

    @property
    def certain(self) -> bool:
        return not self.unknown


PEER_ACCESS_UNKNOWN = "peer access between the GPUs"


def xe_peer_oom(
    intel_gpus: int,
    runtime: Runtime | None,
    running: Kernel | None,
    peer_access_off: bool,
    p2p: bool | None = None,
) -> XePeerOom | None:
    """compute-runtime #916's condition, or None where a part of it is known not to hold:
    fewer than 2 Intel GPUs (any Intel GPU counts: #916 was reported on A770s), no peer
    access (``p2p`` False, or ``zeDeviceCanAccessPeer`` forced false), a runtime outside
    its range, or kernel 7.1 or later. The failure needs the peer imports, so where it is
    not known whether the GPUs reach each other (``p2p`` None), it stays only possible."""
    if intel_gpus < 2 or peer_access_off or p2p is False:
        return None
    if runtime is not None and not runtime.in_xe_peer_oom_range:
        return None
    if running is not None and running.has_xe_peer_fix:
        return None
    unknown = []
    if runtime is None:
        unknown.append("the compute-runtime version")
    if running is None or running.version is None:
        unknown.append("the kernel release")
    if p2p is None:
        unknown.append(PEER_ACCESS_UNKNOWN)
    return XePeerOom(
        intel_gpus,
        runtime.version if runtime else "unknown",
        (running.release if running else None) or "unknown",
        tuple(unknown),
    )


def why_no_host_copy(
    intel: int,
    battlemage: int,
    runtime: Runtime | None,
    keys: facts.DebugKeys,
    where: str = "sysfs",
) -> str | None:
    """Why the driver pins no host copy of device memory here, in one clause; None where
    it may (2+ Battlemage in one context, a runtime in the affected range or unknown, and
    neither key that prevents it). The one statement of the rule: the driver guard, the
    start-up model and doctor all ask it."""
    if intel == 0:
        return f"no Intel GPU visible under {where}; the host copy needs 2 or more Battlemage"
    if intel == 1:
        return "1 Intel GPU visible to this process: no peer, so no host copy"
    if keys.peer_access_off:
        return (
            f"{keys.host_copy_prevented_by} set by the user: zeDeviceCanAccessPeer answers "
            "false, so no peer residency and no host copy (P2P off)"
        )
    if keys.defer_backing_off:
        return (
            f"{keys.host_copy_prevented_by} set by the user: the peer imports' host backing "
            "is not pinned"
        )
    if battlemage < 2:
        return (
            f"{battlemage} Battlemage and {intel - battlemage} other Intel GPU(s) visible: the "
            "host copy is reported only between Battlemage GPUs (defer backing is on for "
            "Battlemage only, compute-runtime d793c96442)"
        )
    if runtime is not None and not runtime.pins_host_copy:
        return (
            f"compute-runtime {runtime.version} is outside the affected range "
            f"(from {facts.HOST_COPY_FROM.tag})"
        )
    return None


def level_zero_loader(sysroot: Path) -> str | None:
    installed = _dpkg_versions(sysroot)
    return next((installed[p] for p in LOADER_PACKAGES if p in installed), None)


def loaded_driver_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Level Zero's Intel GPU driver or loader as mapped into this process, in map order.

    Read from this process's own ``/proc/self/maps``, never through the sysroot: the
    question is what this process has loaded, not what a recorded host has installed.
    The compute-runtime reads its debug keys (``NEOReadDebugKeys``,
    ``EnableDeferBacking``) once, when Level Zero starts it; once it is mapped, a
    variable set now comes too late for this process.
    """
    try:
        text = maps.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.rpartition("/")[2].startswith(DRIVER_LIBRARIES) and path not in found:
            found.append(path)
    return found
