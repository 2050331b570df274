"""The ledger with injected snapshots: ordering, table, JSON lines, write errors; its
summary on the constructed multi-GPU xe trees (tests/data/proc/README.md)."""

import json
import os
import socket

import pytest
from helpers.xe_trees import FOUR_PINNED, FOUR_UNPINNED, TWO_PINNED

from vllm_xpu_memfix.core.log import LIMIT
from vllm_xpu_memfix.memory.ledger import PHASES, Ledger
from vllm_xpu_memfix.memory.snapshot import DrmUsage, Snapshot

MiB = 1024**2


def scripted(*snaps, pss_flags=None):
    it = iter(snaps)

    def take(pss):
        if pss_flags is not None:
            pss_flags.append(pss)
        return next(it)

    return take


def test_each_phase_is_recorded_once_and_in_order(tmp_path):
    snaps = [
        Snapshot(
            ts=100.0 + i, pid=7, rss_anon=(100 + 50 * i) * MiB, mem_available=10_000 * MiB - i * MiB
        )
        for i in range(4)
    ]
    flags = []
    ledger = Ledger(
        "worker-0",
        tmp_path,
        take=scripted(*snaps, pss_flags=flags),
        tree_anon_pss=lambda: 500 * MiB,
    )
    ledger.rank = 0
    ledger.record("process start")
    ledger.record("weights loaded")
    assert ledger.record("weights loaded") is None, "a phase already recorded is kept"
    ledger.record("KV cache sized", kv_cache_bytes=123)
    rows = [json.loads(line) for line in ledger.jsonl_path.read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["process start", "weights loaded", "KV cache sized"]
    assert rows[0]["rss_anon"] == 100 * MiB and rows[1]["rss_anon"] == 150 * MiB
    assert (
        rows[2]["kv_cache_bytes"] == 123
        and rows[2]["rank"] == 0
        and rows[0]["tree_anon_pss"] == 500 * MiB
        and rows[2]["tree_anon_pss"] is None
    )
    assert all(r["ledger_cost_s"] >= 0 for r in rows)
    assert flags == [True, False, False], "PSS is read only at the ends of start-up"
    assert ledger.jsonl_path.name == f"ledger-{socket.gethostname()}-{os.getpid()}.jsonl"


def test_table_shows_memavailable_drop_and_drm_columns_when_present():
    drm = DrmUsage(("xe",), 1, total_gtt=2048 * MiB, total_vram=8192 * MiB)
    snaps = [
        Snapshot(ts=0.0, pid=1, rss_anon=100 * MiB, mem_available=1000 * MiB),
        Snapshot(ts=2.5, pid=1, rss_anon=300 * MiB, mem_available=400 * MiB, drm=drm),
    ]
    ledger = Ledger("worker-0", take=scripted(*snaps), tree_anon_pss=lambda: None)
    ledger.record(PHASES[0])
    ledger.record(PHASES[-1])
    lines = ledger.table().splitlines()
    assert lines[0].split() == [
        "phase",
        "t",
        "(s)",
        "RssAnon",
        "RssFile",
        "Pss",
        "tree",
        "anon",
        "Pss",
        "MemAvail",
        "drop",
        "GTT",
        "imports",
        "VRAM",
    ]
    assert lines[2].split() == ["ready", "2.5", "300", "-", "-", "-", "600", "2,048", "8,192"]
    assert "anon +200 MiB" in ledger.summary_lines()[0]


def test_unwritable_ledger_dir_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ledger = Ledger(
        "main",
        blocker / "sub",
        take=lambda _pss: Snapshot(ts=0.0, pid=1),
        tree_anon_pss=lambda: None,
    )
    ledger.record("process start")
    assert ledger.write_error and "cannot write" in ledger.write_error
    assert len(ledger.entries) == 1


def test_ready_is_the_first_batch_outside_the_warm_up(monkeypatch, caplog):
    """vLLM's V2 runner runs execute_model inside compile_or_warm_up_model (its kernel
    warm-up, 0.32 v1/worker/gpu_worker.py). Those calls must not end the ledger; the first
    batch after the warm-up must, once."""
    import logging

    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_xpu_memfix.core.patching import Patcher
    from vllm_xpu_memfix.fixes.ledger import Recorder

    batches = []

    def execute_model(self, batch):
        batches.append(batch)
        return batch

    def compile_or_warm_up_model(self):
        self.execute_model("warm-up 1")  # what the V2 runner's warm-up does
        self.execute_model("warm-up 2")

    monkeypatch.setattr(Worker, "execute_model", execute_model)
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", compile_or_warm_up_model)
    recorder = Recorder(None)
    patcher = Patcher()
    for patch in recorder.patches():
        if patch.target.endswith((".execute_model", "Worker.compile_or_warm_up_model")):
            patcher.install(patch)
    worker = object.__new__(Worker)
    worker.rank = 0
    try:
        with caplog.at_level(logging.INFO):
            worker.compile_or_warm_up_model()
            assert not recorder.current().has("ready"), "a warm-up batch ended the ledger"
            for n in range(3):
                worker.execute_model(f"batch {n}")
    finally:
        patcher.revert_all()
    assert batches == ["warm-up 1", "warm-up 2", "batch 0", "batch 1", "batch 2"]
    phases = [entry.phase for entry in recorder.current().entries]
    assert phases == ["warm-up done", "ready"]
    assert sum("host-memory ledger" in r.getMessage() for r in caplog.records) == 1


def recorded_ledger(scenario):
    """Rank 0's ledger from process start to ready on one of the constructed trees."""
    moments = ("start", "ready")
    snaps = iter(scenario.rank_zero(moment) for moment in moments)
    pss = iter(scenario.tree_anon_pss(moment) for moment in moments)
    ledger = Ledger("worker-0", take=lambda _pss: next(snaps), tree_anon_pss=lambda: next(pss))
    ledger.record(PHASES[0])
    ledger.record(PHASES[-1])
    return ledger


@pytest.mark.parametrize(
    ("scenario", "says"),
    [
        (
            FOUR_PINNED,
            "driver host copy (committed, GPUActive): +12.6 GiB, peer imports: 9.3 GiB "
            "(not host memory by itself); likely cause: the GPU driver's host copy",
        ),
        (
            FOUR_UNPINNED,
            "driver host copy (committed, GPUActive): +0.3 GiB, peer imports: 9.3 GiB "
            "(not host memory by itself; the host holds no copy); likely cause: peer imports",
        ),
        (
            TWO_PINNED,
            "driver host copy (committed, outside any process): +36.3 GiB, peer imports: "
            "18.1 GiB (not host memory by itself); likely cause: the GPU driver's host copy",
        ),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_the_summary_shows_the_committed_copy_and_the_imports_as_imports(scenario, says):
    assert says in "; ".join(recorded_ledger(scenario).summary_lines())


def test_the_driver_copy_as_likely_cause_points_to_its_section():
    """A record each (within the limit); the driver's copy points to driver_host_copy."""
    lines = recorded_ledger(FOUR_PINNED).summary_lines()
    assert [line.split(" ")[0] for line in lines] == ["attribution", "driver", "likely"]
    assert lines[-1].endswith("(vllm-xpu-memfix explain driver_host_copy)")
    assert all(len(f"vllm-xpu-memfix: rank 0 {line}") <= LIMIT for line in lines)
    quiet = recorded_ledger(FOUR_UNPINNED).summary_lines()[-1]
    assert "likely cause: peer imports" in quiet and "troubleshooting" not in quiet


def test_the_table_shows_the_gpu_count_where_the_kernel_has_one():
    header, start, ready = recorded_ledger(FOUR_PINNED).table().splitlines()
    assert "GPUActive rise" in header and "GTT imports" in header
    assert start.split()[-3:] == ["0", "-", "-"], "no DRM client at process start"
    assert ready.split()[-3:] == ["12,902", "9,523", "3,149"]
    assert "GPUActive" not in recorded_ledger(TWO_PINNED).table()
