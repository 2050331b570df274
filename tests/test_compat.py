"""Static target scan on the installed vLLM and on synthetic source trees."""

import functools
import itertools
from pathlib import Path

import pytest

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.cli import compat, main
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.vllm_code import overrides


@pytest.fixture
def vllm_root() -> Path:
    root = compat.installed_vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    return root


def test_every_shipped_patch_target_exists_in_the_test_bed(vllm_root):
    for patch in fixes.all_patches():
        status = compat.target_status(vllm_root, patch.target)
        if patch.own_only:  # a platform worker's own version, where it has one
            assert status in (compat.PRESENT, f"missing: {patch.attr_path}"), patch.target
            continue
        if patch.module in compat.INTEL_IMAGE_MODULES and "missing: module" in status:
            # only where the sym_int4 replay (tests/plugins/sym_int4_replay) is not installed
            assert status.endswith("(Intel's images only)"), patch.target
        else:
            assert status == compat.PRESENT, patch.target


def test_missing_module_and_attribute_are_named(vllm_root):
    assert (
        compat.target_status(vllm_root, "vllm.no_such_module:f")
        == "missing: module vllm.no_such_module"
    )
    assert (
        compat.target_status(vllm_root, "vllm.v1.worker.gpu_worker:Worker.no_such_method")
        == "missing: Worker.no_such_method"
    )


def write_module(root: Path, source: str) -> None:
    """``pkg.mod`` under ``root`` with ``source``: a synthetic tree to scan."""
    package = root / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(source)


def test_module_attributes_bound_by_import_count_as_present(tmp_path):
    write_module(
        tmp_path,
        "from other import qwen_warmup\nLIMIT: int = 3\n"
        "class A:\n    def f(self): ...\n    x = 1\n",
    )
    for target in ("pkg.mod:qwen_warmup", "pkg.mod:LIMIT", "pkg.mod:A.f", "pkg.mod:A.x"):
        assert compat.target_status(tmp_path, target) == compat.PRESENT, target
    assert compat.target_status(tmp_path, "pkg.mod:A.g") == "missing: A.g"


def test_a_changed_signature_is_reported(tmp_path):
    write_module(
        tmp_path,
        "def quantize(layer, bits=4): ...\n"
        "def renamed(module): ...\n"
        "class W:\n    def load(self, layer): ...\n",
    )
    assert compat.target_status(tmp_path, "pkg.mod:quantize", ("layer",)) == compat.PRESENT
    assert compat.target_status(tmp_path, "pkg.mod:W.load", ("layer",)) == compat.PRESENT
    assert compat.target_status(tmp_path, "pkg.mod:renamed", ("layer",)) == (
        "signature changed: (module); the wrapper reads (layer)"
    )


def test_shipped_parameter_expectations_hold_where_they_can_be_read(vllm_root):
    """Every patch that reads its target's arguments says which; none is changed here."""
    readers = [p for p in fixes.all_patches() if p.params]
    assert {p.fix for p in readers} == {"host_release", "device_quant", "load_lock"}
    for patch in fixes.all_patches():
        status = compat.target_status(vllm_root, patch.target, patch.params)
        assert not status.startswith("signature changed"), (patch.target, status)


def check_rows(out: str) -> dict[str, list[tuple[str, str]]]:
    """check's targets by fix: (first word, target) under each ``fix (SWITCH=value)`` line."""
    rows: dict[str, list[tuple[str, str]]] = {}
    fix = ""
    for line in out.splitlines():
        head = line.split(" (", 1)[0]
        if head in {f.key for f in config.FIXES} and "=" in line:
            fix = head
            rows[fix] = []
        elif fix and line[:2] == "  " and line[2:3] != " " and not line.startswith("  remove"):
            word, _, target = line.strip().partition(" ")
            rows[fix].append((word, target.strip()))
        elif not line.startswith(" "):
            fix = ""
    return rows


def test_check_prints_each_fix_with_switch_and_status(vllm_root, capsys, clean_env):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "ledger (VLLM_XPU_MEMFIX_LEDGER=auto)" in out.splitlines()
    rows = check_rows(out)["ledger"]
    explicit = {p.target for p in fixes.ledger.patches(config.load({}))}
    source_of = functools.partial(compat.module_source, vllm_root)
    scanned = overrides.scan(overrides.patched_worker_methods(fixes.all_patches()), source_of)
    own_versions = {f"{w}.{m}" for w, m, kind in scanned if kind != overrides.INHERITS}
    ledger_methods = {t.rpartition(".")[2] for t in explicit if t.startswith(overrides.WORKER)}
    expected = explicit | {t for t in own_versions if t.rpartition(".")[2] in ledger_methods}
    assert sorted(target for _, target in rows) == sorted(expected)
    assert ("present", "vllm.v1.worker.gpu_worker:Worker.load_model") in rows
    assert all(len(line) <= 100 for line in out.splitlines() if "/" not in line)


def test_check_evaluates_each_fix_s_removal_condition_on_the_tree(tmp_path, capsys, clean_env):
    """A tree whose base_loader trims itself: host_release's upstream change has landed."""
    loader = tmp_path / "vllm/model_executor/model_loader/base_loader.py"
    loader.parent.mkdir(parents=True)
    loader.write_text("import ctypes\nctypes.CDLL('libc.so.6').malloc_trim(0)\n")
    assert main(["check", "--source", str(tmp_path)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert (
        "gives freed host memory back (upstream patch 0002): landed ('malloc_trim' in "
        "vllm.model_executor.model_loader.base_loader)" in text
    )
    assert "keeps the sampler burst out of the KV cache itself (upstream RFC 0003): " in text
    assert "(upstream RFC 0003): vllm.v1.worker.gpu_worker absent" in text


def test_check_passes_strict_where_a_release_has_one_target_of_a_group(tmp_path, capsys, clean_env):
    """The at-ready hook's two places: a tree with either passes, with neither fails; an
    optional warm-up a release lacks is shown, not counted."""
    from vllm_xpu_memfix.startup import prediction_check

    defs: dict[str, dict[str, list[str]]] = {}  # module -> class ("" for none) -> defs
    for patch in fixes.all_patches():
        if patch.module in compat.INTEL_IMAGE_MODULES or patch.own_only:
            continue
        owner, _, method = patch.attr_path.rpartition(".")
        params = ", ".join(["self", *patch.params] if owner else patch.params)
        indent = "    " if owner else ""
        by_class = defs.setdefault(patch.module, {})
        by_class.setdefault(owner, []).append(f"{indent}def {method}({params}): ...\n")
    for module, by_class in defs.items():
        path = tmp_path / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join((f"class {c}:\n" if c else "") + "".join(d) for c, d in by_class.items())
        )
    new, old = prediction_check.READY_TARGETS
    new_file = tmp_path / (new.partition(":")[0].replace(".", "/") + ".py")
    old_file = tmp_path / (old.partition(":")[0].replace(".", "/") + ".py")
    warm_ups = tmp_path / "vllm/model_executor/warmup/kernel_warmup.py"
    warm_ups.write_text("def qwen_triton_warmup(): ...\n")
    assert main(["check", "--source", str(tmp_path), "--strict"]) == 0
    rows = check_rows(capsys.readouterr().out)
    assert ("present", new) in rows["preflight"] and ("present", old) in rows["preflight"]
    assert ("absent", "vllm.model_executor.warmup.kernel_warmup:mamba_triton_warmup") in rows[
        "warmup_lock"
    ]
    new_file.unlink()
    assert main(["check", "--source", str(tmp_path), "--strict"]) == 0
    out = capsys.readouterr().out
    assert ("absent", new) in check_rows(out)["preflight"]
    assert f"this release has it at {old}" in " ".join(out.split())
    old_file.unlink()
    assert main(["check", "--source", str(tmp_path), "--strict"]) == 1
    rows = check_rows(capsys.readouterr().out)
    assert ("missing", new) in rows["preflight"] and ("missing", old) in rows["preflight"]


def test_check_strict_fails_on_a_tree_without_the_targets(tmp_path, capsys, clean_env):
    (tmp_path / "vllm").mkdir()
    assert main(["check", "--source", str(tmp_path), "--strict"]) == 1
    assert "missing: module vllm.v1.worker.gpu_worker" in capsys.readouterr().out


def test_check_reports_the_last_device_quant_self_check(tmp_path, capsys, clean_env, monkeypatch):
    from vllm_xpu_memfix.intel import int4_self_check

    locks = tmp_path / "locks"
    (tmp_path / "vllm").mkdir()
    monkeypatch.setenv("VLLM_XPU_MEMFIX_LOCK_DIR", str(locks))

    def line() -> str:
        assert main(["check", "--source", str(tmp_path)]) == 0
        rows = capsys.readouterr().out.splitlines()
        at = next(i for i, row in enumerate(rows) if row.startswith("device_quant self-check:"))
        more = itertools.takewhile(lambda row: row.startswith("    "), rows[at + 1 :])
        return " ".join([rows[at], *(row.strip() for row in more)])  # wrapped at 100

    assert "none recorded yet" in line()
    found = int4_self_check.Comparison("near-tie probe 60x128 bf16", 960, 37, 0)
    outcome = int4_self_check.SelfCheck("xpu:0", "a library", [found], "differs in 37 of 960")
    int4_self_check.write_record(locks, outcome.record())
    assert "(pid" in line() and "host path kept: differs in 37 of 960" in line()
    (locks / int4_self_check.RECORD).write_text("{not json")
    assert "unreadable (JSONDecodeError)" in line()


def matrix_rows(column: str) -> dict[tuple[str, str], str]:
    """docs/compat.md's per-target table: (fix, target) -> the cell of ``column``."""
    lines = (Path(__file__).parent.parent / "docs" / "compat.md").read_text().splitlines()
    at = lines.index(next(line for line in lines if line.startswith("| fix | target |")))
    header = [cell.strip() for cell in lines[at].strip("|").split("|")]
    rows: dict[tuple[str, str], str] = {}
    for line in itertools.takewhile(lambda row: row.startswith("|"), lines[at + 2 :]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[(cells[0].strip("`"), cells[1].strip("`"))] = cells[header.index(column)]
    return rows


def test_the_compat_matrix_rows_are_check_s_targets_on_the_test_bed(vllm_root):
    """The matrix (benchmarks/compat_matrix.py) was made with check's own scan: its test
    bed column lists exactly the targets check lists here, with the same outcome."""
    from vllm_xpu_memfix.cli import check

    settings = config.load({})
    own = {
        f"{w}.{m}"
        for w, m, kind in check.platform_overrides(vllm_root, settings)
        if kind != overrides.INHERITS
    }
    found = check.targets(vllm_root, settings, own, lambda read: read())
    rows = {key: cell for key, cell in matrix_rows("test bed").items() if cell != "-"}
    assert set(rows) == {(t.fix, t.target) for t in found}
    for target in found:
        assert (rows[(target.fix, target.target)] == "✓") == (target.word == check.PRESENT)
    assert {p.fix for p in fixes.all_patches()} <= {fix for fix, _ in rows}


@pytest.mark.parametrize("release", ["0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.34.0"])
def test_the_matrix_has_no_missing_target_on_a_claimed_release(release):
    """What check --strict counts (a MISSING cell) is on no release the README claims;
    make upstream-check runs check --strict on 0.26.0's and 0.34.0's own source."""
    rows = matrix_rows(release)
    assert rows and not [key for key, cell in rows.items() if cell.startswith("MISSING")]
    ready = [cell for (fix, target), cell in rows.items() if target.endswith(":build_and_serve")]
    assert "✓" in ready


READY_RECORD = Path(__file__).parent / "data" / "ready_hook.json"
RELEASE_CACHE = Path(__file__).parent.parent / ".cache" / "upstream"  # make upstream-check's


def test_the_0_26_ready_hook_is_where_0_26_0_defines_and_calls_build_and_serve():
    """Recorded from the 0.26.0 to 0.28.0 wheels (tests/data/ready_hook.json): the module
    and function the older of the two ready targets names; the newer one's package is not
    in 0.26.0."""
    import json

    from vllm_xpu_memfix.startup import prediction_check

    newer, older = prediction_check.READY_TARGETS
    record = json.loads(READY_RECORD.read_text())["releases"]
    module, _, function = older.partition(":")
    for release in ("0.26.0", "0.27.0", "0.27.1", "0.28.0"):
        assert record[release]["file"] == module.replace(".", "/") + ".py"
        assert record[release]["defined"]["text"] == f"async def {function}("
        assert f"await {function}(" in record[release]["called"]["text"]
    first = record["0.26.0"]
    assert first["engine_client"]["line"] < first["called"]["line"]
    assert first["absent"].startswith("/".join(newer.split(".")[:3]) + "/")


@pytest.mark.skipif(
    not (RELEASE_CACHE / "vllm-0.26.0" / ".complete").is_file(),
    reason="vLLM 0.26.0's source is fetched by make upstream-check (.cache/upstream)",
)
def test_the_0_26_ready_hook_in_0_26_0_s_own_source():
    """The wheel make upstream-check fetched is the one recorded, and its source has the
    older ready target, not the newer."""
    import hashlib
    import json

    from vllm_xpu_memfix.startup import prediction_check

    root = RELEASE_CACHE / "vllm-0.26.0"
    first = json.loads(READY_RECORD.read_text())["releases"]["0.26.0"]
    assert first["wheel_sha256"] in (root / ".complete").read_text()
    source = (root / first["file"]).read_bytes()
    assert hashlib.sha256(source).hexdigest() == first["file_sha256"]
    lines = source.decode().splitlines()
    for key in ("defined", "engine_client", "called"):
        assert lines[first[key]["line"] - 1] == first[key]["text"]
    newer, older = prediction_check.READY_TARGETS
    assert compat.target_status(root, older) == compat.PRESENT
    assert compat.target_status(root, newer).startswith("missing: module")
