"""Apply the vLLM patch series to a copy of the installed vLLM and run each patch's tests.

The series is ``docs/upstream/patches/*.patch`` (``git format-patch`` files, applied in
name order). The copy lives in a temporary directory: the installed package's ``.py``
files are copied, everything else (compiled extensions, data) is symlinked, so the
patched copy imports like the installed one. Each patch's own tests are the
``tests/...`` files it adds; they run with this plugin off (``VLLM_PLUGINS`` names no
plugin and ``VLLM_XPU_MEMFIX=0``), in the copy, all in one pytest run (importing vLLM
is most of the time), each file's result credited to the patch that adds it.

Prints one line per patch; exits 1 naming every patch that did not apply or whose tests
failed. ``--vllm-src DIR`` checks another release's source tree (a directory holding
``vllm/``, e.g. a wheel's ``.py`` files), ``--apply-only`` skips the tests.

    .venv/bin/python scripts/upstream_check.py [--apply-only] [--vllm-src DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PATCHES = Path(__file__).resolve().parent.parent / "docs" / "upstream" / "patches"
ADDED_TEST = re.compile(r"^\+\+\+ b/(tests/\S+\.py)$", re.MULTILINE)
TEST_TIMEOUT_S = 300


@dataclass
class Outcome:
    patch: str
    applied: bool
    tests: str  # "passed", "failed", "none", "skipped"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.applied and self.tests in ("passed", "skipped")

    def line(self) -> str:
        applied = "applied" if self.applied else "DOES NOT APPLY"
        tests = {"none": "no tests (FAIL)"}.get(self.tests, f"tests {self.tests}")
        return f"{self.patch}: {applied}, {tests}"


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("upstream-check: vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def copy_package(source_root: Path, dest_root: Path) -> None:
    """``source_root/vllm`` into ``dest_root/vllm``: .py files copied, the rest symlinked."""
    source = source_root / "vllm"
    if not source.is_dir():
        raise SystemExit(f"upstream-check: {source} is not a directory")
    for directory, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        target = dest_root / Path(directory).relative_to(source_root)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            path = Path(directory) / name
            if name.endswith(".py"):
                shutil.copy2(path, target / name)
            else:
                (target / name).symlink_to(path)


def apply(patch: Path, tree: Path) -> str | None:
    """Apply ``patch`` inside ``tree``; None when it applied, else git's reason."""
    done = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", str(patch)],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    return None if done.returncode == 0 else (done.stderr.strip() or "git apply failed")


def plugin_off_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(tree),
        VLLM_PLUGINS="",  # no general plugin loads (an empty name matches none)
        VLLM_XPU_MEMFIX="0",  # and this one's master switch, should it load anyway
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def run_tests(tests: list[str], tree: Path) -> tuple[dict[str, str], str]:
    """Run ``tests`` (paths inside ``tree``) in the patched copy, in one pytest process
    (vLLM's import dominates); each file's result ("passed" or "failed") and the output's
    tail. A file pytest reports nothing for (it could not be collected) has failed."""
    if not tests:
        return {}, ""
    (tree / "pytest.ini").write_text("[pytest]\n")  # keep the project's config out
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=plugin_off_env(tree),
        capture_output=True,
        text=True,
        timeout=TEST_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    results = {}
    for test in tests:
        verdicts = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED) {re.escape(test)}\b", output, re.M)
        ok = verdicts and "FAILED" not in verdicts and "ERROR" not in verdicts
        results[test] = "passed" if ok and "PASSED" in verdicts else "failed"
    return results, "\n".join(output.strip().splitlines()[-25:])


def check(patches: list[Path], source_root: Path, tree: Path, apply_only: bool) -> list[Outcome]:
    """Apply every patch in order to a copy of ``source_root`` in ``tree``, then test each."""
    copy_package(source_root, tree)
    outcomes = []
    for patch in patches:
        reason = apply(patch, tree)
        outcomes.append(Outcome(patch.name, reason is None, "skipped", reason or ""))
    if apply_only:
        return outcomes
    tests = {
        outcome.patch: ADDED_TEST.findall(patch.read_text())
        for patch, outcome in zip(patches, outcomes, strict=True)
        if outcome.applied
    }
    results, tail = run_tests(sorted({t for files in tests.values() for t in files}), tree)
    for outcome in outcomes:
        if not outcome.applied:
            outcome.tests = "not run"
        elif not tests[outcome.patch]:
            outcome.tests = "none"
        else:
            failed = [t for t in tests[outcome.patch] if results[t] != "passed"]
            outcome.tests = "failed" if failed else "passed"
            if failed:
                outcome.detail = f"failed: {', '.join(failed)}\n{tail}"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=Path, default=PATCHES)
    parser.add_argument("--vllm-src", type=Path, help="a directory holding vllm/")
    parser.add_argument("--apply-only", action="store_true")
    args = parser.parse_args(argv)
    patches = sorted(args.patches.glob("*.patch"))
    if not patches:
        print(f"upstream-check: no patches in {args.patches}", file=sys.stderr)
        return 1
    source_root = args.vllm_src or installed_vllm_root()
    with tempfile.TemporaryDirectory(prefix="upstream-check-") as tmp:
        outcomes = check(patches, source_root, Path(tmp), args.apply_only)
    for outcome in outcomes:
        print(outcome.line(), flush=True)
    failed = [outcome for outcome in outcomes if not outcome.ok]
    for outcome in failed:
        print(f"--- {outcome.patch}:\n{outcome.detail}", file=sys.stderr)
    if failed:
        names = ", ".join(outcome.patch for outcome in failed)
        print(f"upstream-check: FAILED: {names}", file=sys.stderr)
        return 1
    print(f"upstream-check: {len(outcomes)} patch(es) OK against {source_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
