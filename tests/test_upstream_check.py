"""scripts/upstream_check.py on a stand-in ``vllm`` package: the ways a patch can fail.

The real series is checked by ``make upstream-check``; these cases only need a
package named ``vllm`` to copy, patch and import, so they take a second.
"""

from __future__ import annotations

import sys
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
    assert "0001-fix.patch: applied, tests passed" in out
    assert (source / "vllm" / "answer.py").read_text() == "VALUE = 41\n"  # copy, not source


def test_a_patch_that_no_longer_applies_is_named(tmp_path, source, patches, capsys):
    write_patch(patches, "0001-stale", old=40, new=42, expected=42)
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-stale.patch: DOES NOT APPLY" in out
    assert "FAILED: 0001-stale.patch" in out


def test_a_patch_whose_tests_fail_is_named(tmp_path, source, patches, capsys):
    write_patch(patches, "0001-fix", old=41, new=42, expected=42)
    write_patch(patches, "0002-wrong", old=42, new=43, expected=44)
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-fix.patch: applied, tests failed" in out  # 0002 changed what it tests
    assert "0002-wrong.patch: applied, tests failed" in out
    assert "FAILED: 0001-fix.patch, 0002-wrong.patch" in out


def test_a_patch_without_tests_fails(tmp_path, source, patches, capsys):
    (patches / "0001-untested.patch").write_text(CHANGE_VALUE.format(old=41, new=42))
    code, out = run(tmp_path, source, capsys)
    assert code == 1
    assert "0001-untested.patch: applied, no tests (FAIL)" in out
