"""The snapshot reader on recorded (cpu-vm-v1) and constructed (xe-cgroup-v2, xe-*gpu-*)
trees. See tests/data/proc/README.md for where each file came from."""

import errno
from pathlib import Path

import pytest
from helpers.refusing_proc import RefusingReader
from helpers.xe_trees import FOUR_PINNED, TWO_PINNED

from vllm_xpu_memfix.memory import snapshot
from vllm_xpu_memfix.memory.snapshot import (
    ProcReader,
    Snapshot,
    gpu_active,
    parse_drm_fdinfo,
    parse_size,
)

DATA = Path(__file__).parent / "data" / "proc"
KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1234 kB", 1234 * KiB),
        ("12 MiB", 12 * MiB),
        ("7 KiB", 7 * KiB),
        ("42", 42),
        ("0", 0),
        ("3 GiB", 3 * GiB),
        ("", None),
        ("n/a", None),
        ("5 parsecs", None),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


def test_recorded_cpu_vm_process():
    snap = ProcReader(DATA / "cpu-vm-v1").take(4242)
    assert snap.pid == 4242
    assert snap.rss_anon == 212872 * KiB  # it held a 64 MiB tensor
    assert snap.rss_anon > 64 * MiB
    assert snap.vm_hwm >= snap.rss_anon
    assert snap.pss is not None and snap.pss_anon is not None and snap.pss_file is not None
    assert 0 < snap.mem_available <= snap.mem_total
    assert snap.committed_as > 0 and snap.cached > 0
    assert snap.swap_total == 0
    # v1 cgroup whose own directory is the mount root; the limit is "unlimited".
    assert snap.cgroup_current == int(
        (DATA / "cpu-vm-v1/sys/fs/cgroup/memory/memory.usage_in_bytes").read_text()
    )
    assert snap.cgroup_max is None
    assert snap.gpu_active is None
    assert snap.drm is None, "an fdinfo without drm-driver is not a DRM client"


def test_anon_pss_is_anonymous_plus_shmem_for_a_snapshot_and_for_the_tree_sum():
    reader = ProcReader(DATA / "cpu-vm-v1")
    snap = reader.take(4242)
    assert snap.anon_pss == snap.pss_anon + (snap.pss_shmem or 0)
    assert reader.process_anon_pss("4242") == snap.anon_pss
    assert reader.take(4242, pss=False).anon_pss is None


def test_constructed_xe_process_counts_each_drm_client_once():
    snap = ProcReader(DATA / "xe-cgroup-v2").take(777)
    assert snap.drm is not None
    assert snap.drm.drivers == ("xe",)
    assert snap.drm.clients == 2, "fds 5 and 6 share drm-client-id 41"
    assert snap.drm.cards == 2, "two drm-pdev"
    assert snap.drm.total_gtt == 4194304 * KiB + 512 * MiB
    assert snap.drm.total_vram == 27648 * MiB + 1048576 * KiB
    assert snap.drm.resident == snap.drm.total_gtt + snap.drm.total_vram
    assert snap.gpu_active == 262144 * snapshot.PAGE_SIZE
    assert snap.cgroup_current == 20 * GiB
    assert snap.cgroup_max == 64 * GiB
    flat = snap.as_dict()
    assert flat["drm_total_gtt"] == snap.drm.total_gtt and flat["drm_driver"] == "xe"


def test_a_rank_of_four_has_a_client_on_every_card_and_the_kernel_counts_gpu_memory():
    snap = FOUR_PINNED.rank_zero("ready")
    assert snap.drm.cards == 4 and snap.drm.clients == 4
    assert snap.drm.total_gtt == (3 * 3_224_370 + 78_644) * KiB, "3 peer imports + its own"
    assert snap.drm.total_vram == 3_224_370 * KiB
    assert snap.gpu_active == 13_277_592 * KiB, "meminfo's GPUActive"
    assert snap.mem_free is not None and snap.available == snap.mem_available
    assert FOUR_PINNED.rank_zero("start").drm is None, "devices not opened at process start"


def test_a_kernel_without_the_gpu_count_gives_none():
    snap = TWO_PINNED.rank_zero("ready")
    assert snap.gpu_active is None and snap.drm.cards == 2


@pytest.mark.parametrize(
    ("meminfo", "vmstat", "expected"),
    [
        ({"GPUActive": 8 * KiB}, "nr_gpu_active 5\n", 8 * KiB),
        ({}, "nr_gpu_active 5\n", 5 * snapshot.PAGE_SIZE),
        ({}, "nr_gpu_active lots\n", None),
        ({}, None, None),
    ],
    ids=["meminfo", "vmstat", "garbage", "neither"],
)
def test_gpu_active_prefers_meminfo_and_falls_back_to_vmstat(meminfo, vmstat, expected):
    assert gpu_active(meminfo, vmstat) == expected


def test_garbage_gpuactive_falls_back_to_nr_gpu_active(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("GPUActive:      many kB\nMemFree: 10 kB\n")
    (tmp_path / "proc" / "vmstat").write_text("nr_gpu_active 3\n")
    snap = ProcReader(tmp_path).take("self", pss=False)
    assert snap.gpu_active == 3 * snapshot.PAGE_SIZE and snap.mem_free == 10 * KiB


def test_without_memavailable_the_available_figure_is_memfree_and_page_cache():
    assert Snapshot(ts=0, pid=1, mem_free=3 * GiB, cached=2 * GiB).available == 5 * GiB
    assert Snapshot(ts=0, pid=1, mem_available=4 * GiB, mem_free=1).available == 4 * GiB
    assert Snapshot(ts=0, pid=1, cached=2 * GiB).available is None


def test_missing_files_give_none_not_errors(tmp_path):
    snap = ProcReader(tmp_path).take(1)
    assert snap.rss_anon is None and snap.mem_available is None and snap.drm is None
    assert snap.mem_free is None and snap.gpu_active is None
    assert snap.cgroup_current is None and snap.cgroup_max is None


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_a_process_whose_files_are_refused_is_denied_not_gone(code):
    """hidepid, or another user's process: the kernel says EACCES/EPERM, as psutil's
    AccessDenied; the process exists, and the system figures are still read."""
    error = PermissionError(code, "Permission denied")
    snap = RefusingReader(DATA / "cpu-vm-v1", 4242, error).take(4242)
    assert not snap.gone
    assert snap.denied == ("status", "smaps_rollup", "cgroup", "fdinfo")
    assert snap.rss_anon is None and snap.pss is None and snap.cgroup_current is None
    assert snap.mem_available is not None and snap.mem_available > 0
    assert "denied" not in snap.as_dict() and "gone" not in snap.as_dict()


def test_a_process_that_is_gone_is_gone_not_denied(tmp_path):
    """psutil's NoSuchProcess: ESRCH, or the files fail because /proc/<pid> is gone."""
    esrch = ProcessLookupError(errno.ESRCH, "No such process")
    snap = RefusingReader(DATA / "cpu-vm-v1", 4242, esrch).take(4242)
    assert snap.gone and snap.denied == ()
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemAvailable:  1024 kB\n")
    snap = ProcReader(tmp_path).take(4242)
    assert snap.gone and snap.denied == () and snap.mem_available == 1024 * KiB


def test_a_missing_file_of_a_live_process_is_neither_gone_nor_denied():
    """ENOENT while /proc/<pid> is there: a file this kernel lacks, not an exit."""
    enoent = FileNotFoundError(errno.ENOENT, "No such file or directory")
    snap = RefusingReader(DATA / "cpu-vm-v1", 4242, enoent).take(4242)
    assert not snap.gone and snap.denied == () and snap.rss_anon is None


def test_a_zombie_is_gone(tmp_path):
    process = tmp_path / "proc" / "5"
    process.mkdir(parents=True)
    (process / "status").write_text("Name:\tpython\nState:\tZ (zombie)\nPid:\t5\n")
    snap = ProcReader(tmp_path).take(5)
    assert snap.gone and snap.rss_anon is None


def test_unreadable_fdinfo_is_skipped(tmp_path):
    fdinfo = tmp_path / "proc" / "9" / "fdinfo"
    fdinfo.mkdir(parents=True)
    (fdinfo / "3").write_text("drm-driver:\ti915\ndrm-client-id:\t1\ndrm-total-system0:\t8 MiB\n")
    (fdinfo / "4").mkdir()  # reading it raises IsADirectoryError
    usage = ProcReader(tmp_path).drm_usage("9")
    assert usage is not None and usage.total_system == 8 * MiB and usage.drivers == ("i915",)


def test_drm_without_client_id_counts_every_fd():
    text = "drm-driver: xe\ndrm-total-gtt: 1 MiB\n"
    assert parse_drm_fdinfo([text, text]).total_gtt == 2 * MiB


def test_live_snapshot_of_this_process():
    snap = snapshot.take()
    assert snap.rss_anon and snap.rss_anon > 0
    assert snap.pss and snap.mem_available
