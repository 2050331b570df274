"""Cause attribution on synthetic snapshot pairs, one per cause."""

import pytest

from vllm_xpu_memfix.memory.attribution import (
    SIGNIFICANT,
    Outside,
    attribute,
    outside_any_process,
)
from vllm_xpu_memfix.memory.snapshot import DrmUsage, Snapshot

GiB = 1024**3


def snap(anon=1 * GiB, file=200 << 20, cached=4 * GiB, available=100 * GiB, gtt=None):
    drm = DrmUsage(drivers=("xe",), clients=1, total_gtt=gtt) if gtt is not None else None
    return Snapshot(
        ts=0.0, pid=1, rss_anon=anon, rss_file=file, cached=cached, mem_available=available, drm=drm
    )


def test_driver_mirror_memory_available_falls_with_no_process_growth():
    # 4 x 0.92 x 31.89 GiB pinned by the driver: MemAvailable falls, RSS and PSS stay flat.
    start, end = snap(), snap(available=100 * GiB - 29 * GiB)
    a = attribute(start, end, tree_anon_pss_start=6 * GiB, tree_anon_pss_end=6 * GiB + (50 << 20))
    assert a.cause == "outside"
    assert a.outside_processes == 29 * GiB - (50 << 20)
    assert "driver" in a.explanation and "cause 1" in a.explanation


def test_drm_gtt_growth_alone_points_at_the_driver():
    a = attribute(snap(gtt=0), snap(gtt=8 * GiB), None, None)
    assert a.cause == "outside" and a.drm_gtt == 8 * GiB and a.outside_processes is None


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
