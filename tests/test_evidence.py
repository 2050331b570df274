"""docs/fixes.md is the one home of the project's figures, and every figure is held to its data.

- Each row of fixes.md's evidence tables names where it was measured (the CPU test bed, the
  H200, a public thread or note, or arithmetic) and links its data: a results file, a data
  file, the test that holds the arithmetic, or the public thread.
- Every number in the figure cell of a row that links results or data files is parsed and
  must be, at the precision written, a number read or derived from one of those files.
- README.md restates no measured figure that fixes.md does not hold.

A figure that drifts from its file, or a new one without a file, fails here.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FIXES = ROOT / "docs" / "fixes.md"
README = ROOT / "README.md"
MiB = 1024**2
GiB = 1024**3

_NUMBER = re.compile(r"(?<![\w#.])\d[\d,]*(?:\.\d+)?(?![\w])")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACES = ("CPU test bed", "H200", "public thread", "public note", "arithmetic")


def numbers(text: str) -> list[str]:
    """The numbers written in ``text``, code spans left out (``malloc_trim(0)`` is no figure)."""
    return _NUMBER.findall(re.sub(r"`[^`]*`", "", text))


def value(token: str) -> float:
    return float(token.replace(",", ""))


def matches(token: str, backed: list[float]) -> bool:
    """``token`` is some backed value rounded to the places it is written with."""
    places = len(token.split(".")[1]) if "." in token else 0
    half = 0.5 * 10**-places + 1e-9
    return any(abs(abs(v) - value(token)) <= half for v in backed)


# --- what each file backs ---------------------------------------------------------------


def table_cells(path: Path) -> list[list[str]]:
    """Every row of every Markdown table in ``path`` (header and rule lines left out)."""
    rows, lines = [], path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|[-|: ]+\|", line):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|[-|: ]+\|", lines[i + 1]):
            continue  # a header
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def results_numbers(path: Path) -> list[float]:
    """Every number in the tables of a results file (a ratio written ``12.6x`` included)."""
    cells = (re.sub(r"(\d)x\b", r"\1", cell) for row in table_cells(path) for cell in row)
    return [value(t) for cell in cells for t in numbers(cell)]


def host_release(path: Path) -> list[float]:
    """Plus, per case, what the fix on saves beyond the gc + trim floor (the vocab copies)."""
    saved = {(r[0], r[1]): value(r[7]) for r in table_cells(path) if len(r) == 9}
    extra = [saved[case, "on"] - saved[case, "gc + trim"] for case, arm in saved if arm == "on"]
    return [*results_numbers(path), *extra]


def process_baseline(path: Path) -> list[float]:
    """Plus a worker's RSS at start (anon + file) and the instance at ready less 1 GiB of KV."""
    rows = {(r[0], r[1]): [value(c) for c in r[2:]] for r in table_cells(path)}
    anon, file, _pss, _tree = rows["worker", "process start"]
    return [*results_numbers(path), anon + file, rows["worker", "ready"][3] - 1024]


def kv_headroom(path: Path) -> list[float]:
    """Shapes, shapes in bounds (measured <= estimate <= 1.25 x measured), best and worst ratio."""
    rows = json.loads(path.read_text())["rows"]
    ratios = [r["estimate"] / r["torch_peak"] for r in rows]
    inside = sum(r["torch_peak"] <= r["estimate"] <= 1.25 * r["torch_peak"] for r in rows)
    return [len(rows), inside, min(ratios), max(ratios)]


def warmup(path: Path) -> list[float]:
    """Medians over repeats per arm: summed growth, wall; kept per waiting and per first rank."""
    runs = json.loads(path.read_text())
    arms: dict[tuple[bool, bool, bool], list[dict]] = {}
    for run in runs:
        arms.setdefault((run["lock"], run["shared_cache"], run.get("trim", False)), []).append(run)
    backed: list[float] = []
    for arm in arms.values():
        backed += [
            statistics.median(r["peak_summed_transient_mib"] for r in arm),
            statistics.median(r["wall_s"] for r in arm),
        ]
    kept_off = statistics.median(
        kept for r in arms[False, True, False] for kept in r["retained_after_warmup_mib"]
    )
    waiting = statistics.median(
        kept
        for r in arms[True, True, False]
        for kept in sorted(r["retained_after_warmup_mib"])[:-1]  # all but the compiling rank
    )
    return [*backed, kept_off, waiting, kept_off - waiting]


def golden(path: Path) -> list[float]:
    """Per recording (build and group) and over all: cases, identical cases, words, differing."""
    data = json.loads(path.read_text())
    probe = data["near_tie_probe_g128_vs_reference"].values()
    backed: list[float] = [*(p["words"] for p in probe), *(p["words_differ"] for p in probe)]
    totals = [0, 0, 0, 0]
    for recording in data["recordings"].values():
        cases = recording["cases"].values()
        figures = [
            len(cases),
            recording["identical_cases"],
            sum(c["words"] for c in cases),
            sum(c["words_differ"] + c["scales_differ"] for c in cases),
        ]
        backed += [*figures, recording["group_size"]]
        totals = [t + f for t, f in zip(totals, figures, strict=True)]
    return [*backed, *totals, len(data["recordings"])]


def q4_0(path: Path) -> list[float]:
    data = json.loads(path.read_text())
    layers = data["speed"]["layers"]
    speedups = [layer["speedup_all_threads"] for layer in layers]
    shares = [100 * layer["fraction_of_copy"] for layer in layers]
    runs = data["exactness"]
    cases = sum(r["cases"] for r in runs)
    return [
        cases,
        cases - sum(r["mismatching_cases"] for r in runs),
        sum(r["mismatching_cases"] for r in runs),
        min(speedups),
        max(speedups),
        min(shares),
        max(shares),
        data["speed"]["host_threads"],
    ]


def stack(path: Path) -> list[float]:
    data = json.loads(path.read_text())
    backed = [a["host_peak_mib"] for a in data["arms"] if a["path"] == "host"]
    for load in data["exactness"].values():
        backed += [load["layers"], load["identical"], len(load["differ"]), load["speed_up"]]
    return backed


def kv_703_arithmetic(_path: Path) -> list[float]:
    """#703's reserve against its KV cache and its workaround, as test_kv_headroom holds them."""
    from test_kv_headroom import arithmetic_703

    figures = arithmetic_703()
    reserve, kv, workaround = figures["reserve"], figures["kv_cache"], figures["workaround"]
    return [
        reserve / MiB,
        100 * reserve / kv,
        kv / GiB,
        figures["utilisation"],
        figures["worked_around_at"],
        workaround / GiB,
        100 * workaround / kv,
    ]


def backer(path: Path) -> Callable[[Path], list[float]]:
    """How the figures of a linked file are read."""
    by_name = {
        "host-release-2026-12-03.md": host_release,
        "process-baseline-2026-12-05.md": process_baseline,
        "warmup_lock_device-run3.json": warmup,
        "q4_0-golden-h200.json": golden,
        "q4_0-h200.json": q4_0,
        "device-quant-stack-h200.json": stack,
        "test_kv_headroom.py": kv_703_arithmetic,
    }
    if path.name in by_name:
        return by_name[path.name]
    if path.name.startswith("kv-headroom-h200"):
        return kv_headroom
    if path.parent.name in ("results", "q4_0_golden"):  # figures in the file's tables
        return results_numbers
    raise AssertionError(f"no reader for {path.relative_to(ROOT)}: add one to test_evidence")


# --- the rows of fixes.md -------------------------------------------------------------


def evidence_rows() -> list[tuple[str, str, str, list[str]]]:
    """(section, figure, measured on, links) of every row of fixes.md's evidence tables."""
    rows, section = [], ""
    lines = FIXES.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].strip("` ")
        if line.startswith("| figure |"):
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                figure, where, _command, data = (c.strip() for c in row.strip("|").split(" | "))
                rows.append((section, figure, where, _LINK.findall(data)))
    return rows


ROWS = evidence_rows()
PUBLIC = ("public thread", "public note")
# A public figure is held to its thread by test_public_record where a case records it; the
# rows of the project's own runs are held to their files here.
FILE_ROWS = [r for r in ROWS if not r[2].startswith(PUBLIC)]


def test_fixes_md_has_a_table_for_every_fix():
    from vllm_xpu_memfix.core import config

    sections = {section for section, *_ in ROWS}
    assert {fix.key for fix in config.FIXES} - {"ledger"} <= sections, sections
    assert len(FILE_ROWS) >= 15, "the rows that link data went missing"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r[0]}: {r[1][:40]}")
def test_each_row_says_where_it_was_measured_and_links_its_data(row):
    _section, figure, where, links = row
    assert where.startswith(PLACES), f"'{where[:40]}...' names none of {PLACES}"
    assert links, f"no data, results file or thread linked for: {figure}"
    for link in links:
        if link.startswith("https:") or where.startswith(PUBLIC):
            assert where.startswith(PUBLIC), f"{link}: a thread is only a public figure's data"
        else:
            assert (FIXES.parent / link).exists(), link


@pytest.mark.parametrize("row", FILE_ROWS, ids=lambda r: f"{r[0]}: {r[1][:40]}")
def test_every_figure_of_a_row_is_read_from_its_file(row):
    _section, figure, _where, links = row
    files = [(FIXES.parent / link).resolve() for link in links if not link.startswith("https:")]
    backed = [v for path in files for v in backer(path)(path)]
    tokens = numbers(figure)
    assert tokens, f"a row linking data states no figure: {figure}"
    unbacked = [t for t in tokens if not matches(t, backed)]
    assert unbacked == [], f"not in {[p.name for p in files]}: {unbacked} in '{figure}'"


def test_a_drifted_figure_fails(tmp_path):
    """The check is not vacuous: 0.69 is backed by the load-lock results, 0.71 is not."""
    results = ROOT / "benchmarks" / "results" / "load-lock-2026-12-03.md"
    backed = results_numbers(results)
    assert matches("0.69", backed) and matches("2,891", backed)
    assert not matches("0.71", backed) and not matches("2,890", backed)
    page = tmp_path / "r.md"
    page.write_text("| a | b |\n|---|---|\n| x | 1.5 |\n")
    assert results_numbers(page) == [1.5]


_WITH_UNIT = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s?(?:MiB|GiB|GB|\N{MULTIPLICATION SIGN}|%)")


def test_the_readme_states_no_figure_that_fixes_md_does_not_hold():
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    held = set(numbers(FIXES.read_text()))
    missing = [m.group(0) for m in _WITH_UNIT.finditer(prose) if m.group(1) not in held]
    assert missing == [], f"README.md figures not in docs/fixes.md: {missing}"
