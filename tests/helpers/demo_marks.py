"""What a picture's phase marks must agree with (issue 61 item 2): the ledger rows they
mark, in the samples' clock, and the worker's own samples in the monitor CSV.

The ledger and the CSV are read here with ``json`` and ``csv`` alone, apart from the
readers ``plot`` uses, and the marks are taken from the figure ``plot`` draws.
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
from pathlib import Path

from vllm_xpu_memfix.cli.plot import figure

MiB = 1024**2
# What a worker's RssAnon may move between its ledger row and the nearest sample without a
# phase's step: a tiny model's allocations between two phases are a few MiB.
RSS_SLACK = 16 * MiB


def worker_rows(ledger_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(ledger_dir.glob("ledger-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if str(row.get("role", "")).startswith("worker"):
                rows.append(row)
    return rows


def assert_marks_where_the_ledger_says(csv_path: Path, ledger_dir: Path) -> None:
    """Each mark is within one sampling interval of its ledger rows' times ("process start":
    the worker's ``began``), every worker phase has a mark, the worker's band appears at the
    first sample after its start mark, and at each later mark the worker's sampled RssAnon
    brackets the ledger row's, so the two clocks agree."""
    import matplotlib.pyplot as plt

    with csv_path.open() as f:
        samples = list(csv.DictReader(f))
    system = [(float(r["ts"]), float(r["t"])) for r in samples if r["pid"] == "system"]
    interval = statistics.median(b[1] - a[1] for a, b in itertools.pairwise(system))
    t0 = system[0][0] - system[0][1]
    rows = worker_rows(ledger_dir)
    assert {r["phase"] for r in rows} >= {"process start", "KV cache allocated", "ready"}

    fig = figure(csv_path, ledger_dir)
    try:
        marks = [
            (text.get_position()[0], text.get_text().split(" / ")) for text in fig.axes[0].texts
        ]
    finally:
        plt.close(fig)
    for row in rows:
        x = (row["began"] if row["phase"] == "process start" else row["ts"]) - t0
        near = [names for mark, names in marks if abs(mark - x) <= interval]
        assert any(row["phase"] in names for names in near), (row["phase"], x, marks)

        own = [r for r in samples if r["pid"] == str(row["pid"])]
        if row["phase"] == "process start":
            first_seen = float(own[0]["ts"])
            between = [ts for ts, _ in system if row["began"] < ts < first_seen]
            assert first_seen >= row["began"] and len(between) <= 1, (row["began"], between)
            continue
        window = [int(r["rss_anon"]) for r in own if abs(float(r["ts"]) - row["ts"]) <= interval]
        assert window, (row["phase"], "no sample of the worker within one interval")
        low, high = min(window) - RSS_SLACK, max(window) + RSS_SLACK
        assert low <= row["rss_anon"] <= high, (row["phase"], row["rss_anon"] / MiB, window)
