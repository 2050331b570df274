"""Intel GPUs and the compute-runtime on this host, read from files only.

Nothing here loads Level Zero or any driver library: process 0 must be able to
decide whether to set driver variables before the driver is started. Every
host path is rooted at a sysroot (``VLLM_XPU_MEMFIX_SYSROOT``), so tests and bug
reports can point it at a recorded tree; only :func:`loaded_driver_libraries`
reads this process's own ``/proc/self/maps``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_xpu_memfix.core import files
from vllm_xpu_memfix.core.numbers import shown
from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.intel import driver_facts as facts

INTEL_VENDOR = 0x8086
HIERARCHY = "ZE_FLAT_DEVICE_HIERARCHY"

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
_PLAIN_RELEASE = re.compile(r"\d+\.\d+(?:\.\d+)?")
# The older level-zero-gpu package: 1.x.BUILD[.hotfix][-revision].
_OLD_PACKAGE_VERSION = re.compile(
    r"1\.[0-9]{1,3}\.([0-9]{1,9})(?:\.[0-9]{1,9})?(?:[-+~][0-9A-Za-z.+~-]{0,64})?", re.ASCII
)
# A runtime known only by the build in its driver file's name (libze_intel_gpu.so.1.14.37435).
_BUILD_ONLY = re.compile(r"build ([0-9]{1,9})", re.ASCII)
_LIB = re.compile(r"libze_intel_gpu\.so\.1\.([0-9]{1,4})\.([0-9]{1,9})", re.ASCII)


@dataclass(frozen=True)
class Gpu:
    """A PCI device, or under ``ZE_FLAT_DEVICE_HIERARCHY`` one tile of it (``tile``).
    ``vram_bytes`` is what this device holds: one tile's, or every tile's of a root device."""

    card: str
    device_id: int
    pci_slot: str
    vram_bytes: int | None
    tiles: int = 1
    tile: int | None = None

    @property
    def integrated(self) -> bool:
        """On the root complex's bus (an iGPU is 0000:00:02.0); a discrete GPU is behind a
        PCIe port, on a bus of its own."""
        return self.pci_slot.split(":")[-2:-1] == ["00"]

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
    """A runtime from its version as written, the one rule for every reader: a release as
    tagged (``26.14.37833.4``, ``26.14``, with dpkg's revision ``-1~24.04``), the older
    package's ``1.x.BUILD``, or ``build N`` (known by the driver file's build only). None
    for anything else, a build of 0 included: it could not be placed against a release."""
    text = text.strip()
    release = facts.parse_release(text)
    if release is not None:
        return Runtime(text, release.build, source, (release.year, release.week))
    build = _OLD_PACKAGE_VERSION.fullmatch(text) or _BUILD_ONLY.fullmatch(text)
    if build is None or int(build.group(1)) == 0:
        return None
    return Runtime(text, int(build.group(1)), source)


def _read(path: Path, cap: int = files.ATTRIBUTE_CAP) -> str | None:
    return files.host_text(path, cap)


_HEX_ID = re.compile(r"(?:0x)?([0-9a-fA-F]{1,4})", re.ASCII)
_BYTES = re.compile(r"[0-9]{1,20}", re.ASCII)


def _pci_id(path: Path) -> int | None:
    """A PCI vendor or device id as the PCI core prints it (``0x8086``); None where the
    file is absent or holds something else (said in one DEBUG line)."""
    text = _read(path)
    if text is None:
        return None
    match = _HEX_ID.fullmatch(text)
    if match is None:
        files.junk(path, text, "a PCI id such as 0x8086")
        return None
    return int(match.group(1), 16)


def _vram_bytes(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    if not _BYTES.fullmatch(text) or int(text) == 0:
        files.junk(path, text, "a byte count")
        return None
    return int(text)


def intel_gpus(sysroot: Path) -> list[Gpu]:
    """Intel display/compute devices under ``/sys/class/drm/card*``, in PCI order. A card
    whose vendor or device file is missing or unreadable is skipped; an unreadable VRAM
    size is unknown."""
    gpus = []
    drm = sysroot / "sys/class/drm"
    try:
        cards = sorted(p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name))
    except OSError:
        return []
    for card in cards:
        vendor = _pci_id(card / "device/vendor")
        device = _pci_id(card / "device/device") if vendor == INTEL_VENDOR else None
        if device is None:
            continue
        slot = (_read(card / "device/uevent") or "").partition("PCI_SLOT_NAME=")[2].split("\n")[0]
        vram = _vram_bytes(card / "device/tile0/physical_vram_size_bytes")
        gpu = Gpu(card.name, device, slot.strip() or card.name, vram)
        gpus.append(gpu if gpu.integrated else replace(gpu, tiles=_tiles(card)))
    return sorted(gpus, key=lambda g: (g.integrated, g.pci_slot))


def _tiles(card: Path) -> int:
    """A card's tiles, counted up from the second (one stat for the usual single tile): xe's
    ``device/tileN``, else i915's ``gt/gtN`` (a two-tile Data Center GPU Max on i915 has
    gt0 and gt1 and no tile directory). compute-runtime names a sub-device's sysfs so:
    ``/device/tileN/`` in ioctl_helper_xe.cpp, ``/gt/gtN/`` in ioctl_helper_i915.cpp. A GPU
    on the root complex's bus (an iGPU, whose i915 gt1 is its media GT) is one tile."""
    if not os.path.isdir(f"{card}/device/tile0") and os.path.isdir(f"{card}/gt/gt0"):
        pattern = f"{card}/gt/gt{{}}"
    else:
        pattern = f"{card}/device/tile{{}}"
    count = 1
    while os.path.isdir(pattern.format(count)):
        count += 1
    return count


def _index(text: str) -> int | None:
    """A device index as Level Zero and SYCL write it (ASCII digits); None for anything else."""
    return int(text) if re.fullmatch(r"[0-9]{1,6}", text, re.ASCII) else None


def _selected_indices(count: int, environ: Mapping[str, str]) -> set[int]:
    """Indices of the GPUs left visible by ``ZE_AFFINITY_MASK`` and ``ONEAPI_DEVICE_SELECTOR``."""
    visible = set(range(count))
    mask = environ.get("ZE_AFFINITY_MASK", "").strip()
    if mask:
        # "0,1" or "0.0,1.1" (sub-devices): the root index is before the dot.
        visible &= {i for p in mask.split(",") if (i := _index(p.split(".")[0])) is not None}
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
                elif _index(head) is not None:
                    chosen.add(int(head))
            (discarded if negate else accepted).update(chosen)
        only_negative = all(t.startswith("!") for t in selector.split(";"))
        visible &= (set(range(count)) if only_negative else accepted) - discarded
    return visible


def _devices(gpus: list[Gpu], environ: Mapping[str, str]) -> list[Gpu]:
    """The devices Level Zero enumerates: every tile under ``ZE_FLAT_DEVICE_HIERARCHY=FLAT``
    (Level Zero's default), else one root device per GPU holding every
    tile's memory; ``ZE_AFFINITY_MASK``'s ``i.j`` narrows a root device to its tile ``j``."""
    hierarchy = environ.get(HIERARCHY, "").strip().upper() or "FLAT"
    if hierarchy == "FLAT":
        return [replace(g, tile=t) if g.tiles > 1 else g for g in gpus for t in range(g.tiles)]
    tiles: dict[int, int] = {}
    for part in environ.get("ZE_AFFINITY_MASK", "").split(","):
        root, dot, sub = part.strip().partition(".")
        if dot and _index(root) is not None and _index(sub) is not None:
            tiles[int(root)] = tiles.get(int(root), 0) + 1
    return [
        replace(g, vram_bytes=g.vram_bytes * tiles.get(i, g.tiles)) if g.vram_bytes else g
        for i, g in enumerate(gpus)
    ]


def visible_gpus(gpus: list[Gpu], environ: Mapping[str, str]) -> list[Gpu]:
    """The devices vLLM's XPU platform will see, in Level Zero's order: discrete GPUs
    before integrated ones, each in PCI order (as :func:`intel_gpus` lists them)."""
    devices = _devices(gpus, environ)
    keep = _selected_indices(len(devices), environ)
    return [device for i, device in enumerate(devices) if i in keep]


def dpkg_versions(sysroot: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """The installed versions of ``packages`` in dpkg's status. Only their stanzas are
    decoded and parsed (found in the bytes): a desktop's status runs to tens of MiB."""
    data = files.host_bytes(sysroot / "var/lib/dpkg/status", files.LIST_CAP) or b""
    versions = {}
    for package in packages:
        key = f"Package: {package}\n".encode()
        start = data.find(key)
        while start != -1:
            end = data.find(b"\n\n", start)
            if start == 0 or data[start - 1] == 0x0A:  # at a line's start
                stanza = data[start : end if end != -1 else len(data)].decode("utf-8", "replace")
                lines = [line for line in stanza.splitlines() if ": " in line and line[0] != " "]
                fields = dict(line.split(": ", 1) for line in lines)
                if "install ok installed" in fields.get("Status", ""):
                    versions[package] = fields.get("Version", "").strip()
            start = data.find(key, start + 1)
    return versions


def compute_runtime(sysroot: Path) -> Runtime | None:
    """The installed compute-runtime, from dpkg's status or the Level Zero driver's file
    name. A version that is not one (:func:`runtime_from_version`), or a year.week without
    its build, is passed over with one DEBUG line."""
    installed = dpkg_versions(sysroot, RUNTIME_PACKAGES)
    status = sysroot / "var/lib/dpkg/status"
    for package in RUNTIME_PACKAGES:
        if package not in installed:
            continue
        version, source = installed[package], f"dpkg: {package}"
        runtime = runtime_from_version(version, source)
        if runtime is not None and runtime.build:
            return runtime
        files.junk(status, version, f"a {package} version with its build")
    for directory in LIBRARY_DIRS:
        try:
            names = sorted(p.name for p in (sysroot / directory).iterdir())
        except OSError:
            continue
        for name in names:
            lib = _LIB.fullmatch(name)
            if lib is None:
                continue
            runtime = runtime_from_version(f"build {lib.group(2)}", f"{directory}/{name}")
            if runtime is not None:
                return runtime
    return None


@dataclass(frozen=True)
class Kernel:
    """The running kernel's release; ``version`` is None where it could not be read or
    parsed, and ``problem`` then says which."""

    release: str | None
    version: tuple[int, int] | None
    problem: str | None = None

    @property
    def distribution_build(self) -> bool:
        """A release with a build suffix (``7.0.0-29-generic``, ``6.12.8+deb13``): its
        maker may have taken in fixes of later releases."""
        return self.release is not None and not _PLAIN_RELEASE.fullmatch(self.release)

    @property
    def has_xe_peer_fix(self) -> bool | None:
        """Whether it carries #916's xe fix: 7.1 or later does; an earlier plain release
        does not; an earlier distribution build may (llm-scaler #618's reporter served TP 2
        with P2P on Ubuntu's 7.0.0-29, compute-runtime #968), so it is not known."""
        if self.version is None:
            return None
        if facts.kernel_has_xe_fix(self.version):
            return True
        return None if self.distribution_build else False


def kernel(sysroot: Path) -> Kernel:
    """The kernel release from ``/proc/sys/kernel/osrelease`` (in a container: the host's)."""
    path = sysroot / "proc/sys/kernel/osrelease"
    text = _read(path)
    if text is None:
        return Kernel(None, None, f"{path} could not be read")
    return kernel_from_release(text)


def kernel_from_release(text: str) -> Kernel:
    """A kernel from its release as uname -r prints it; one that is not a release keeps its
    text (quoted and cut, for one-line messages) and ``problem`` says so."""
    text = text.strip()
    version = facts.parse_kernel(text)
    if version is None:
        return Kernel(shown(text), None, f"kernel release {shown(text)} is not major.minor[...]")
    return Kernel(text, version)


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
    elif running.has_xe_peer_fix is None:
        unknown.append(f"whether distribution kernel {running.release} carries the xe fix")
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
    installed = dpkg_versions(sysroot, LOADER_PACKAGES)
    return next((installed[p] for p in LOADER_PACKAGES if p in installed), None)


def loaded_driver_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Level Zero's Intel GPU driver or loader as mapped into this process, in map order.

    Read from this process's own ``/proc/self/maps``, never through the sysroot: the
    question is what this process has loaded, not what a recorded host has installed.
    The compute-runtime reads its debug keys (``NEOReadDebugKeys``,
    ``EnableDeferBacking``) once, when Level Zero starts it; once it is mapped, a
    variable set now comes too late for this process.
    """
    text = files.host_text(maps, files.LIST_CAP)
    if text is None:
        return []
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.rpartition("/")[2].startswith(DRIVER_LIBRARIES) and path not in found:
            found.append(path)
    return found
