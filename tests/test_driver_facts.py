"""The driver facts, held to compute-runtime's real release tags and debug-variable table.

The tags below are compute-runtime's own (``git tag`` of intel/compute-runtime, through
26.31.39395.13), and the containment of each commit was read with ``git tag --contains``:
d793c96442 ("Enable defer backing for bmg") first in 26.09.37435.1; 2aa8248b86 (the
26.22 cherry-pick of e91243a9d0, "validate peer access with makeResident on imported
BO", compute-runtime #916) in 26.22.38646.4 and later; e91243a9d0 first in 26.27.39122.10.
"""

from __future__ import annotations

import pytest

from vllm_xpu_memfix.intel import driver
from vllm_xpu_memfix.intel import driver_facts as facts

# Every public tag from 25.40 to 26.31, in release order (compute-runtime's git tags).
TAGS = [
    "25.40.35563.10",
    "25.44.36015.5",
    "25.44.36015.8",
    "25.48.36300.8",
    "26.01.36711.4",
    "26.05.37020.3",
    "26.09.37435.1",
    "26.09.37435.12",
    "26.14.37833.4",
    "26.18.38308.1",
    "26.18.38308.4",
    "26.22.38646.4",
    "26.22.38646.7",
    "26.27.39122.10",
    "26.27.39122.14",
    "26.31.39395.13",
]
PINS_HOST_COPY = {t for t in TAGS if t >= "26.09"}  # d793c96442 is in every tag from 26.09
XE_PEER_OOM = {t for t in TAGS if "25.44" <= t < "26.22"}  # #916's fix is in every 26.22 tag


def test_builds_grow_with_releases_so_a_bare_build_number_can_be_placed():
    releases = [facts.parse_release(t) for t in TAGS]
    assert all(r is not None for r in releases)
    builds = [r.build for r in releases if r]
    assert builds == sorted(builds)


@pytest.mark.parametrize("tag", TAGS)
def test_each_release_is_placed_by_its_full_version_by_year_week_and_by_build_alone(tag):
    full = driver.runtime_from_version(tag, "test")
    year_week = driver.runtime_from_version(tag.rsplit(".", 2)[0], "test")
    build_only = driver.Runtime(f"build {tag.split('.')[2]}", int(tag.split(".")[2]), "lib")
    for runtime in (full, year_week, build_only):
        assert runtime is not None
        assert runtime.pins_host_copy is (tag in PINS_HOST_COPY), runtime
        assert runtime.in_xe_peer_oom_range is (tag in XE_PEER_OOM), runtime


def test_the_production_route_is_the_last_release_without_the_host_copy():
    route = driver.runtime_from_version(facts.PRODUCTION_ROUTE.tag, "facts")
    assert route is not None and not route.pins_host_copy
    later = [t for t in TAGS if t > facts.PRODUCTION_ROUTE.tag]
    assert later and driver.runtime_from_version(later[0], "t").pins_host_copy  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "environ, read, defer_off, peer_off, prevented",
    [
        ({}, False, False, False, None),
        ({"EnableDeferBacking": "0"}, False, False, False, None),  # ignored without the gate
        ({"NEOReadDebugKeys": "1"}, True, False, False, None),
        ({"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}, True, True, False, "Defer"),
        ({"NEOReadDebugKeys": "1", "EnableDeferBacking": "1"}, True, False, False, None),
        (
            {"NEOReadDebugKeys": "1", "ForceZeDeviceCanAccessPerReturnValue": "0"},
            True,
            False,
            True,
            "ForceZe",
        ),
        ({"NEOReadDebugKeys": " 1 ", "EnableDeferBacking": " 0"}, True, True, False, "Defer"),
    ],
)
def test_debug_keys_count_only_behind_neo_read_debug_keys(
    environ, read, defer_off, peer_off, prevented
):
    keys = facts.debug_keys(environ)
    assert (keys.read, keys.defer_backing_off, keys.peer_access_off) == (read, defer_off, peer_off)
    assert keys.not_understood == ()
    if prevented is None:
        assert keys.host_copy_prevented_by is None
    else:
        assert prevented in (keys.host_copy_prevented_by or "")


@pytest.mark.parametrize(
    "name, value",
    [
        ("ForceZeDeviceCanAccessPerReturnValue", "maybe"),
        ("EnableDeferBacking", "off"),
        ("NEOReadDebugKeys", "yes"),
    ],
)
def test_a_value_the_driver_would_not_take_is_named_and_treated_as_absent(name, value):
    environ = {"NEOReadDebugKeys": "1", name: value}
    keys = facts.debug_keys(environ)
    assert len(keys.not_understood) == 1
    assert keys.not_understood[0].startswith(f"{name}={value!r}")
    assert not keys.peer_access_off and not keys.defer_backing_off
    assert keys.read is (name != "NEOReadDebugKeys")


@pytest.mark.parametrize(
    "release, version, fixed",
    [
        ("6.14.0-37-generic", (6, 14), None),  # a distribution build may carry the fix
        ("7.0.3-1-MANJARO", (7, 0), None),
        ("6.14.0", (6, 14), False),  # a plain release before 7.1 does not
        ("7.0", (7, 0), False),
        ("7.1.0-rc1", (7, 1), True),
        ("7.1.8-arch1-1", (7, 1), True),
        ("10.2.0", (10, 2), True),
    ],
)
def test_kernel_releases_are_read_as_major_minor(tmp_path, release, version, fixed):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text(release + "\n")
    kernel = driver.kernel(tmp_path)
    assert (kernel.release, kernel.version, kernel.has_xe_peer_fix) == (release, version, fixed)
    assert kernel.problem is None


def test_an_unreadable_or_unparsable_kernel_is_unknown_with_a_reason(tmp_path):
    missing = driver.kernel(tmp_path)
    assert missing.version is None and missing.has_xe_peer_fix is None
    assert "osrelease could not be read" in (missing.problem or "")
    odd = driver.kernel_from_release("linux-next")
    assert odd.version is None and "'linux-next'" in (odd.problem or "")


def test_every_variable_the_issue_names_has_an_effect_and_a_source():
    names = {v.name for v in facts.VARIABLES}
    assert names == {
        "NEOReadDebugKeys",
        "EnableDeferBacking",
        "ForceZeDeviceCanAccessPerReturnValue",
        "ZE_AFFINITY_MASK",
        "ONEAPI_DEVICE_SELECTOR",
        "ZE_FLAT_DEVICE_HIERARCHY",
        "SYCL_UR_L0_RESTRICT_USM_RESIDENCY_TO_P2P",
        "CCL_TOPO_P2P_ACCESS",
        "UR_L0_USM_RESIDENT",
    }
    assert all(v.effect and v.source for v in facts.VARIABLES)


def test_the_production_route_is_itself_in_compute_runtime_916s_range():
    """What PRODUCTION_ROUTE_CAVEATS says: 26.05 needs kernel 7.1 with 2+ GPUs."""
    route = driver.runtime_from_version(facts.PRODUCTION_ROUTE.tag, "facts")
    assert route is not None and route.in_xe_peer_oom_range
    assert "#916" in facts.PRODUCTION_ROUTE_CAVEATS and "debug-only" in facts.INTERIM


def test_debug_keys_keep_the_values_the_driver_takes():
    keys = facts.debug_keys({"NEOReadDebugKeys": "0", "EnableDeferBacking": " -1", "ForceZe": "0"})
    assert keys.values == {"NEOReadDebugKeys": 0, "EnableDeferBacking": -1}
    assert facts.debug_keys({"EnableDeferBacking": "maybe"}).values == {}


KERNEL_6, KERNEL_7_1 = driver.kernel_from_release("6.14.0"), driver.kernel_from_release("7.1.0")
RT_26_14 = driver.runtime_from_version("26.14.37833.4", "t")
RT_26_27 = driver.runtime_from_version("26.27.39122.10", "t")


PEER = driver.PEER_ACCESS_UNKNOWN


@pytest.mark.parametrize(
    "gpus, runtime, kernel, peer_off, p2p, unknown",
    [
        (2, RT_26_14, KERNEL_6, False, True, ()),
        (2, RT_26_14, KERNEL_6, False, None, (PEER,)),  # peer access not known: possible
        (2, RT_26_14, KERNEL_6, False, False, None),  # no peer access: no peer imports
        (1, RT_26_14, KERNEL_6, False, True, None),
        (2, RT_26_14, KERNEL_7_1, False, True, None),
        (2, RT_26_27, KERNEL_6, False, True, None),
        (2, RT_26_14, KERNEL_6, True, True, None),
        (3, None, KERNEL_6, False, True, ("the compute-runtime version",)),
        (2, RT_26_14, driver.kernel_from_release("odd"), False, True, ("the kernel release",)),
        (2, None, None, False, None, ("the compute-runtime version", "the kernel release", PEER)),
        (2, RT_26_27, None, False, None, None),  # one part known not to hold rules it out
    ],
)
def test_compute_runtime_916_is_ruled_out_by_any_part_and_unknown_only_where_the_rest_holds(
    gpus, runtime, kernel, peer_off, p2p, unknown
):
    oom = driver.xe_peer_oom(gpus, runtime, kernel, peer_off, p2p)
    assert (None if oom is None else oom.unknown) == unknown
    if oom is not None:
        assert oom.certain is (unknown == ()) and oom.intel_gpus == gpus
