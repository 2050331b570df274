"""docs/fixes.md is the one home of the project's figures, and every figure is held to its data.

- Each row of fixes.md's evidence tables names where it was measured (the CPU test bed, the
  H200, a public thread or note, or arithmetic) and links its data: a results file, a data
  file, the test that holds the arithmetic, or the public thread.
- Each figure in the figure cell of a row that links results or data files is, at the
  precision written, the quantity of those files that the row's entry in ``QUANTITIES``
  names (a column of a results table, a key or a figure derived from a data file); an equal
  number elsewhere in the file does not count.
- Every figure with a unit in the user docs has its home: a figure cell of fixes.md, a link
  to fixes.md beside it, or, for a setting or limit, the code's value.

A figure that drifts from its file, or a new one without a file, fails here.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import test_docs
from helpers.public_cases import serve_line_cases

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

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


# --- what each file backs: its quantities, by name ---------------------------------------

Quantities = dict[str, float]


def tables(path: Path) -> list[tuple[list[str], list[list[str]]]]:
    """Each Markdown table of ``path``: its header cells and its rows' cells (stripped)."""
    found: list[tuple[list[str], list[list[str]]]] = []
    lines = path.read_text().splitlines()
    rule = re.compile(r"\|[-|: ]+\|")
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and rule.fullmatch(lines[i + 1]):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            found.append((_cells(line), rows))
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def results_quantities(path: Path) -> Quantities:
    """Every numeric cell of a results file's tables, named "row | column": the row by its
    cells before the first number, the column by its header, a table after the first by its
    place ("1: row | column"). A cell's first number is its value (``12.6x`` reads 12.6)."""
    found: Quantities = {}
    for place, (header, rows) in enumerate(tables(path)):
        for row in rows:
            first = next((i for i, c in enumerate(row) if i and re.match(r"[-+]?\d", c)), len(row))
            label = " / ".join(c.strip("`") for c in row[:first])
            label = f"{place}: {label}" if place else label
            for column, cell in zip(header[first:], row[first:], strict=False):
                if tokens := numbers(re.sub(r"(\d)x\b", r"\1", cell)):
                    found[f"{label} | {column}"] = value(tokens[0])
    return found


def host_release(path: Path) -> Quantities:
    """Plus, per case, what the fix on saves beyond the gc + trim floor (the vocab copies)."""
    found = results_quantities(path)
    for case in ("bf16", "bf16 checkpoint, --dtype float32", "stand-in int4 (host staging)"):
        on, floor = (found[f"{case} / {arm} | saved vs off"] for arm in ("on", "gc + trim"))
        found[f"{case} | vocabulary copies"] = on - floor
    return found


def process_baseline(path: Path) -> Quantities:
    """Plus a worker's RSS at start (anon + file) and the instance at ready less 1 GiB of KV."""
    found = results_quantities(path)
    start, ready = "worker / process start", "worker / ready"
    found["worker at start | RSS"] = found[f"{start} | RssAnon"] + found[f"{start} | RssFile"]
    found["instance at ready less its KV cache"] = (
        found[f"{ready} | anon Pss of the whole instance"] - 1024
    )
    return found


def kv_headroom(path: Path) -> Quantities:
    """Shapes, shapes in bounds (measured <= estimate <= 1.25 x measured), best and worst
    ratio; what a process's first call added outside torch (driver's less torch's growth)."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    ratios = [r["estimate"] / r["torch_peak"] for r in rows]
    found: Quantities = {
        "shapes": len(rows),
        "shapes in bounds": sum(
            r["torch_peak"] <= r["estimate"] <= 1.25 * r["torch_peak"] for r in rows
        ),
        "lowest ratio": min(ratios),
        "highest ratio": max(ratios),
    }
    if cold := data.get("cold_first_call"):
        found["first call outside torch MiB"] = (
            cold["driver_delta"] - cold["reserved_growth"]
        ) / MiB
    return found


def warmup(path: Path) -> Quantities:
    """Medians over repeats per arm ("lock on, shared cache"): summed growth and wall; what a
    rank keeps after its warm-up, lock off and waiting for the first rank."""
    runs = json.loads(path.read_text())
    arms: dict[str, list[dict]] = {}
    for run in runs:
        name = ", ".join(
            [
                f"lock {'on' if run['lock'] else 'off'}",
                "shared cache" if run["shared_cache"] else "per-rank caches",
                *(["trim"] if run.get("trim") else []),
            ]
        )
        arms.setdefault(name, []).append(run)
    found: Quantities = {}
    for name, arm in arms.items():
        found[f"{name} | summed growth"] = statistics.median(
            r["peak_summed_transient_mib"] for r in arm
        )
        found[f"{name} | wall s"] = statistics.median(r["wall_s"] for r in arm)
    kept = statistics.median(
        kept for r in arms["lock off, shared cache"] for kept in r["retained_after_warmup_mib"]
    )
    waiting = statistics.median(
        kept
        for r in arms["lock on, shared cache"]
        for kept in sorted(r["retained_after_warmup_mib"])[:-1]  # all but the compiling rank
    )
    found |= {"kept, lock off": kept, "kept, waiting": waiting, "kept less": kept - waiting}
    return found


def golden(path: Path) -> Quantities:
    """Per recording ("pr334-6arg-g32 | words") and over "all": cases, identical cases,
    words, differing words and scales; each recording's group; the recordings."""
    data = json.loads(path.read_text())
    found: Quantities = {"recordings": len(data["recordings"])}
    totals = dict.fromkeys(("cases", "identical cases", "words", "differing"), 0.0)
    for name, recording in data["recordings"].items():
        cases = recording["cases"].values()
        figures = {
            "cases": len(cases),
            "identical cases": recording["identical_cases"],
            "words": sum(c["words"] for c in cases),
            "differing": sum(c["words_differ"] + c["scales_differ"] for c in cases),
        }
        found |= {f"{name} | {k}": v for k, v in figures.items()}
        found[f"{name} | group"] = recording["group_size"]
        totals = {k: totals[k] + figures[k] for k in totals}
    return found | {f"all | {k}": v for k, v in totals.items()}


def q4_0(path: Path) -> Quantities:
    data = json.loads(path.read_text())
    layers = data["speed"]["layers"]
    speedups = [layer["speedup_all_threads"] for layer in layers]
    shares = [100 * layer["fraction_of_copy"] for layer in layers]
    runs = data["exactness"]
    cases = sum(r["cases"] for r in runs)
    mismatching = sum(r["mismatching_cases"] for r in runs)
    return {
        "cases": cases,
        "identical cases": cases - mismatching,
        "mismatching cases": mismatching,
        "lowest speed-up": min(speedups),
        "highest speed-up": max(speedups),
        "lowest share of the copy bandwidth": min(shares),
        "highest share of the copy bandwidth": max(shares),
        "host threads": data["speed"]["host_threads"],
    }


def stack(path: Path) -> Quantities:
    """Per load ("legacy | layers"): layers, identical, differing, speed-up; host peaks."""
    data = json.loads(path.read_text())
    found: Quantities = {
        f"{a['path']} path, {a['load']} | host peak": a["host_peak_mib"] for a in data["arms"]
    }
    for load, run in data["exactness"].items():
        found |= {
            f"{load} | layers": run["layers"],
            f"{load} | identical": run["identical"],
            f"{load} | differing": len(run["differ"]),
            f"{load} | speed-up": run["speed_up"],
        }
    return found


def kv_703_arithmetic(_path: Path) -> Quantities:
    """#703's reserve against its KV cache and its workaround, as test_kv_headroom holds them,
    and its whole burst on each sampler path."""
    from test_kv_headroom import VOCAB_703, arithmetic_703

    from vllm_xpu_memfix.memory.estimate import BurstShape, estimate_sampler_burst

    figures = arithmetic_703()
    reserve, kv, workaround = figures["reserve"], figures["kv_cache"], figures["workaround"]
    bursts = {
        f"burst GiB, {path}": estimate_sampler_burst(
            BurstShape(256, VOCAB_703, 2, tp_size=4, hidden_size=5120, topk_topp=path)
        ).peak
        / GiB
        for path in ("triton", "sort")
    }
    return bursts | {
        "reserve MiB": reserve / MiB,
        "reserve % of the KV cache": 100 * reserve / kv,
        "KV cache GiB": kv / GiB,
        "utilisation": figures["utilisation"],
        "worked around at": figures["worked_around_at"],
        "workaround GiB": workaround / GiB,
        "workaround % of the KV cache": 100 * workaround / kv,
    }


def backer(path: Path) -> Callable[[Path], Quantities]:
    """How the quantities of a linked file are read."""
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
        return results_quantities
    raise AssertionError(f"no reader for {path.relative_to(ROOT)}: add one to test_evidence")


def row_quantities(files: list[Path]) -> Quantities:
    """The quantities of a row's files; where it links several, each name leads with its
    file's stem ("kv-headroom-h200-tp2 | shapes")."""
    if len(files) == 1:
        return backer(files[0])(files[0])
    return {f"{p.stem} | {k}": v for p in files for k, v in backer(p)(p).items()}


def quantity(found: Quantities, name: str) -> float:
    """The one quantity ``name`` names: each " | " part of it begins the same part of the
    quantity's name, and an exact part wins over a longer one."""
    parts = name.split(" | ")
    candidates = []
    for key in found:
        key_parts = key.split(" | ")
        if len(key_parts) == len(parts) and all(
            k.startswith(p) for k, p in zip(key_parts, parts, strict=True)
        ):
            exact = sum(k == p for k, p in zip(key_parts, parts, strict=True))
            candidates.append((exact, key))
    best = max((exact for exact, _ in candidates), default=-1)
    keys = [key for exact, key in candidates if exact == best]
    assert len(keys) == 1, f"'{name}' names {keys or 'nothing'} of {sorted(found)}"
    return found[keys[0]]


# --- the rows of fixes.md -------------------------------------------------------------


def evidence_rows() -> list[tuple[str, str, str, list[str]]]:
    """(row, figure, measured on, links) of every row of fixes.md's evidence tables; a row is
    named by its section and its place there ("load_lock 2")."""
    rows, section, place = [], "", 0
    lines = FIXES.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section, place = line[3:].replace("`", ""), 0
        if line.startswith("| figure |"):
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                figure, where, _command, data = (c.strip() for c in row.strip("|").split(" | "))
                rows.append((f"{section} {place}", figure, where, _LINK.findall(data)))
                place += 1
    return rows


ROWS = evidence_rows()
PUBLIC = ("public thread", "public note")
# A public figure is held to its thread by test_public_record where a case records it; the
# rows of the project's own runs are held to their files here.
FILE_ROWS = [r for r in ROWS if not r[2].startswith(PUBLIC)]

# What each figure of a row is, in the order the row writes them: the quantity of its file
# (see the readers above) it states. A tuple names quantities that must all read so ("each").
LEGACY_OFF, LEGACY_AUTO = "0.21 legacy, lock off", "0.21 legacy, lock auto"
FP32, INT4 = "bf16 checkpoint, --dtype float32", "stand-in int4 (host staging)"
TP = [f"kv-headroom-h200-tp{n} | " for n in (2, 4, 8)]
TINY, SPARSE = "tiny model, this host (vLLM's CPU backend)", "sparse 27B BF16, sysroot"
QUANTITIES: dict[str, list[str | tuple[str, ...]]] = {
    "host_release 0": [f"{case} / gc + trim | saved" for case in ("bf16", FP32, INT4)],
    "host_release 1": [
        ("bf16 | vocabulary copies", f"{INT4} | vocabulary copies"),
        f"{FP32} | vocabulary copies",
        *(f"{case} / on | saved" for case in ("bf16", FP32, INT4)),
    ],
    "load_lock 0": [
        f"{LEGACY_OFF} | summed",
        f"{LEGACY_AUTO} | summed",
        f"{LEGACY_AUTO} | median vs",
        f"{LEGACY_OFF} | start-up s",
        f"{LEGACY_AUTO} | start-up s",
    ],
    "load_lock 1": [
        f"1: {LEGACY_OFF} | summed",
        f"1: {LEGACY_AUTO} | summed",
        f"1: {LEGACY_AUTO} | median vs",
        f"1: {LEGACY_OFF} | start-up s",
        f"1: {LEGACY_AUTO} | start-up s",
        f"1: {LEGACY_AUTO} | start-up vs",
    ],
    "load_lock 2": [
        f"{LEGACY_OFF} | summed",
        f"{LEGACY_AUTO}, tight room | summed",
        f"{LEGACY_AUTO}, tight room | median vs",
    ],
    "warmup_lock 0": [
        "lock off, shared cache | summed growth",
        "lock on, shared cache | summed growth",
        "kept less",
        "kept, lock off",
        "kept, waiting",
        "lock off, shared cache | wall s",
        "lock on, shared cache | wall s",
    ],
    "warmup_lock 1": [
        "lock off, per-rank caches | summed growth",
        "lock on, per-rank caches | summed growth",
        "lock off, per-rank caches | wall s",
        "lock on, per-rank caches | wall s",
    ],
    "kv_headroom 0": [
        "lowest ratio",
        "highest ratio",
        "shapes in bounds",
        "shapes",
        "first call outside torch MiB",
    ],
    "kv_headroom 1": [
        tuple(f"{tp}shapes in bounds" for tp in TP),
        tuple(f"{tp}shapes" for tp in TP),
        tuple(f"{tp}highest ratio" for tp in TP[1:]),
    ],
    "kv_headroom 2": [
        "reserve MiB",
        "reserve % of the KV cache",
        "KV cache GiB",
        "utilisation",
        "worked around at",
        "workaround GiB",
        "workaround % of the KV cache",
        "burst GiB, triton",
        "burst GiB, sort",
    ],
    "device_quant 0": [
        "recordings",
        *(f"{recording} | group" for recording in ("branch-v1.0-g64", "pr334-6arg-g32")),
        *(f"pr334-6arg-g{group} | group" for group in (64, 128)),
        "all | identical cases",
        "all | cases",
        "all | words",
        "all | differing",
    ],
    "device_quant 1": [("2: branch-v1.0-g64 | packed words", "2: pr334-6arg-g64 | packed words")],
    "device_quant 2": ["identical cases", "cases", "mismatching cases"],
    "device_quant 3": ["lowest speed-up", "highest speed-up"],
    "device_quant 4": ["mlp down | stand-in / library", "gdn in_proj_qkvz | stand-in / library"],
    "device_quant 5": ["lowest share", "highest share"],
    "device_quant 6": [
        ("streaming | identical", "legacy | identical"),
        ("streaming | layers", "legacy | layers"),
        "host path, streaming | host peak",
        "host path, legacy | host peak",
        "streaming | speed-up",
        "legacy | speed-up",
    ],
    "preflight 0": [
        f"{TINY} | added",
        f"{SPARSE}: 1x Arc Pro B70 32 GiB | added",
        "sparse 27B BF16, TP 8, sysroot: 1,000x | added",
        f"{SPARSE}: 1x B70, 64 MiB dpkg status | added",
    ],
    "preflight 1": ["TINY | ratio", "SMALL | ratio", "ONE_B | ratio"],
    "doctor's assumptions 0": [
        "worker at start | RSS",
        "worker / process start | RssAnon",
        "instance at ready less its KV cache",
    ],
    "doctor's assumptions 1": [
        "doctor, vLLM's parser | median s",
        "import vllm.engine.arg_utils | median s",
        "doctor, its own parser | median s",
        "doctor, vLLM's parser | median peak",
        "doctor, its own parser | median peak",
    ],
}


def test_fixes_md_has_a_table_for_every_fix():
    from vllm_xpu_memfix.core import config

    sections = {row.rsplit(" ", 1)[0] for row, *_ in ROWS}
    assert {fix.key for fix in config.FIXES} - {"ledger"} <= sections, sections
    assert len(FILE_ROWS) >= 15, "the rows that link data went missing"


def test_fixes_md_states_the_warm_ups_memory_outside_torch_as_doctor_and_kv_headroom_take_it():
    """One home for the figure doctor.md no longer states: doctor's assumption and the slack
    kv_headroom keeps for the same unknown, as the code has them."""
    from vllm_xpu_memfix.startup import phases, reserve

    section = FIXES.read_text().split("## `doctor`'s assumptions")[1].split("\n|")[0]
    assert f"{phases.WARMUP_OUTSIDE_TORCH / MiB:g} MiB a rank" in section
    assert f"{reserve.DEFAULT_SLACK / MiB:g} MiB slack" in section


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r[0]}: {r[1][:40]}")
def test_each_row_says_where_it_was_measured_and_links_its_data(row):
    _name, figure, where, links = row
    assert where.startswith(PLACES), f"'{where[:40]}...' names none of {PLACES}"
    assert links, f"no data, results file or thread linked for: {figure}"
    for link in links:
        if link.startswith("https:") or where.startswith(PUBLIC):
            assert where.startswith(PUBLIC), f"{link}: a thread is only a public figure's data"
        else:
            assert (FIXES.parent / link).exists(), link


def test_every_row_that_links_a_file_names_its_quantities():
    assert sorted(QUANTITIES) == sorted(name for name, *_ in FILE_ROWS)


def unread(figure: str, names: list[str | tuple[str, ...]], found: Quantities) -> list[str]:
    """The figures of ``figure`` that are not, at their precision, the quantity named."""
    tokens = numbers(figure)
    assert len(tokens) == len(names), f"{len(tokens)} figures {tokens}, {len(names)} named"
    wrong = []
    for token, named in zip(tokens, names, strict=True):
        for name in (named,) if isinstance(named, str) else named:
            if not matches(token, [quantity(found, name)]):
                wrong.append(f"{token} is not {name} ({quantity(found, name):,.4g})")
    return wrong


@pytest.mark.parametrize("row", FILE_ROWS, ids=lambda r: f"{r[0]}: {r[1][:40]}")
def test_every_figure_of_a_row_is_its_quantity_in_its_file(row):
    name, figure, _where, links = row
    files = [(FIXES.parent / link).resolve() for link in links if not link.startswith("https:")]
    assert numbers(figure), f"a row linking data states no figure: {figure}"
    wrong = unread(figure, QUANTITIES[name], row_quantities(files))
    assert wrong == [], f"{name}, from {[p.name for p in files]}: {wrong}"


def test_a_figure_is_held_to_its_own_quantity_not_to_an_equal_number():
    """The check is not vacuous: 0.69 and 2,891 are lock auto's ratio and lock off's peak in
    the load-lock results; written for each other's quantity, or drifted, they fail."""
    found = results_quantities(ROOT / "benchmarks" / "results" / "load-lock-2026-12-03.md")
    names: list[str | tuple[str, ...]] = [f"{LEGACY_AUTO} | median vs", f"{LEGACY_OFF} | summed"]
    assert unread("0.69 and 2,891", names, found) == []
    assert len(unread("0.71 and 2,890", names, found)) == 2
    assert len(unread("1,983 and 0.69", [f"{LEGACY_OFF} | summed", names[0]], found)) == 1
    with pytest.raises(AssertionError, match="names"):
        quantity(found, "0.21 legacy | summed")  # lock off's or lock auto's: ambiguous


# --- every figure of the user docs has its home ---------------------------------------

_FIGURE = re.compile(
    r"(?<![\w.#])(\d[\d,]*(?:\.\d+)?)\s?(MiB|GiB|KiB|GB|MB|ms|s\b|\N{MULTIPLICATION SIGN}|%)"
)


def figures(text: str) -> list[str]:
    """Numbers with a unit of memory, time, ratio or share, code left out."""
    prose = re.sub(r"`[^`]*`", "", text)
    return [f"{m.group(1)} {m.group(2)}" for m in _FIGURE.finditer(prose)]


def _settings() -> dict[tuple[str, str], float]:
    """Figures that are the code's own settings and limits, not measurements: each is held
    to the value the code has."""
    import inspect

    from vllm_xpu_memfix.cli import monitor
    from vllm_xpu_memfix.cli.demo import server
    from vllm_xpu_memfix.cli.doctor import deadline, hostfile, serveline
    from vllm_xpu_memfix.fixes import preflight
    from vllm_xpu_memfix.intel import catalog
    from vllm_xpu_memfix.startup import phases

    (a770,) = (g for g in catalog.GPU_MODELS if g.name == "Arc A770")
    interval = inspect.signature(monitor.sample_to_csv).parameters["interval"].default
    return {
        ("doctor.md", "85 %"): 100 * phases.AT_RISK_SHARE,
        ("doctor.md", "98 %"): 100 * phases.DEVICE_AT_RISK_SHARE,
        ("doctor.md", "3.5 GiB"): phases.BASELINE_PER_RANK / GiB,
        ("doctor.md", "1 MiB"): hostfile.HOST_FILE_CAP / MiB,
        ("doctor.md", "20 GiB"): (serveline._human("20G") or 0) / GiB,  # how "20G" reads
        ("doctor.md", "8 GB"): value(re.findall(r"(\d+) GB A770", a770.note)[0]),
        ("doctor.md", "30 s"): deadline.DEFAULT_S,
        ("doctor.md", "5 s"): preflight.HUB_DEADLINE,
        ("ledger.md", "1 GiB"): value(server.CPU_DEFAULT_ENV["VLLM_CPU_KVCACHE_SPACE"]),
        ("ledger.md", "0.5 s"): interval,
    }


def homeless(doc: Path) -> list[str]:
    """The figures of ``doc`` with no home: not written, with its unit, in a figure cell of
    fixes.md's evidence tables, not in a paragraph, list item or table row that links to
    fixes.md, and not a setting of the code."""
    held = {f for _row, figure, *_ in ROWS for f in figures(figure)}
    settings = _settings()
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    missing = []
    for block in re.split(r"\n\s*\n|\n(?=\s*[-|] )", text):
        if "fixes.md" in block:
            continue
        for figure in figures(block):
            setting = settings.get((doc.name, figure))
            if figure not in held and not (setting and matches(figure.split()[0], [setting])):
                missing.append(figure)
    return missing


USER_DOCS = [README, *(ROOT / "docs" / n for n in sorted(test_docs.USER_DOCS))]


@pytest.mark.parametrize(
    "doc",
    [d for d in USER_DOCS if d.name not in ("fixes.md", "compat.md")],  # the home; generated
    ids=lambda d: str(d.relative_to(ROOT)),
)
def test_every_figure_of_the_user_docs_has_its_home(doc):
    assert homeless(doc) == [], f"{doc.relative_to(ROOT)}: figures without a home in fixes.md"


def test_a_figure_without_a_home_is_seen(tmp_path):
    page = tmp_path / "guide.md"
    page.write_text(
        "It saves 127 MiB (`malloc_trim(0)`).\n\nIt saves 128 MiB.\n\n"
        "- 3 GiB, [see](fixes.md#host_release)\n- 0.71\N{MULTIPLICATION SIGN} faster\n"
    )
    assert homeless(page) == ["128 MiB", "0.71 \N{MULTIPLICATION SIGN}"]


# --- the claims that lean on a public thread, held to what its record states -----------


def recorded_runtimes(thread: str) -> list[str | None]:
    """The compute-runtime each public-record case of ``thread`` ("llm-scaler #703") states,
    None where the thread states none."""
    repository, number = thread.split(" #")
    runtimes = []
    for case, data in serve_line_cases():
        if data["thread"]["url"].endswith(f"/{repository}/issues/{number}"):
            host = tomllib.loads((case / "host.toml").read_text())
            runtimes.append(host.get("driver", {}).get("compute_runtime"))
    return runtimes


def cited(text: str) -> list[str]:
    """The threads a text cites in parentheses: "(compute-runtime #953, #980; vllm #50269)"."""
    threads = []
    for group in re.findall(r"([\w-]+) (#\d+(?:, #\d+)*)", text):
        threads += [f"{group[0]} #{n}" for n in re.findall(r"#(\d+)", group[1])]
    return threads


def without_an_affected_runtime(text: str) -> list[str]:
    """The threads ``text`` cites whose public-record cases state no compute-runtime that
    pins the host copy (threads the record does not hold are not judged here)."""
    from vllm_xpu_memfix.intel import driver_facts as facts

    unsupported = []
    for thread in cited(text):
        runtimes = recorded_runtimes(thread)
        releases = [facts.parse_release(r) for r in runtimes if r]
        if runtimes and not any(r and r >= facts.HOST_COPY_FROM for r in releases):
            unsupported.append(thread)
    return unsupported


def test_the_host_copy_is_cited_only_from_threads_that_state_an_affected_runtime():
    """#703 names no compute-runtime, so it is no evidence of the driver's pinned copy (issue
    47's audit): each thread the cause cites that the record holds states one from 26.09."""
    from vllm_xpu_memfix.startup import codes

    said = codes.CAUSES[codes.DRIVER_HOST_COPY]
    assert cited(said) and without_an_affected_runtime(said) == []
    before = "(compute-runtime #953, #980; vllm #50269; llm-scaler #703)"
    assert without_an_affected_runtime(before) == ["llm-scaler #703"]


def test_a_row_whose_thread_states_no_runtime_says_so():
    """Where the record of a row's thread states no compute-runtime, the row says so: a
    reader must not take it for evidence of the driver's pinned copy (#703's row)."""
    rows = [(where, link) for name, _f, where, links in ROWS for link in links]
    silent = []
    for where, link in rows:
        match = re.search(r"github\.com/[\w-]+/([\w-]+)/issues/(\d+)", link)
        runtimes = recorded_runtimes(f"{match[1]} #{match[2]}") if match else []
        if runtimes and not any(runtimes) and "no compute-runtime" not in where:
            silent.append(link)
    assert recorded_runtimes("llm-scaler #703") == [None, None]
    assert silent == []


# --- the upstream series: each figure from its run, each run of the change as it is -----

UPSTREAM = ROOT / "docs" / "upstream"
RESULTS = ROOT / "benchmarks" / "results"
_DIGEST = re.compile(r"`(docs/upstream/patches/\S+\.patch)`.*?diff sha256 `([0-9a-f]{12})`", re.S)


def upstream_check():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import upstream_check

    return upstream_check


def stale_runs(results: list[Path]) -> list[str]:
    """The results files whose recorded patch digest is not the patch's diff as it is now."""
    stale = []
    for path in results:
        for patch, digest in _DIGEST.findall(path.read_text()):
            now = upstream_check().diff_digest(ROOT / patch)
            if now != digest:
                stale.append(f"{path.name}: {patch} was {digest}, is {now}")
    return stale


def unbacked(text: str, results: list[Path]) -> list[str]:
    """The figures of ``text`` (numbers with a unit, and the numbers of its indented
    tables) that no number of the ``results`` files is, at the precision written."""
    table = "\n".join(line for line in text.splitlines() if re.match(r" {4}\S", line))
    written = [f.split()[0] for f in figures(text)] + numbers(table)
    held = [value(n) for path in results for n in numbers(path.read_text())]
    return [token for token in written if not matches(token, held)]


def upstream_blocks() -> list[tuple[str, str, list[Path]]]:
    """(doc, block, results files it links) for each block of docs/upstream that states a
    figure with a unit."""
    found = []
    for doc in sorted(UPSTREAM.glob("*.md")):
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for block in re.split(r"\n\s*\n|\n(?=\s*[-|] )", text):
            links = [(UPSTREAM / link).resolve() for link in _LINK.findall(block)]
            if figures(block):
                found.append((doc.name, block, [p for p in links if p.parent == RESULTS]))
    return found


@pytest.mark.parametrize("block", upstream_blocks(), ids=lambda b: f"{b[0]}: {b[1][:30]}")
def test_every_figure_of_the_upstream_texts_is_a_number_of_the_run_it_links(block):
    """A figure of docs/upstream sits beside the results file it comes from, or beside
    docs/fixes.md (which holds it), or is a public thread's (a #number cited)."""
    doc, text, results = block
    if results:
        assert unbacked(text, results) == [], f"{doc}: not in {[p.name for p in results]}"
    elif "fixes.md" in text:
        held = {f for _row, figure, *_ in ROWS for f in figures(figure)}
        assert set(figures(text)) <= held, f"{doc}: {set(figures(text)) - held} not in fixes.md"
    else:
        assert re.search(r"#\d+", text), f"{doc}: {figures(text)} with no run, fixes.md or thread"


def sent_patches() -> list[tuple[Path, Path]]:
    """Each patch of the series, with the results file the series' README links in its row."""
    readme = (UPSTREAM / "README.md").read_text()
    pairs = []
    for patch in sorted((UPSTREAM / "patches").glob("*.patch")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| [{patch.name[:4]}]"))
        (run,) = [link for link in _LINK.findall(row) if "benchmarks/results/" in link]
        pairs.append((patch, (UPSTREAM / run).resolve()))
    return pairs


@pytest.mark.parametrize("pair", sent_patches(), ids=lambda p: p[0].name[:4])
def test_a_patch_message_states_its_run_s_figures_and_its_run_is_of_the_patch_as_it_is(pair):
    patch, results = pair
    message = patch.read_text().split("\n---\n", 1)[0]
    assert unbacked(message, [results]) == [], f"{patch.name}: figures not in {results.name}"
    assert _DIGEST.search(results.read_text()), f"{results.name} records no patch digest"
    assert stale_runs([results]) == [], "the change moved since its run: measure it again"


def test_a_run_of_an_earlier_patch_and_a_figure_past_its_file_are_seen(tmp_path):
    (_patch, results), *_ = sent_patches()
    (name, digest), *_ = _DIGEST.findall(results.read_text())
    earlier = tmp_path / results.name
    earlier.write_text(results.read_text().replace(digest, "0" * 12))
    assert stale_runs([earlier]) == [f"{results.name}: {name} was {'0' * 12}, is {digest}"]
    usage = quantity(results_quantities(results), "as is | cgroup usage")
    table = f"usage 1,234.5 MiB\n\n    as is  {usage:,.1f}  12,345\n"
    assert unbacked(table, [results]) == ["1,234.5", "12,345"]
