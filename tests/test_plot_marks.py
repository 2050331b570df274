"""The picture of a recorded real run (tests/data/demo_run: `vllm-xpu-memfix demo` on vLLM
0.32's CPU build, a process beside it holding 1 GiB): its phase marks sit at the ledger's
rows in the samples' clock, no two labels overlap, and the neighbour is the others' growth
(issue 61 items 1 to 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.demo_marks import assert_marks_where_the_ledger_says, worker_rows

from vllm_xpu_memfix.cli.plot import (
    NOT_IN_ANY,
    OTHER_PROCESSES,
    figure,
    read_monitor_csv,
    system_lines,
)

pytest.importorskip("matplotlib")

RUN = Path(__file__).resolve().parent / "data" / "demo_run"
CSV, LEDGER = RUN / "monitor.csv", RUN / "ledger"


def test_each_mark_is_within_one_sample_of_its_ledger_row_and_the_workers_band():
    assert len(worker_rows(LEDGER)) == 7  # the worker's seven phases
    assert_marks_where_the_ledger_says(CSV, LEDGER)


def test_no_two_phase_labels_of_the_recorded_run_overlap():
    import matplotlib.pyplot as plt

    fig = figure(CSV, LEDGER)
    try:
        renderer = fig.canvas.get_renderer()
        labels = fig.axes[0].texts
        boxes = [label.get_window_extent(renderer) for label in labels]
        named = {name for label in labels for name in label.get_text().split(" / ")}
    finally:
        plt.close(fig)
    assert named == {row["phase"] for row in worker_rows(LEDGER)}
    for i, box in enumerate(boxes):
        assert not any(box.overlaps(other) for other in boxes[i + 1 :]), labels[i].get_text()


def test_the_neighbours_gib_is_drawn_as_other_processes_not_as_not_in_any_process():
    _, system = read_monitor_csv(CSV)
    lines = {line.label: line.gib for line in system_lines(system)}
    assert max(lines[OTHER_PROCESSES]) > 0.95
    assert max(lines[NOT_IN_ANY]) < 0.3
