"""This machine as ``report`` gives it: files under the sysroot (``VLLM_XPU_MEMFIX_SYSROOT``),
read through the bounded readers, and Python packages' metadata; nothing is imported or
run. Each fact is a (name, value) row; one that cannot be read says so."""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from vllm_xpu_memfix.core import files
from vllm_xpu_memfix.core.units import GiB

# Intel's graphics compiler and oneAPI's DPC++ runtime, as Ubuntu's and Intel's repositories
# name their packages (the compute-runtime and the loader are intel.driver's).
COMPILER_PACKAGES = (
    "intel-igc-core-2",
    "intel-igc-core",
    "libigc2",
    "libigc1",
    "intel-oneapi-runtime-dpcpp-cpp",
    "intel-oneapi-compiler-dpcpp-cpp-runtime",
    "intel-oneapi-compiler-dpcpp-cpp",
)
ONEAPI_COMPILERS = "opt/intel/oneapi/compiler"  # one directory per installed version
XPU_PACKAGES = (
    "torch",
    "intel-extension-for-pytorch",
    "pytorch-triton-xpu",
    "triton",
    "vllm-xpu-kernels",
    "oneccl_bind_pt",
    "intel-sycl-rt",
    "intel-cmplr-lib-rt",
    "intel-cmplr-lib-ur",
    "intel-opencl-rt",
    "dpcpp-cpp-rt",
    "intel-pti",
    "umf",
)
PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins")
THIS_PLUGIN = "vllm_xpu_memfix"
KERNEL_LOGS = ("var/log/kern.log", "var/log/messages", "var/log/syslog")
KERNEL_LOG_TAIL = 4 * 2**20  # bytes read from the end of a kernel log
OOM_KILLED = "Out of memory: Killed process"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:,.1f}"


def _text(path: Path) -> str | None:
    return files.host_text(path, files.ATTRIBUTE_CAP)


def operating_system(sysroot: Path) -> str:
    """``PRETTY_NAME`` of os-release (inside a container: the container's)."""
    for name in ("etc/os-release", "usr/lib/os-release"):
        for line in (_text(sysroot / name) or "").splitlines():
            key, _, value = line.partition("=")
            if key == "PRETTY_NAME":
                return value.strip().strip("\"'")
    return "unknown (no os-release)"


def cpu(sysroot: Path) -> str:
    text = files.host_text(sysroot / "proc/cpuinfo", files.LIST_CAP) or ""
    models = [
        line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")
    ]
    return f"{models[0]}, {len(models)} logical CPUs" if models else "unknown (no /proc/cpuinfo)"


def swap(sysroot: Path) -> str:
    from vllm_xpu_memfix.memory.snapshot import ProcReader

    info = ProcReader(sysroot).meminfo()
    total, free = info.get("SwapTotal"), info.get("SwapFree")
    if total is None:
        return "unknown"
    return "none" if total == 0 else f"{_gib(total)} GiB, {_gib(free)} GiB free"


def compilers(sysroot: Path) -> str:
    from vllm_xpu_memfix.intel import driver

    found = [f"{p} {v}" for p, v in driver.dpkg_versions(sysroot, COMPILER_PACKAGES).items()]
    try:
        versions = sorted(
            p.name for p in (sysroot / ONEAPI_COMPILERS).iterdir() if p.name != "latest"
        )
    except OSError:
        versions = []
    if versions:
        found.append(f"oneAPI compiler {', '.join(versions)} (/{ONEAPI_COMPILERS})")
    return "; ".join(found) or "none found (dpkg, /opt/intel/oneapi)"


def distribution(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def xpu_packages() -> str:
    found = [(n, distribution(n)) for n in XPU_PACKAGES]
    return ", ".join(f"{n} {v}" for n, v in found if v) or "none installed"


def other_plugins() -> str:
    """vLLM plugins besides this one: they patch vLLM too."""
    found = []
    for group in PLUGIN_GROUPS:
        for entry in metadata.entry_points(group=group):
            if entry.value.split(":", 1)[0].split(".", 1)[0] == THIS_PLUGIN:
                continue
            dist = getattr(entry, "dist", None)
            owner = f"{dist.name} {dist.version}" if dist is not None else "?"
            found.append(f"{entry.name} ({group.rsplit('.', 1)[1]}: {entry.value}, {owner})")
    return "; ".join(sorted(found)) or "none"


def allocator(environ: Mapping[str, str]) -> str:
    """What the processes will allocate with: a preloaded tcmalloc or jemalloc, else glibc,
    and which allocator variables are set (their values are in the environment block)."""
    from vllm_xpu_memfix.cli.report import environment

    preload = environ.get("LD_PRELOAD", "")
    which = next((a for a in ("tcmalloc", "jemalloc") if a in preload), "glibc malloc")
    named = sorted(n for n in environ if environment.allocator_setting(n) and n != "LD_PRELOAD")
    return f"{which}{' (LD_PRELOAD)' if which != 'glibc malloc' else ''}; " + (
        f"set: {', '.join(named)}" if named else "no allocator variable set"
    )


def oom_kills(sysroot: Path) -> str:
    """The kernel's OOM-kill counts (since boot; the container's cgroup) and its last kill
    lines in a kernel log this user can read."""
    from vllm_xpu_memfix.memory.snapshot import ProcReader

    parts = []
    count = ProcReader(sysroot).vmstat().get("oom_kill")
    parts.append(f"oom_kill {count} since boot" if count is not None else "no oom_kill count")
    for line in (_text(sysroot / "sys/fs/cgroup/memory.events") or "").splitlines():
        if line.startswith("oom_kill "):
            parts.append(f"cgroup {line}")
    killed = kernel_log_kills(sysroot)
    if killed:
        parts.append(f"last in the kernel log: {killed[-1]}")
    return "; ".join(parts)


def kernel_log_kills(sysroot: Path) -> list[str]:
    """The OOM killer's lines in the end of the first kernel log readable here."""
    for name in KERNEL_LOGS:
        text = tail(sysroot / name, KERNEL_LOG_TAIL)
        if text is not None:
            return [
                line.split("kernel: ", 1)[-1] for line in text.splitlines() if OOM_KILLED in line
            ]
    return []


def tail(path: Path, size: int) -> str | None:
    """The last ``size`` bytes of a regular file, decoded; None where it cannot be read."""
    try:
        fd = files.open_regular(path)
    except OSError:
        return None
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, max(0, end - size), os.SEEK_SET)
        return os.read(fd, size).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def machine_rows(sysroot: Path, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    from vllm_xpu_memfix.intel import driver
    from vllm_xpu_memfix.startup import host

    facts = host.read(sysroot, environ)
    gpus = "none found in sysfs"
    if facts.gpus:
        kinds = sorted({f"{g.product} (0x{g.device_id:04x})" for g in facts.gpus})
        size, source = host.device_bytes(facts.gpus, None)
        memory = f", {_gib(size)} GiB each ({source})" if size else ""
        gpus = f"{len(facts.gpus)}x {', '.join(kinds)}{memory}; {len(facts.visible)} visible"
    runtime = facts.runtime
    kernel = facts.kernel
    snap = facts.snap
    return [
        ("GPUs", gpus),
        ("compute-runtime", f"{runtime.version} ({runtime.source})" if runtime else "not found"),
        ("Level Zero loader", driver.level_zero_loader(sysroot) or "not found"),
        ("kernel", (kernel.release or kernel.problem or "unknown") if kernel else "unknown"),
        ("image", image(sysroot, environ)),
        ("host memory", f"MemTotal {_gib(snap.mem_total)} GiB; {facts.room.describe(GiB)}"),
    ]


def image(sysroot: Path, environ: Mapping[str, str]) -> str:
    """What tells the image: a container's marker file and the variable every llm-scaler
    vLLM image sets (``catalog.Q40_LIB``); the image's tag is recorded nowhere inside it."""
    from vllm_xpu_memfix.intel import catalog

    marker = next(
        (m for m in ("/.dockerenv", "/run/.containerenv") if (sysroot / m[1:]).exists()), None
    )
    where = f"in a container ({marker})" if marker else "no container marker"
    lib = environ.get(catalog.Q40_LIB)
    scaler = (
        f"{catalog.Q40_LIB}={lib} (set by llm-scaler images)" if lib else "no llm-scaler variable"
    )
    return f"{where}; {scaler}; give the tag (intel/llm-scaler-vllm:...)"
