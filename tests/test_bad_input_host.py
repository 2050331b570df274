"""The plugin's host reads never raise and never block (issue 38).

Every read of a file the plugin did not write (sysfs, dpkg's status, /proc under the
sysroot, this process's /proc) goes through ``core.files``: regular files only, up to a
cap. A value that is not one (junk in a GPU's vendor, device or VRAM file, a runtime
version that cannot be placed) is unknown, with one DEBUG line, and the plugin behaves as
if it were absent. The trees are in the kernel's and dpkg's formats (tests/hosts.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.odd_files import fifo, within
from hosts import B70, build_host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_xpu_memfix.core import config, files
from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver
from vllm_xpu_memfix.memory.room import host_room
from vllm_xpu_memfix.memory.snapshot import ProcReader

ROOT = Path(__file__).parent.parent
CARD = "sys/class/drm/card1/device"
FEW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def debug_lines() -> Iterator[list[str]]:
    """The DEBUG lines of ``core.files`` meanwhile."""
    logger = get_logger("files")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def guard(root: Path, **env: str) -> driver_env.Decision:
    return driver_env.decide(config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root), **env}), {})


# --- junk values: unknown, one DEBUG line, as if absent ----------------------------------


@pytest.mark.parametrize(
    ("name", "junk"),
    [
        ("vendor", "zz"),
        ("vendor", "0x8086 0x8086"),
        ("vendor", ""),
        ("device", "0xZZZZ"),
        ("device", "\u0662\u0663"),  # Arabic-Indic digits: int() takes them, sysfs never
        ("device", "e223" * 2000),
    ],
)
def test_junk_in_a_gpu_id_file_skips_that_card_with_one_debug_line(tmp_path, name, junk):
    root = build_host(tmp_path, [B70, B70])
    path = root / CARD / name
    path.write_text(junk + "\n")
    with debug_lines() as lines:
        gpus = driver.intel_gpus(root)
    assert [g.card for g in gpus] == ["card2"], "the card is taken as absent, the other kept"
    assert len(lines) == 1 and str(path) in lines[0] and "taken as unknown" in lines[0]
    assert len(lines[0]) <= 320
    absent = build_host(tmp_path / "absent", [B70, B70])
    (absent / CARD / name).unlink()
    assert guard(root).reason == guard(absent).reason, "behaves as if the file were absent"


@pytest.mark.parametrize("junk", ["lots", "-1", "0", "1" * 5000, "\u00b2", "3.4e10"])
def test_junk_in_the_vram_file_is_unknown_with_one_debug_line(tmp_path, junk):
    root = build_host(tmp_path, [B70, B70])
    path = root / CARD / "tile0/physical_vram_size_bytes"
    path.write_text(junk + "\n")
    with debug_lines() as lines:
        gpus = driver.intel_gpus(root)
    assert [g.vram_bytes for g in gpus] == [None, 32 * 1024**3]
    assert len(lines) == 1 and str(path) in lines[0] and len(lines[0]) <= 320


@pytest.mark.parametrize(
    ("runtime", "lib_build"),
    [
        ("1.3.0", None),  # the old package's form, build 0
        ("26.09.0", None),  # a tag with build 0
        ("26.99.37435.1", None),  # week 99
        ("26.14." + "9" * 5000, None),  # more digits than int() converts
        ("latest", None),
        (None, "0"),  # libze_intel_gpu.so.1.14.0
    ],
)
def test_a_runtime_version_that_cannot_be_placed_is_unknown(tmp_path, runtime, lib_build):
    root = build_host(tmp_path, [B70, B70], runtime=runtime, lib_build=lib_build)
    with debug_lines() as lines:
        found = driver.compute_runtime(root)
    assert found is None
    assert len(lines) == (2 if runtime else 0), lines  # one per package that lists it
    decision = guard(root)
    assert decision.apply and "compute-runtime unknown (taken as affected)" in decision.reason
    absent = build_host(tmp_path / "absent", [B70, B70], runtime=None)
    assert guard(absent).reason == decision.reason, "behaves as if no runtime were installed"


def test_a_kernel_release_that_is_not_one_is_unknown_and_its_line_stays_short(tmp_path):
    root = build_host(tmp_path, [B70, B70], kernel="6." + "9" * 5000)
    kernel = driver.kernel(root)
    assert kernel.version is None and kernel.problem is not None
    assert len(kernel.problem) < 200
    decision = guard(root)
    assert all(len(item) < 200 for item in decision.not_understood)


def test_junk_in_meminfo_and_the_cgroup_is_unknown_never_an_exception(tmp_path):
    root = build_host(tmp_path, [B70])
    (root / "proc/meminfo").write_text(
        "MemTotal: \u00b2\u00b3 kB\nMemAvailable: " + "9" * 5000 + " kB\nCached: 12 kB\n"
    )
    (root / "sys/fs/cgroup").mkdir(parents=True)
    (root / "sys/fs/cgroup/memory.current").write_text("\u0661\u0662\n")
    (root / "sys/fs/cgroup/memory.max").write_text("max\n")
    reader = ProcReader(root)
    assert dict(reader.meminfo()) == {"Cached": 12 * 1024}
    room = host_room(root)
    assert room.bytes is None and "not a byte count" in (room.problem or "")


# --- files that are not regular, or never end ---------------------------------------------


HOST_FILES = [
    f"{CARD}/vendor",
    f"{CARD}/device",
    f"{CARD}/uevent",
    f"{CARD}/tile0/physical_vram_size_bytes",
    "var/lib/dpkg/status",
    "proc/sys/kernel/osrelease",
    "proc/meminfo",
    "proc/self/status",
    "proc/self/cgroup",
]


@pytest.mark.parametrize("name", HOST_FILES)
def test_a_fifo_in_place_of_a_host_file_never_blocks(tmp_path, name):
    root = build_host(tmp_path, [B70, B70])
    fifo(root / name)  # nobody ever writes it: a blocking open or read never returns
    settings_ = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root)})
    within(10, lambda: driver_env.decide(settings_, {}))
    within(10, lambda: host_room(root))
    within(10, lambda: ProcReader(root).take("self", pss=False))


@pytest.mark.parametrize("name", ["var/lib/dpkg/status", f"{CARD}/vendor", "proc/meminfo"])
def test_a_host_file_that_never_ends_is_refused_at_once(tmp_path, name):
    root = build_host(tmp_path, [B70, B70])
    (root / name).unlink()
    (root / name).symlink_to("/dev/zero")
    with debug_lines() as lines:
        within(5, lambda: (driver.intel_gpus(root), driver.compute_runtime(root)))
    within(5, lambda: host_room(root))
    assert any("a character device, not a regular file" in line for line in lines) or (
        name == "proc/meminfo"
    )


def test_a_dpkg_status_over_the_cap_is_read_no_further(tmp_path):
    root = build_host(tmp_path, [B70, B70])
    status = root / "var/lib/dpkg/status"
    with status.open("r+b") as f:
        f.truncate(files.LIST_CAP + 1)  # sparse: costs no disk
    with debug_lines() as lines:
        assert within(30, lambda: driver.compute_runtime(root)) is None
    assert any("more than 64 MiB" in line for line in lines), lines


def test_register_with_a_fifo_and_junk_in_the_tree_starts(tmp_path):
    """The whole entry point, in a process of its own, as vLLM calls it."""
    root = build_host(tmp_path, [B70, B70], runtime="1.3.0")
    (root / "sys/class/drm/card2/device/vendor").write_text("junk\n")
    (root / CARD / "tile0/physical_vram_size_bytes").write_text("lots\n")
    fifo(root / "proc/sys/kernel/osrelease")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")},
        "VLLM_XPU_MEMFIX_SYSROOT": str(root),
        "VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "locks"),
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-c", "import vllm_xpu_memfix as p; p.register(); print('ok')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv", [["check"], ["ray-env"], ["doctor", "--params", "8B"], ["doctor", "--json"]]
)
def test_the_commands_read_a_junk_tree_without_a_traceback(tmp_path, argv):
    root = build_host(tmp_path, [B70, B70], runtime="26.09.0")
    (root / CARD / "vendor").write_text("0xZZZZ\n")
    (root / "sys/class/drm/card2/device/tile0/physical_vram_size_bytes").write_text("x\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")},
        "VLLM_XPU_MEMFIX_SYSROOT": str(root),
        "VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "locks"),
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }
    if argv == ["doctor", "--json"]:
        argv = [*argv, "--params", "8B", "--write-host", str(tmp_path / "h.toml")]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr  # check exits 1 for missing targets
    assert "Traceback" not in result.stderr, result.stderr


# --- any bytes, anywhere ---------------------------------------------------------------------


@FEW
@given(
    name=st.sampled_from(HOST_FILES[:4]),
    content=st.binary(max_size=64),
    version=st.text(max_size=30).filter(lambda v: "\n" not in v),
    osrelease=st.binary(max_size=40),
)
def test_any_bytes_in_the_tree_give_a_decision(tmp_path_factory, name, content, version, osrelease):
    root = build_host(tmp_path_factory.mktemp("host"), [B70, B70], runtime=None)
    (root / name).write_bytes(content)
    (root / "var/lib/dpkg/status").write_text(
        f"Package: intel-opencl-icd\nStatus: install ok installed\nVersion: {version}\n",
        encoding="utf-8",
        errors="surrogateescape",
    )
    (root / "proc/sys/kernel/osrelease").write_bytes(osrelease)
    decision = guard(root)
    assert "\n" not in driver_env.summary(decision)
    runtime = decision.runtime
    if runtime is not None:  # every runtime read can be placed against a release
        assert runtime.pins_host_copy in (True, False)
        assert runtime.in_xe_peer_oom_range in (True, False)


def test_a_driver_key_of_more_digits_than_int_converts_is_not_understood(tmp_path):
    root = build_host(tmp_path, [B70, B70])
    settings_ = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root)})
    decision = driver_env.decide(settings_, {"NEOReadDebugKeys": "1" * 5000})
    assert decision.not_understood and len(decision.not_understood[0]) < 200
    assert decision.env == {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}


@pytest.mark.parametrize(
    "environ",
    [
        {"ZE_AFFINITY_MASK": "9" * 5000},
        {"ZE_AFFINITY_MASK": "\u0661,\u00b2"},  # digits to str.isdigit(), not to Level Zero
        {"ONEAPI_DEVICE_SELECTOR": "level_zero:" + "9" * 5000},
    ],
)
def test_a_device_mask_of_junk_digits_selects_no_gpu_and_never_raises(tmp_path, environ):
    gpus = driver.intel_gpus(build_host(tmp_path, [B70, B70]))
    assert driver.visible_gpus(gpus, environ) == []


def test_a_speaker_file_naming_no_pid_is_taken_over(tmp_path):
    from vllm_xpu_memfix.core import host_lock

    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o700)
    (lock_dir / "x.speaker").write_text("\u00b2 123\n")  # str.isdigit() holds, int() refuses
    assert host_lock.first_alive(lock_dir, "x") is True
