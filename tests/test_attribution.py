"""Cause attribution on synthetic snapshot pairs, one per cause, and on the constructed
multi-GPU xe trees (tests/data/proc/README.md)."""

import shutil

import pytest
from helpers.xe_trees import (
    DATA,
    FOUR_PINNED,
    FOUR_UNPINNED,
    SCENARIOS,
    TWO_PINNED,
    TWO_UNPINNED,
)

from vllm_xpu_memfix.memory.attribution import (
    BY_GPU_COUNT,
    BY_OUTSIDE,
    SIGNIFICANT,
    HostCopy,
    Outside,
    attribute,
    outside_any_process,
)
from vllm_xpu_memfix.memory.snapshot import DrmUsage, ProcReader, Snapshot

GiB = 1024**3


def snap(
    anon=1 * GiB,
    file=200 << 20,
    cached=4 * GiB,
    available=100 * GiB,
    gtt=None,
    cards=1,
    gpu_active=None,
):
    drm = None
    if gtt is not None:
        drm = DrmUsage(drivers=("xe",), clients=cards, cards=cards, total_gtt=gtt)
    return Snapshot(
        ts=0.0,
        pid=1,
        rss_anon=anon,
        rss_file=file,
        cached=cached,
        mem_available=available,
        gpu_active=gpu_active,
        drm=drm,
    )


def test_driver_host_copy_memory_available_falls_with_no_process_growth():
    # 4 x 0.92 x 31.89 GiB pinned by the driver: MemAvailable falls, RSS and PSS stay flat.
    start, end = snap(), snap(available=100 * GiB - 29 * GiB)
    a = attribute(start, end, tree_anon_pss_start=6 * GiB, tree_anon_pss_end=6 * GiB + (50 << 20))
    assert a.cause == "outside"
    assert a.outside_processes == 29 * GiB - (50 << 20)
    assert "driver" in a.explanation and "cause 1" in a.explanation


def test_peer_imports_alone_are_not_memory_held():
    """drm-total-gtt growth on two cards with no committed figure: imports, cause unknown."""
    a = attribute(snap(gtt=0, cards=2), snap(gtt=8 * GiB, cards=2), None, None)
    assert a.host_copy.peer_imports == 8 * GiB and a.host_copy.committed is None
    assert a.cause == "imports_unknown" and a.outside_processes is None


def test_gtt_on_one_card_is_no_peer_import():
    a = attribute(snap(gtt=0), snap(gtt=8 * GiB), None, None)
    assert a.host_copy.peer_imports == 0 and a.cause == "none"


def test_imports_with_nothing_committed_hold_no_copy():
    """EnableDeferBacking=0: the imports stay, the host commits nothing for them."""
    start = snap(gtt=0, cards=2, gpu_active=1 * GiB)
    end = snap(gtt=18 * GiB, cards=2, gpu_active=1 * GiB + (40 << 20))
    a = attribute(start, end, 6 * GiB, 6 * GiB)
    assert a.host_copy.held is False and a.host_copy.imports_without_copy
    assert a.cause == "imports_no_copy" and "no copy" in a.explanation


def test_the_kernels_gpu_count_is_preferred_to_the_memavailable_drop():
    """Another process takes 10 GiB while the GPU count shows the driver's 18 GiB."""
    start = snap(gtt=0, cards=2, gpu_active=0)
    end = snap(gtt=18 * GiB, cards=2, gpu_active=18 * GiB, available=100 * GiB - 28 * GiB)
    a = attribute(start, end, 6 * GiB, 6 * GiB)
    assert a.host_copy.committed == 18 * GiB and a.host_copy.counted_by == BY_GPU_COUNT
    assert a.outside_processes == 28 * GiB and a.cause == "outside"
    quiet_gpu = attribute(
        start, snap(gtt=18 * GiB, cards=2, gpu_active=0, available=80 * GiB), 0, 0
    )
    assert quiet_gpu.cause == "outside_other", "20 GiB outside that the driver does not hold"


@pytest.mark.parametrize(
    ("committed", "held"),
    [(None, None), (100 << 20, False), (2 * GiB, False), (3 * GiB, True), (12 * GiB, True)],
)
def test_a_copy_is_held_from_half_of_what_the_pinning_would_make(committed, held):
    """4 cards: 18 GiB of imports count a 6 GiB allocation three times; the pinning would
    commit it once, so a copy is held from 3 GiB on."""
    copy = HostCopy(committed, BY_GPU_COUNT, peer_imports=18 * GiB, cards=4)
    assert copy.pinned_copy == 6 * GiB and copy.held is held


def test_staging_or_retention_shows_as_anonymous_growth():
    start, end = snap(), snap(anon=9 * GiB, available=92 * GiB)
    a = attribute(start, end, tree_anon_pss_start=2 * GiB, tree_anon_pss_end=10 * GiB)
    assert a.cause == "anon"
    assert a.anon == 8 * GiB and a.outside_processes == 0


def test_page_cache_growth_is_file_pages():
    start, end = snap(), snap(file=200 << 20, cached=40 * GiB, available=99 * GiB)
    a = attribute(start, end, tree_anon_pss_start=2 * GiB, tree_anon_pss_end=2 * GiB)
    assert a.cause == "file" and a.page_cache == 36 * GiB


def test_small_growth_is_no_cause():
    a = attribute(snap(), snap(anon=1 * GiB + SIGNIFICANT // 2), 1 * GiB, 1 * GiB)
    assert a.cause == "none"


@pytest.mark.parametrize("missing", ["mem_available", "tree"])
def test_missing_figures_leave_outside_unknown(missing):
    start, end = snap(), snap(anon=5 * GiB)
    if missing == "mem_available":
        start = Snapshot(ts=0.0, pid=1, rss_anon=1 * GiB)
        a = attribute(start, end, 1, 2)
    else:
        a = attribute(start, end, None, 2)
    assert a.outside_processes is None and a.cause == "anon"


def test_outside_any_process_is_the_drop_less_the_trees_growth():
    """The one computation that the ledger's attribution and monitor's system row share."""
    assert outside_any_process(100 * GiB, 71 * GiB, 6 * GiB, 7 * GiB) == Outside(
        mem_available_drop=29 * GiB, tree_anon_pss_growth=1 * GiB, outside_processes=28 * GiB
    )
    assert outside_any_process(100 * GiB, None, 6 * GiB, 7 * GiB).outside_processes is None
    assert outside_any_process(100 * GiB, 99 * GiB, None, 7 * GiB) == Outside(1 * GiB, None, None)


# --- the constructed multi-GPU xe trees ---------------------------------------------------


def rank_zero_attribution(scenario, root=None):
    start, ready = (
        ProcReader(root / moment).take(scenario.ranks[0]) if root else scenario.rank_zero(moment)
        for moment in ("start", "ready")
    )
    return attribute(start, ready, scenario.tree_anon_pss("start"), scenario.tree_anon_pss("ready"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_the_driver_figure_is_what_the_host_committed(scenario):
    """Within 10 %, or within SIGNIFICANT where the figure is small: from MemAvailable it
    carries what other processes on the host took (120 MiB in the 2-GPU trees)."""
    copy = rank_zero_attribution(scenario).host_copy
    assert copy.committed == pytest.approx(scenario.committed, rel=0.10, abs=SIGNIFICANT)
    # This rank's drm-total-gtt: its allocation on each of the gpus - 1 peers, plus its own.
    assert copy.peer_imports == pytest.approx((scenario.gpus - 1) * scenario.device, rel=0.02)
    assert copy.counted_by == (BY_GPU_COUNT if scenario.gpus == 4 else BY_OUTSIDE)


@pytest.mark.parametrize("scenario", [TWO_PINNED, FOUR_PINNED], ids=lambda s: s.name)
def test_with_the_pinning_the_driver_is_blamed_for_what_was_committed(scenario):
    a = rank_zero_attribution(scenario)
    assert a.cause == "outside" and a.host_copy.held
    assert "driver's host copy" in a.explanation


@pytest.mark.parametrize(
    ("scenario", "cause"),
    [(TWO_UNPINNED, "file"), (FOUR_UNPINNED, "imports_no_copy")],
    ids=lambda v: getattr(v, "name", v),
)
def test_without_the_pinning_the_imports_are_there_and_nothing_is_held(scenario, cause):
    """The 4x B70 probe: host held 12.6 -> 0.3 GiB with every import still present. In the
    2-GPU start-up the checkpoint's page cache (+6 GiB) is then the largest part."""
    a = rank_zero_attribution(scenario)
    assert a.host_copy.peer_imports >= scenario.device
    assert a.host_copy.held is False and a.host_copy.imports_without_copy
    assert a.cause == cause


def copy_without(scenario, tmp_path, meminfo_keys=(), vmstat_keys=()):
    """The scenario's tree with the named lines left out, as an older kernel prints it."""
    root = tmp_path / scenario.name
    shutil.copytree(DATA / scenario.name, root)
    for moment in ("start", "ready"):
        for name, keys in (("meminfo", meminfo_keys), ("vmstat", vmstat_keys)):
            path = root / moment / "proc" / name
            lines = path.read_text().splitlines(keepends=True)
            path.write_text("".join(line for line in lines if not line.startswith(keys)))
    return root


@pytest.mark.parametrize("scenario", [FOUR_PINNED, FOUR_UNPINNED], ids=lambda s: s.name)
def test_a_kernel_without_the_gpu_count_gives_the_same_answer_from_memavailable(scenario, tmp_path):
    with_count = rank_zero_attribution(scenario)
    root = copy_without(scenario, tmp_path, ("GPUActive", "GPUReclaim"), ("nr_gpu_",))
    without = rank_zero_attribution(scenario, root)
    assert without.host_copy.counted_by == BY_OUTSIDE
    assert without.host_copy.committed == pytest.approx(
        scenario.committed, rel=0.10, abs=SIGNIFICANT
    )
    assert (without.cause, without.host_copy.held) == (with_count.cause, with_count.host_copy.held)


def test_nr_gpu_active_stands_in_where_meminfo_lacks_gpuactive(tmp_path):
    root = copy_without(FOUR_PINNED, tmp_path, meminfo_keys=("GPUActive", "GPUReclaim"))
    a = rank_zero_attribution(FOUR_PINNED, root)
    assert a.host_copy.counted_by == BY_GPU_COUNT
    assert a.host_copy.committed == rank_zero_attribution(FOUR_PINNED).host_copy.committed
