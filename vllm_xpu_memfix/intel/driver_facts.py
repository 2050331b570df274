"""What the public record says about Intel's GPU driver, in one place, each fact with its source.

The driver guard (``fixes/driver_env``), the ledger, ``check`` and ``doctor`` read
these facts from here and nowhere else. Two kinds of source stand behind them:

- compute-runtime's own tree (``intel/compute-runtime``): release tags, commits and
  the debug-variable table ``shared/source/debug_settings/debug_variables_base.inl``;
- public threads, named by repository and number.

Where Intel's people say different things, both are kept (:data:`INTEL_POSITIONS`).
Nothing here reads a file or the environment beyond the mapping it is given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_xpu_memfix.core.numbers import shown


@dataclass(frozen=True, order=True)
class Release:
    """A compute-runtime release, as its tag names it (year.week.build.hotfix).

    Builds grow with every release (25.44.36015 < 26.05.37020 < 26.09.37435 < ...),
    so a runtime known only by its build number (the driver file's name) can still be
    placed against a release.
    """

    year: int
    week: int
    build: int
    tag: str = field(compare=False)

    @property
    def name(self) -> str:
        return f"{self.year:02d}.{self.week:02d}"


# --- compute-runtime releases that change what the host pays -------------------------

# "feature: Enable defer backing for bmg" (compute-runtime commit d793c96442, in
# product_helper_bmg.cpp): first in tag 26.09.37435.1, not in 26.05.37020.3. From
# there a peer import's host backing is committed and pinned on Battlemage
# (compute-runtime #953, #980; intel/llvm #22873).
HOST_COPY_FROM = Release(26, 9, 37435, "26.09.37435.1")
# No tag through 26.31.39395.13 (the newest in the source) stops it. 26.35.39758.10 and .11
# are public, but no snapshot holds their source (their BMG default is not read); a comment on
# compute-runtime #953 (2026-09-18) reports a vLLM TP 2 start on 2x B60 with the 26.35.39758.10
# stack running the host out of memory at KV-cache set-up. Set this to the first fixed
# release when one ships.
HOST_COPY_FIXED: Release | None = None
# The compute-runtime maintainer's production route: the last release before defer
# backing (compute-runtime #953, 2026-08-03, as quoted in llm-scaler #618).
PRODUCTION_ROUTE = Release(26, 5, 37020, "26.05.37020.3")
PRODUCTION_ROUTE_CAVEATS = (
    "an older driver: it lacks the fixes and Battlemage support of later releases, it is "
    "in compute-runtime #916's range, so with 2+ GPUs it needs kernel 7.1, and an Intel "
    "image bundles its own compute-runtime, so the image must be rebuilt on it"
)

# The xe kernel bug (compute-runtime #916, "regression from 25.40"): with two Intel
# GPUs in one Level Zero context every device allocation fails with
# UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY, on kernels before 7.1. compute-runtime's
# workaround ("validate peer access with makeResident on imported BO", commit
# e91243a9d0, first in 26.27.39122.10) makes the P2P probe report no P2P there; the
# same change was cherry-picked to the 26.22 release branch (2aa8248b86), present in
# every public 26.22 tag from 26.22.38646.4 on.
XE_PEER_OOM_FROM = Release(25, 44, 36015, "25.44.36015.5")
XE_PEER_OOM_FIXED = Release(26, 22, 38646, "26.22.38646.4")
XE_PEER_OOM_FIXED_ON_MASTER = Release(26, 27, 39122, "26.27.39122.10")
# The kernel side: fixed in Linux v7.1-rc1 (compute-runtime #916). Kernel 7.1 does not
# remove the host copy.
KERNEL_FIXED = (7, 1)

XE_PEER_OOM_THREAD = "compute-runtime #916"
# How a user learns whether the GPUs reach each other (torch 2.13's torch.xpu binds
# zeDeviceCanAccessPeer through ATen's canDeviceAccessPeer); doctor's host file takes the
# answer as [host] p2p.
XE_PEER_OOM_CHECK = (
    "check: python -c 'import torch; print(torch.xpu.can_device_access_peer(0, 1))', "
    "then p2p = true|false in the host file"
)
XE_PEER_OOM_FAILURE = "every device allocation fails with UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"
HOST_COPY_THREADS = "compute-runtime #953, #980; vllm #50269"


# --- the variables that decide it ------------------------------------------------------


@dataclass(frozen=True)
class DriverVariable:
    name: str
    effect: str
    source: str


READ_DEBUG_KEYS = "NEOReadDebugKeys"
DEFER_BACKING = "EnableDeferBacking"
FORCE_PEER_ACCESS = "ForceZeDeviceCanAccessPerReturnValue"

VARIABLES = (
    DriverVariable(
        READ_DEBUG_KEYS,
        "1: compute-runtime reads its debug keys from the environment; without it every "
        "key below it is ignored",
        "compute-runtime shared/source/debug_settings/linux/debug_variables_helper.cpp",
    ),
    DriverVariable(
        DEFER_BACKING,
        "0 (with NEOReadDebugKeys=1): memory is backed when it is created, so the peer "
        "import's host backing is not pinned; P2P stays. Default -1: on for Battlemage",
        "debug_variables_base.inl; compute-runtime #953; vllm #50269",
    ),
    DriverVariable(
        FORCE_PEER_ACCESS,
        "0 (with NEOReadDebugKeys=1): zeDeviceCanAccessPeer answers false, so no peer "
        "residency and no host copy, and no P2P: oneCCL falls back to host-staged "
        "collectives. Also avoids compute-runtime #916's failure",
        "debug_variables_base.inl; compute-runtime #980, #916",
    ),
    DriverVariable(
        "ZE_AFFINITY_MASK",
        "the devices Level Zero shows the process; one device per process has no peer "
        "and no host copy, but vLLM's oneCCL wants every device visible",
        "torch-xpu-ops #5428; vllm #53822, PR #56012",
    ),
    DriverVariable(
        "ONEAPI_DEVICE_SELECTOR",
        "the devices the SYCL runtime uses (level_zero:0,1); same effect as above",
        "torch-xpu-ops #5428; llama.cpp #22116",
    ),
    DriverVariable(
        "ZE_FLAT_DEVICE_HIERARCHY",
        "how multi-tile devices are numbered (FLAT, COMPOSITE, COMBINED); Battlemage "
        "has one tile, so it changes no count here, only what the mask's indices mean",
        "Level Zero specification, device hierarchy",
    ),
    DriverVariable(
        "SYCL_UR_L0_RESTRICT_USM_RESIDENCY_TO_P2P",
        "1: Unified Runtime makes allocations resident only on peers with P2P enabled "
        "(opt-in since intel/llvm PR #22796, after PR #21889 made it the default). Read from "
        "Unified Runtime 2026.2.0 on; 2026.1.x, the line PyTorch 2.14 XPU uses, does not know "
        "it, so there it changes nothing",
        "intel/llvm #21889, #22796; intel-cmplr-lib-ur 2026.1.1, 2026.1.2 and 2026.2.0 on PyPI "
        "(the name is in 2026.2.0's Level Zero adapters only)",
    ),
    DriverVariable(
        "CCL_TOPO_P2P_ACCESS",
        "oneCCL's P2P table, otherwise built from zeDeviceCanAccessPeer: what "
        "collectives use once P2P is reported off",
        "oneCCL topology; compute-runtime #980",
    ),
    DriverVariable(
        "UR_L0_USM_RESIDENT",
        "Unified Runtime's choice of devices a USM allocation is made resident on "
        "(its legacy Level Zero adapter); its effect on the host copy is not established",
        "intel/llvm, Unified Runtime Level Zero adapter",
    ),
)
VARIABLE_NAMES = tuple(v.name for v in VARIABLES)

# What turning P2P off costs (ForceZeDeviceCanAccessPerReturnValue=0): oneCCL builds its
# P2P table from zeDeviceCanAccessPeer (compute-runtime #980); the figure is a community
# measurement, not a vLLM A/B.
# oneCCL uses P2P only where zeDeviceCanAccessPeer is true for every pair (oneCCL's
# topo_manager); llm-scaler's vllm/README.md (section 2.1) gives the only public figure.
NO_PEER_ACCESS_COST = (
    "oneCCL falls back to its USM (host-staged) collectives: llm-scaler's README reports about "
    "15 % more throughput with P2P at large batch; no public vLLM A/B on Battlemage"
)
# What Intel names for #916 (compute-runtime #916, 2026-05-26); no report shows
# EnableDeferBacking=0 helping there.
XE_PEER_OOM_KEY_WORKAROUND = f"{READ_DEBUG_KEYS}=1 {FORCE_PEER_ACCESS}=0"

# --- what Intel's people say (they differ) ---------------------------------------------

INTEL_POSITIONS = (
    "Intel's vLLM engineer recommends NEOReadDebugKeys=1 EnableDeferBacking=0 until the "
    "driver is fixed (vllm #50269)",
    "compute-runtime's maintainer first suggested the same key, then called debug keys "
    "debug-only and named compute-runtime 26.05 as the production route (compute-runtime "
    "#953, quoted in llm-scaler #618)",
)
INTERIM = (
    "Intel's interim workaround (vllm #50269); compute-runtime's maintainer calls debug keys "
    f"debug-only and names compute-runtime {PRODUCTION_ROUTE.name} as the production route "
    "(compute-runtime #953)"
)


# --- reading what was given ------------------------------------------------------------

# What compute-runtime reads as a number (bounded: a longer run of digits is no key value).
_KEY_VALUE = re.compile(r"-?[0-9]{1,18}", re.ASCII)
# A release as tagged (year.week.build.hotfix), or as packaged: dpkg adds a revision after
# -, + or ~ (26.14.37833.4-1~24.04).
_RELEASE = re.compile(
    r"([0-9]{2})\.([0-9]{1,2})(?:\.([0-9]{1,9})(?:\.[0-9]{1,9})?)?(?:[-+~][0-9A-Za-z.+~-]{0,64})?",
    re.ASCII,
)
# A kernel release as uname -r prints it (at most 64 characters: the kernel's
# __NEW_UTS_LEN): major.minor, then any patch level and local version.
_KERNEL = re.compile(r"([0-9]{1,4})\.([0-9]{1,4})(?:[.+~-][0-9A-Za-z.+~_-]*)?", re.ASCII)
KERNEL_RELEASE_MAX = 64


@dataclass(frozen=True)
class DebugKeys:
    """How compute-runtime will read its debug keys from an environment."""

    read: bool
    defer_backing_off: bool
    peer_access_off: bool
    # One line per value the driver would not take, as "NAME=value (accepted: ...)".
    not_understood: tuple[str, ...] = ()
    # The keys that were given a value the driver takes, with that value.
    values: Mapping[str, int] = field(default_factory=dict)

    @property
    def host_copy_prevented_by(self) -> str | None:
        """The user's setting that already keeps the driver from pinning the copy."""
        if self.peer_access_off:
            return f"{READ_DEBUG_KEYS}=1 {FORCE_PEER_ACCESS}=0"
        if self.defer_backing_off:
            return f"{READ_DEBUG_KEYS}=1 {DEFER_BACKING}=0"
        return None


def debug_keys(environ: Mapping[str, str]) -> DebugKeys:
    """Read the three keys as compute-runtime does; a value it would not take is reported
    and then treated as absent. Debug keys count only with ``NEOReadDebugKeys=1``."""
    problems: list[str] = []
    values: dict[str, int | None] = {}
    for name in (READ_DEBUG_KEYS, DEFER_BACKING, FORCE_PEER_ACCESS):
        raw = environ.get(name)
        if raw is None:
            values[name] = None
        elif _KEY_VALUE.fullmatch(raw.strip()):
            values[name] = int(raw.strip())
        else:
            values[name] = None
            problems.append(f"{name}={shown(raw)} (accepted: an integer such as -1, 0 or 1)")
    read = values[READ_DEBUG_KEYS] == 1
    return DebugKeys(
        read=read,
        defer_backing_off=read and values[DEFER_BACKING] == 0,
        peer_access_off=read and values[FORCE_PEER_ACCESS] == 0,
        not_understood=tuple(problems),
        values={name: value for name, value in values.items() if value is not None},
    )


def parse_release(text: str) -> Release | None:
    """``26.14.37833.4``, ``26.14.37833``, ``26.14`` (build then unknown: 0), each perhaps
    with dpkg's revision (``-1~24.04``); None for anything else, a week outside 1 to 53 or
    a build of 0 included."""
    match = _RELEASE.fullmatch(text.strip())
    if not match:
        return None
    year, week, build = match.groups()
    if not 1 <= int(week) <= 53 or (build is not None and int(build) == 0):
        return None
    return Release(int(year), int(week), int(build or 0), text.strip())


def at_least(build: int | None, release_name: tuple[int, int] | None, ref: Release) -> bool:
    """Whether a runtime known by its build number, or else by year.week, is ``ref`` or later."""
    if build:
        return build >= ref.build
    if release_name is not None:
        return release_name >= (ref.year, ref.week)
    raise ValueError("a runtime with neither a build nor a release name")


def parse_kernel(text: str) -> tuple[int, int] | None:
    """(major, minor) of a kernel release such as ``6.14.0-37-generic``; None for text that
    is not one."""
    match = _KERNEL.fullmatch(text.strip())
    if not match or len(text.strip()) > KERNEL_RELEASE_MAX:
        return None
    return int(match.group(1)), int(match.group(2))


def kernel_has_xe_fix(kernel: tuple[int, int]) -> bool:
    return kernel >= KERNEL_FIXED
