"""scripts/upstream_check.py on a stand-in ``vllm`` package: the ways a patch can fail,
a release's variants, the attribute check, the release cache, and vLLM's own tests run
before and after the series.

The real series is checked by ``make upstream-check``; these cases only need a
package named ``vllm`` to copy, patch and import, so they take a second.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import upstream_check

ADD_TEST = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] {subject}

---
diff --git a/tests/test_{name}.py b/tests/test_{name}.py
new file mode 100644
--- /dev/null
+++ b/tests/test_{name}.py
@@ -0,0 +1,5 @@
+import vllm.answer
+
+
+def test_answer():
+    assert vllm.answer.VALUE == {expected}
"""

CHANGE_VALUE = """\
diff --git a/vllm/answer.py b/vllm/answer.py
--- a/vllm/answer.py
+++ b/vllm/answer.py
@@ -1 +1 @@
-VALUE = {old}
+VALUE = {new}
"""


@pytest.fixture
def source(tmp_path: Path) -> Path:
    package = tmp_path / "src" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "answer.py").write_text("VALUE = 41\n")
    (package / "data.bin").write_bytes(b"\0")
    (package / "_version.py").write_text("__version__ = version = '0.1.0'\n")
    return tmp_path / "src"


def write_patch(directory: Path, name: str, old: int, new: int, expected: int) -> None:
    text = ADD_TEST.format(subject=name, name=name.replace("-", "_"), expected=expected)
    (directory / f"{name}.patch").write_text(text + CHANGE_VALUE.format(old=old, new=new))


def run(tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    patches = tmp_path / "patches"
    code = upstream_check.main(["--patches", str(patches), "--vllm-src", str(source)])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def patches(tmp_path: Path) -> Path:
    directory = tmp_path / "patches"
    directory.mkdir()
    return directory


def test_a_series_that_applies_and_passes(tmp_path, source, patches, capsys):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    code, out = run(tmp_path, source, capsys)
    assert code == 0, out
    assert "0001-fix.patch (alone): applied, tests in the series" in out
    assert "0001-fix.patch (series): applied, tests passed" in out
    assert (source / "vllm" / "answer.py").read_text() == "VALUE = 41\n"  # copy, not source


def test_a_patch_that_no_longer_applies_is_named(tmp_path, source, patches, capsys):
    write_patch(patches, "0001-stale", old=40, new=42, expected=42)
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-stale.patch (series): DOES NOT APPLY" in out
    assert "FAILED: 0001-stale.patch (alone) on vLLM 0.1.0, 0001-stale.patch (series)" in out


def test_a_patch_whose_tests_fail_is_named(tmp_path, source, patches, capsys):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    write_patch(patches, "0002-wrong", old=42, new=43, expected=44)
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-fix.patch (series): applied, tests failed" in out  # 0002 changed what it tests
    assert "0002-wrong.patch (series): applied, tests failed" in out
    # 0002 edits 0001's line: it does not apply to the release by itself
    assert "0002-wrong.patch (alone): DOES NOT APPLY" in out
    assert (
        "FAILED: 0002-wrong.patch (alone) on vLLM 0.1.0, 0001-fix.patch (series) on vLLM 0.1.0,"
        " 0002-wrong.patch (series) on vLLM 0.1.0" in out
    )


def test_a_patch_without_tests_fails(tmp_path, source, patches, capsys):
    (patches / "0001-untested.patch").write_text(CHANGE_VALUE.format(old=41, new=42))
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-untested.patch (series): applied, no tests (FAIL)" in out


def test_a_release_variant_replaces_its_patch_for_that_release_only(tmp_path, source, patches):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    variants = patches / "v0.1.0"
    variants.mkdir()
    write_patch(variants, "0001-fix", old=41, new=43, expected=43)
    assert upstream_check.series("0.1.0+cpu", patches) == [variants / "0001-fix.patch"]
    assert upstream_check.series("0.2.0", patches) == [patches / "0001-fix.patch"]
    assert upstream_check.main(["--patches", str(patches), "--vllm-src", str(source)]) == 0


def test_a_variant_of_no_patch_is_refused(tmp_path, patches):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    (patches / "v0.1.0").mkdir()
    write_patch(patches / "v0.1.0", "0002-orphan", old=41, new=42, expected=42)
    with pytest.raises(SystemExit, match=r"0002-orphan\.patch replaces no patch"):
        upstream_check.series("0.1.0", patches)


BASE = """\
from vllm.base import Base

VALUE = 41

class Answer(Base):
    def __init__(self):
        self.kept = 1
"""
READ_IN_METHOD = """\
diff --git a/vllm/answer.py b/vllm/answer.py
--- a/vllm/answer.py
+++ b/vllm/answer.py
@@ -7 +7,4 @@ class Answer(Base):
         self.kept = 1
+
+    def read(self):
+        return self.{name}
"""


@pytest.mark.parametrize(
    "name, missing",
    [
        ("kept", False),  # assigned in the class
        ("from_base", False),  # assigned in a base class of another module
        ("size", False),  # a property of the base
        ("read", False),  # a method
        ("absent", True),
    ],
)
def test_every_self_attribute_a_patch_reads_must_exist(source, tmp_path, name, missing):
    (source / "vllm" / "base.py").write_text(
        "class Base:\n    def __init__(self):\n        self.from_base = 0\n\n"
        "    @property\n    def size(self):\n        return 1\n"
    )
    (source / "vllm" / "answer.py").write_text(BASE)
    tree = tmp_path / "tree"
    upstream_check.copy_package(source, tree)
    patch = tmp_path / "read.patch"
    patch.write_text(READ_IN_METHOD.format(name=name))
    assert upstream_check.apply(patch, tree) is None
    found = upstream_check.undefined_self_reads(patch.read_text(), tree)
    assert found == (["Answer.self.absent"] if missing else [])


def test_a_patch_reading_a_missing_attribute_fails(tmp_path, source, patches, capsys):
    (source / "vllm" / "answer.py").write_text(BASE)
    patch = ADD_TEST.format(subject="reads", name="reads", expected=41)
    patch += READ_IN_METHOD.format(name="use_v2_model_runner")
    (patches / "0001-reads.patch").write_text(patch)
    (source / "vllm" / "base.py").write_text("class Base:\n    pass\n")
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "READS MISSING Answer.self.use_v2_model_runner (FAIL), tests passed" in out


def test_the_release_comes_from_its_wheel_once(tmp_path, monkeypatch):
    calls = []

    def pip_download(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        with zipfile.ZipFile(dest / "vllm-9.9.9-cp38-abi3-linux_x86_64.whl", "w") as wheel:
            for name in ("vllm/__init__.py", "vllm/configs/a.json", "vllm/_C.abi3.so"):
                wheel.writestr(name, "")
            wheel.writestr("vllm-9.9.9.dist-info/METADATA", "")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(upstream_check.subprocess, "run", pip_download)
    source = upstream_check.fetch_release("9.9.9", tmp_path / "cache")
    assert source == tmp_path / "cache" / "vllm-9.9.9"
    kept = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_file())
    assert kept == [".complete", "vllm/__init__.py", "vllm/configs/a.json"]
    assert "vllm==9.9.9" in calls[0]
    assert upstream_check.fetch_release("9.9.9", tmp_path / "cache") == source
    assert len(calls) == 1  # the second run is offline


def test_the_installed_build_lends_the_compiled_parts_a_release_lacks(tmp_path, source):
    installed = tmp_path / "installed"
    (installed / "vllm").mkdir(parents=True)
    for name in ("_C.abi3.so", "answer.py"):
        (installed / "vllm" / name).write_text("")
    (source / "vllm" / "own.abi3.so").write_text("")
    tree = tmp_path / "tree"
    upstream_check.copy_package(source, tree, compiled_from=installed)
    assert (tree / "vllm" / "_C.abi3.so").resolve() == installed / "vllm" / "_C.abi3.so"
    assert (tree / "vllm" / "own.abi3.so").resolve() == source / "vllm" / "own.abi3.so"
    assert (tree / "vllm" / "answer.py").read_text() == "VALUE = 41\n"


EXISTING_TEST = """\
import vllm.answer


def test_value_is_41():
    assert vllm.answer.VALUE == 41


def test_always():
    pass
"""


@pytest.fixture
def vllm_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A release's own tests as ``fetch_vllm_tests`` keeps them: one file of two tests."""
    directory = tmp_path / "vllm-tests"
    (directory / "tests").mkdir(parents=True)
    (directory / "site").mkdir()
    (directory / "tests" / "test_existing.py").write_text(EXISTING_TEST)
    monkeypatch.setattr(upstream_check, "VLLM_TESTS", ("tests/test_existing.py",))
    return directory


def run_with_vllm_tests(tmp_path, source, vllm_tests, capsys) -> tuple[int, str]:
    argv = ["--patches", str(tmp_path / "patches"), "--vllm-src", str(source)]
    code = upstream_check.main([*argv, "--vllm-tests", str(vllm_tests)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_vllm_test_the_series_breaks_fails_the_check(
    tmp_path, source, patches, vllm_tests, capsys
):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    code, out = run_with_vllm_tests(tmp_path, source, vllm_tests, capsys)
    assert code == 1
    assert "0001-fix.patch (alone): applied, tests in the series" in out
    assert "0001-fix.patch (series): applied, tests passed" in out
    broken = "BROKEN BY THE SERIES: tests/test_existing.py::test_value_is_41"
    assert f"2 passed as is, 1 patched, {broken}" in out


def test_vllm_tests_that_still_pass_pass_the_check(tmp_path, source, patches, vllm_tests, capsys):
    (patches / "0001-test.patch").write_text(ADD_TEST.format(subject="t", name="t", expected=41))
    code, out = run_with_vllm_tests(tmp_path, source, vllm_tests, capsys)
    assert code == 0, out
    assert "vLLM's tests of the touched modules: 2 passed as is, 2 patched" in out


def test_vllm_tests_come_from_the_release_sdist_once(tmp_path, monkeypatch):
    calls = []

    def pip(command, **kwargs):
        calls.append(command)
        if "download" in command:  # pip unpacks the sdist, then fails to build it
            unpacked = Path(kwargs["env"]["TMPDIR"]) / "pip-download-x" / "vllm_y"
            for name in ("tests/__init__.py", "tests/utils.py", "tests/v1/__init__.py"):
                (unpacked / name).parent.mkdir(parents=True, exist_ok=True)
                (unpacked / name).write_text("")
            (unpacked / "tests" / "v1" / "test_kept.py").write_text("")
            (unpacked / "tests" / "v1" / "test_other.py").write_text("")
            return subprocess.CompletedProcess(command, 1, "", "")
        Path(command[command.index("--target") + 1]).mkdir(parents=True)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(upstream_check.subprocess, "run", pip)
    monkeypatch.setattr(upstream_check, "VLLM_TESTS", ("tests/v1/test_kept.py",))
    kept = upstream_check.fetch_vllm_tests("9.9.9+cpu", tmp_path / "cache")
    assert kept == tmp_path / "cache" / "vllm-tests-9.9.9"
    files = sorted(str(p.relative_to(kept)) for p in kept.rglob("*.py"))
    assert files == [
        "tests/__init__.py",
        "tests/utils.py",
        "tests/v1/__init__.py",
        "tests/v1/test_kept.py",
    ]
    assert "vllm==9.9.9" in calls[0] and "orjson" in calls[1]
    assert upstream_check.fetch_vllm_tests("9.9.9", tmp_path / "cache") == kept
    assert len(calls) == 2  # the second run is offline


def test_check_strict_runs_on_each_claimed_release_and_names_a_failure(tmp_path, monkeypatch):
    """A release whose source lacks the fixes' targets fails the check, with check's own
    lines; the releases are the ends of the README's range."""
    (tmp_path / "vllm").mkdir()
    monkeypatch.setattr(upstream_check, "fetch_release", lambda version, cache: tmp_path)
    line, passed = upstream_check.strict_check("0.26.0", tmp_path / "cache")
    assert not passed
    assert line.startswith("check --strict on vLLM 0.26.0: FAILED; targets: ")
    assert line.splitlines()[0].endswith(" missing")
    assert "missing  vllm.v1.worker.gpu_worker:Worker.load_model" in line
    assert upstream_check.STRICT_CHECK == ("0.26.0", upstream_check.NEWEST)


COUNTING_TEST = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] counted

---
diff --git a/tests/test_counted.py b/tests/test_counted.py
new file mode 100644
--- /dev/null
+++ b/tests/test_counted.py
@@ -0,0 +1,6 @@
+import os
+
+
+def test_counted():
+    with open(os.environ["COUNTED_RUNS"], "a") as runs:
+        runs.write("ran\\n")
"""


def test_a_patch_s_tests_run_once_though_it_is_applied_alone_and_in_series(
    tmp_path, source, patches, monkeypatch
):
    (patches / "0001-counted.patch").write_text(COUNTING_TEST)
    runs = tmp_path / "runs.txt"
    monkeypatch.setenv("COUNTED_RUNS", str(runs))
    installed = tmp_path / "installed"
    (installed / "vllm").mkdir(parents=True)  # a downloaded release: compiled parts lent
    outcomes = upstream_check.check(
        sorted(patches.glob("*.patch")), source, tmp_path / "tree", False, installed
    )
    assert [o.line() for o in outcomes] == [
        "0001-counted.patch (alone): applied, tests in the series",
        "0001-counted.patch (series): applied, tests passed (1 passed)",
    ]
    assert runs.read_text() == "ran\n"


ENGINE_AND_SKIPPED = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] counted

- upstream-check on vLLM 0.1.0: {stated}
- upstream-check on vLLM 9.9.9: 7 passed
---
diff --git a/tests/test_counts.py b/tests/test_counts.py
new file mode 100644
--- /dev/null
+++ b/tests/test_counts.py
@@ -0,0 +1,14 @@
+import pytest
+
+
+def test_one():
+    pass
+
+
+def test_llm_engine():
+    pass
+
+
+@pytest.mark.skip(reason="not here")
+def test_skipped():
+    pass
"""


@pytest.mark.parametrize(
    ("stated", "lent", "line"),
    [
        ("2 passed, 1 skipped", False, "applied, tests passed (2 passed, 1 skipped)"),
        # a downloaded release (compiled parts lent): the engine test is deselected
        ("1 passed, 1 skipped, 1 deselected", True, "tests passed (1 passed, 1 skipped, 1 de"),
        (
            "3 passed",
            False,
            "tests counted otherwise than its message says (2 passed, 1 skipped)",
        ),
    ],
)
def test_a_patch_s_counts_are_held_to_those_its_message_states_for_the_release(
    tmp_path, source, patches, stated, lent, line
):
    (patches / "0001-counted.patch").write_text(ENGINE_AND_SKIPPED.format(stated=stated))
    installed = tmp_path / "installed"
    (installed / "vllm").mkdir(parents=True)
    (series,) = upstream_check.check(
        sorted(patches.glob("*.patch")),
        source,
        tmp_path / "tree",
        False,
        installed if lent else None,
    )[1:]
    assert line in series.line()
    assert series.ok == ("otherwise" not in line)
    if not series.ok:
        assert series.detail == (
            "the message says 3 passed on vLLM 0.1.0; the run gave 2 passed, 1 skipped"
        )


def test_a_run_s_digest_moves_with_the_patch_s_code_not_its_tests(tmp_path, patches):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    (patch,) = patches.glob("*.patch")
    digest = upstream_check.diff_digest(patch)
    patch.write_text(patch.read_text().replace("== 42", "== 6 * 7"))
    assert upstream_check.diff_digest(patch) == digest
    patch.write_text(patch.read_text().replace("+VALUE = 42", "+VALUE = 6 * 7"))
    assert upstream_check.diff_digest(patch) != digest
