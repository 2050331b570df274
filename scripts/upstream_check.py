"""Apply the vLLM patch series to each release it targets and run each patch's tests there.

The series is ``docs/upstream/patches/*.patch`` (``git format-patch`` files, applied in
name order), written against vLLM's newest release, ``NEWEST``. A release may carry its
own variant of a patch: ``docs/upstream/patches/v<version>/<same name>.patch`` replaces
that patch for that release only.

Releases (``--release``, default both):

- ``installed``: the test bed's vLLM (the CPU build 0.32.0).
- a version such as ``0.34.0``: that release's wheel from the package registry
  (``pip download --no-deps``); its Python files, JSON configs and templates are kept
  under ``.cache/upstream/vllm-<version>/``, so a second run is offline. Its compiled
  extensions are not used: the installed build's are linked in where the release has
  none of its own in the copy (they are the CPU build's; the patches touch only Python).
  ``VLLM_TARGET_DEVICE=cpu`` is set, since the release's own version, which vLLM's
  platform detection reads, is not the installed distribution's.

For each release, each patch is first applied by itself to a fresh copy of the source
(``check_alone``: it must apply and read only what exists), since each is sent as its own
PR. Then the source is copied into a temporary directory (``.py`` files copied, the rest
symlinked), every patch is applied in order with ``git apply``, and then:

- every ``self.NAME`` that a patch's added lines read must exist in the patched source,
  checked right after that patch applies: assigned to ``self`` somewhere in the class or
  its vLLM base classes, or a class attribute, method or property there
  (``undefined_self_reads``);
- the ``tests/...`` files the patches add run in the copy, in one pytest process, with
  this plugin off (``VLLM_PLUGINS`` names no plugin and ``VLLM_XPU_MEMFIX=0``) and
  ``upstream_testbed_conftest.py`` as the copy's ``conftest.py``; each file's result is
  credited to the patch that adds it. The tests run once, here: a patch's own tests read
  only what it adds (each applies alone), so running them again per patch would repeat the
  vLLM import and the engine starts for nothing. Tests named ``test_llm_*`` start an
  engine through ``LLM``: they run on the installed build only (``ENGINE_TESTS``).
  Each patch's line gives its tests' counts as pytest writes them ("4 passed, 2 skipped,
  1 deselected"); where its message states them for the release ("upstream-check on vLLM
  0.34.0: ..."), they must be the run's (``stated_counts``).

- vLLM's own tests of the modules the series touches (``VLLM_TESTS``, from the
  release's source distribution, kept under ``.cache/upstream/vllm-tests-<version>/``
  with ``orjson``, which their ``tests/utils.py`` imports) run in the same copy before
  the series is applied and after: a test that passed as is and fails with the series
  fails the check. vLLM's own ``tests/conftest.py`` is left out (it needs vLLM's test
  requirements); none of these tests uses its fixtures.

Then ``vllm-xpu-memfix check --strict`` (this checkout's) runs on the source of each
release in ``STRICT_CHECK``, the ends of the range the README claims (fetched the same
way; docs/compat.md has every release between): a target a release lacks fails it
unless the fix does without it.

Prints one line per patch and one for vLLM's tests; exits 1 naming every patch that
did not apply, reads a missing attribute, or whose tests failed, and every vLLM test
the series breaks. ``--vllm-src DIR`` checks one source tree (a
directory holding ``vllm/``; ``--vllm-tests`` a directory as ``fetch_vllm_tests`` makes)
instead of the releases, ``--apply-only`` skips the tests.

    .venv/bin/python scripts/upstream_check.py [--release installed|X.Y.Z ...]
        [--apply-only] [--vllm-src DIR [--vllm-tests DIR]] [--cache DIR]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "docs" / "upstream" / "patches"
CACHE = ROOT / ".cache" / "upstream"
TESTBED_CONFTEST = Path(__file__).resolve().parent / "upstream_testbed_conftest.py"
NEWEST = "0.34.0"  # vLLM's newest release on the package index: the series' target
RELEASES = ("installed", NEWEST)
STRICT_CHECK = ("0.26.0", NEWEST)  # the README's "vLLM 0.26 to 0.34": Intel's images run 0.26
KEPT_FROM_WHEEL = (".py", ".json", ".jinja", "py.typed")  # what vLLM's Python reads
ADDED_TEST = re.compile(r"^\+\+\+ b/(tests/\S+\.py)$", re.MULTILINE)
VERSION = re.compile(r"""^(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)
HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
STATED = re.compile(r"upstream-check on vLLM (\d[\w.]*): ((?:\d+ \w+(?:, )?)+)")
VERDICTS = ("passed", "failed", "skipped", "deselected", "error")
TEST_TIMEOUT_S = 420
# Tests that start an engine through ``LLM``: they need the release's compiled kernels,
# so they run on the installed build only; a downloaded release's Python runs on the
# installed build's extensions, which lack the newer kernels (0.34's CPU model runner
# asks for ``prepare_prefill_inputs_cpu``).
ENGINE_TESTS = "test_llm_"
# vLLM's tests of the modules the series touches that run on the CPU test bed:
# base_loader (0001, 0002, 0005); gpu_worker and kernel_warmup, which the withdrawn
# 0003 and 0004 touched, stay as a check that nothing else there moved.
VLLM_TESTS = (
    "tests/v1/worker/test_gpu_worker.py",
    "tests/model_executor/model_loader/test_registry.py",
    "tests/model_executor/test_jit_warmup.py",
)
VLLM_TEST_SUPPORT = ("tests/__init__.py", "tests/utils.py")
VLLM_TEST_DEPS = ("orjson",)  # imported by vLLM's server, which tests/utils.py imports


@dataclass
class Outcome:
    patch: str
    applied: bool
    tests: str  # "passed", "failed", "none", "skipped", "in the series", "not run"
    detail: str = ""
    counts: str = ""  # pytest's counts of its tests: "4 passed, 2 skipped"
    missing: list[str] = field(default_factory=list)  # self.NAME reads the release lacks

    @property
    def ok(self) -> bool:
        return (
            self.applied
            and not self.missing
            and self.tests in ("passed", "skipped", "in the series")
        )

    def line(self) -> str:
        applied = "applied" if self.applied else "DOES NOT APPLY"
        reads = f", READS MISSING {', '.join(self.missing)} (FAIL)" if self.missing else ""
        tests = {"none": "no tests (FAIL)"}.get(self.tests, f"tests {self.tests}")
        counts = f" ({self.counts})" if self.counts else ""
        return f"{self.patch}: {applied}{reads}, {tests}{counts}"


@dataclass
class VllmTestsOutcome:
    """vLLM's own tests of the touched modules, run on the copy as is and patched."""

    passed_as_is: int
    passed_patched: int
    broken: list[str]  # passed as is, not with the series
    detail: str = ""
    patch: str = "vLLM's tests of the touched modules"

    @property
    def ok(self) -> bool:
        return not self.broken

    def line(self) -> str:
        broken = f", BROKEN BY THE SERIES: {', '.join(self.broken)}" if self.broken else ""
        return (
            f"{self.patch}: {self.passed_as_is} passed as is, {self.passed_patched} patched{broken}"
        )


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("upstream-check: vllm is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))).parent


def release_version(source_root: Path) -> str:
    """The version a source tree declares in ``vllm/_version.py``, or "unknown"."""
    path = source_root / "vllm" / "_version.py"
    found = VERSION.search(path.read_text()) if path.is_file() else None
    return found.group(1) if found else "unknown"


def series(version: str, patches: Path = PATCHES) -> list[Path]:
    """The patches for ``version``: the series, with that release's variants in place."""
    chosen = {path.name: path for path in sorted(patches.glob("*.patch"))}
    variants = patches / f"v{version.split('+')[0]}"
    for variant in sorted(variants.glob("*.patch")):
        if variant.name not in chosen:
            raise SystemExit(f"upstream-check: {variant} replaces no patch of the series")
        chosen[variant.name] = variant
    return [chosen[name] for name in sorted(chosen)]


def cached(target: Path, fill: Callable[[Path, Path], str]) -> Path:
    """``target``, once complete; else ``fill(tmp, staging)`` first builds it in a
    temporary directory beside it and returns what ``.complete`` records."""
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="upstream-", dir=target.parent) as tmp:
        staging = Path(tmp) / "staging"
        record = fill(Path(tmp), staging)
        (staging / ".complete").write_text(f"{record}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def fetch_release(version: str, cache: Path = CACHE) -> Path:
    """A directory holding ``vllm/`` of release ``version``: from the cache, or else from
    its wheel on the package registry (the only step that needs the network)."""

    def from_wheel(tmp: Path, staging: Path) -> str:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        download += ["--only-binary", ":all:", "--dest", str(tmp), f"vllm=={version}"]
        done = subprocess.run(download, capture_output=True, text=True)
        wheels = sorted(tmp.glob(f"vllm-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SystemExit(f"upstream-check: cannot download vllm=={version}: {reason}")
        extract_python(wheels[0], staging)
        return f"{wheels[0].name} sha256:{hashlib.sha256(wheels[0].read_bytes()).hexdigest()}"

    return cached(cache / f"vllm-{version}", from_wheel)


def extract_python(wheel: Path, dest: Path) -> None:
    """The members of ``wheel`` under ``vllm/`` that vLLM's Python reads, into ``dest``."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("vllm/") and name.endswith(KEPT_FROM_WHEEL):
                archive.extract(name, dest)


def fetch_vllm_tests(version: str, cache: Path = CACHE) -> Path:
    """A directory holding ``VLLM_TESTS`` of release ``version`` (with the package
    ``__init__.py`` files and ``VLLM_TEST_SUPPORT`` they import) and ``site/``, their
    extra dependencies: from the cache, or else from the release's source distribution.

    ``pip download --no-clean`` unpacks the sdist, then fails to prepare its metadata
    (that would build vLLM); the unpacked tree stays, and only its tests are kept."""
    version = version.split("+")[0]

    def from_sdist(tmp: Path, staging: Path) -> str:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-clean"]
        download += ["--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
        download += ["--dest", str(tmp), f"vllm=={version}"]
        subprocess.run(download, capture_output=True, env={**os.environ, "TMPDIR": str(tmp)})
        unpacked = sorted(tmp.glob("pip-*/*/tests/utils.py"))
        if not unpacked:
            raise SystemExit(f"upstream-check: no source distribution of vllm=={version}")
        source = unpacked[0].parent.parent
        for name in (*VLLM_TEST_SUPPORT, *VLLM_TESTS):
            for parent in reversed(Path(name).parents[:-1]):
                if (source / parent / "__init__.py").is_file():
                    (staging / parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy(source / parent / "__init__.py", staging / parent)
            if (source / name).is_file():
                shutil.copy(source / name, staging / name)
        install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        install += ["--target", str(staging / "site"), *VLLM_TEST_DEPS]
        if subprocess.run(install, capture_output=True, text=True).returncode != 0:
            raise SystemExit(f"upstream-check: cannot install {VLLM_TEST_DEPS}")
        return source.name

    return cached(cache / f"vllm-tests-{version}", from_sdist)


def copy_package(source_root: Path, dest_root: Path, compiled_from: Path | None = None) -> None:
    """``source_root/vllm`` into ``dest_root/vllm``: .py files copied, the rest symlinked;
    then each compiled extension (``.so``) of ``compiled_from/vllm`` that the copy lacks."""
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
    if compiled_from is None:
        return
    for extension in sorted((compiled_from / "vllm").rglob("*.so")):
        target = dest_root / extension.relative_to(compiled_from)
        if target.parent.is_dir() and not target.exists():
            target.symlink_to(extension)


def apply(patch: Path, tree: Path) -> str | None:
    """Apply ``patch`` inside ``tree``; None when it applied, else git's reason."""
    done = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", str(patch)],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    return None if done.returncode == 0 else (done.stderr.strip() or "git apply failed")


def diff_digest(patch: Path) -> str:
    """The first 12 hex digits of the sha256 of ``patch``'s diff of vLLM's code (its message
    and its ``tests/`` files left out, which a run does not execute): a results file records
    it, so a run of an earlier version of the change is told apart."""
    files = patch.read_text().rsplit("\n-- \n", 1)[0].split("\ndiff --git ")[1:]
    code = "\ndiff --git ".join(f for f in files if not f.startswith("a/tests/"))
    return hashlib.sha256(code.encode()).hexdigest()[:12]


def added_lines(patch_text: str) -> dict[str, set[int]]:
    """For each file a patch writes, the line numbers of its added lines in the new file."""
    added: dict[str, set[int]] = {}
    path, old_left, new_left, line = None, 0, 0, 0
    for raw in patch_text.splitlines():
        if old_left > 0 or new_left > 0:  # inside a hunk
            if raw.startswith("+"):
                assert path is not None
                added.setdefault(path, set()).add(line)
                line, new_left = line + 1, new_left - 1
            elif raw.startswith("-"):
                old_left -= 1
            elif not raw.startswith("\\"):
                line, old_left, new_left = line + 1, old_left - 1, new_left - 1
        elif raw.startswith("+++ "):
            path = raw[6:] if raw.startswith("+++ b/") else None
        elif (hunk := HUNK.match(raw)) and path is not None:
            old_left = int(hunk.group(1) or 1)
            line, new_left = int(hunk.group(2)), int(hunk.group(3) or 1)
    return added


def undefined_self_reads(patch_text: str, tree: Path) -> list[str]:
    """``Class.self.NAME`` for each ``self.NAME`` read on a line the patch added to vLLM's
    source (``vllm/**.py``; its tests are not the release) that neither the class nor its
    vLLM bases define."""
    missing = []
    for path, lines in sorted(added_lines(patch_text).items()):
        if not (path.startswith("vllm/") and path.endswith(".py")):
            continue
        module = ast.parse((tree / path).read_text())
        for cls in (n for n in ast.walk(module) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and isinstance(node.ctx, ast.Load)
                    and node.lineno in lines
                    and innermost_class(module, node) is cls
                    and not defines(cls, tree / path, node.attr, tree)
                ):
                    missing.append(f"{cls.name}.self.{node.attr}")
    return sorted(set(missing))


def innermost_class(module: ast.Module, target: ast.AST) -> ast.ClassDef | None:
    found = None
    for cls in (n for n in ast.walk(module) if isinstance(n, ast.ClassDef)):
        inside = any(node is target for node in ast.walk(cls))
        if inside and (found is None or any(n is cls for n in ast.walk(found))):
            found = cls
    return found


def defined_names(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its methods, properties and class attributes, and every
    ``self.NAME`` its methods assign (``setattr(self, "NAME", ...)`` included)."""
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "self"
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(str(node.args[1].value))
    return names


def defines(cls: ast.ClassDef, path: Path, name: str, tree: Path, depth: int = 0) -> bool:
    """Whether ``cls`` (in ``path``) or one of its bases found in ``tree`` defines ``name``
    (a class with ``__getattr__`` defines every name)."""
    names = defined_names(cls)
    if name in names or "__getattr__" in names:
        return True
    if depth > 20:
        return False
    for base in cls.bases:
        found = resolve_class(base, path, tree)
        if found is not None and defines(*found, name, tree, depth + 1):
            return True
    return False


def resolve_class(
    expr: ast.expr, path: Path, tree: Path, depth: int = 0
) -> tuple[ast.ClassDef, Path] | None:
    """The class a base-class expression names, if it is defined in ``tree``'s source."""
    if isinstance(expr, ast.Subscript):  # Generic[T], Base[Config]
        expr = expr.value
    if not isinstance(expr, ast.Name) or depth > 10:
        return None
    module = ast.parse(path.read_text())
    for stmt in module.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == expr.id:
            return stmt, path
    for node in ast.walk(module):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        for alias in node.names:
            if (alias.asname or alias.name) == expr.id:
                source = module_file(node.module, tree)
                if source is None:
                    return None
                return resolve_class(ast.Name(alias.name), source, tree, depth + 1)
    return None


def module_file(module: str, tree: Path) -> Path | None:
    base = tree.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def plugin_off_env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(tree),
        VLLM_PLUGINS="",  # no general plugin loads (an empty name matches none)
        VLLM_XPU_MEMFIX="0",  # and this one's master switch, should it load anyway
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(extra or {})
    return env


def run_pytest(
    tests: list[str], tree: Path, env: dict[str, str] | None = None, engine: bool = True
) -> str:
    """Run ``tests`` (paths inside ``tree``) there in one pytest process (vLLM's import
    dominates), with this plugin off; pytest's output, every test's verdict in it.
    ``engine=False`` deselects the tests that start an engine (``test_llm_*``)."""
    (tree / "pytest.ini").write_text("[pytest]\n")  # keep the project's config out
    shutil.copy(TESTBED_CONFTEST, tree / "conftest.py")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"),
            *(() if engine else ("-k", f"not {ENGINE_TESTS}")),
            *tests,
        ],
        cwd=tree,
        env=plugin_off_env(tree, env),
        capture_output=True,
        text=True,
        timeout=TEST_TIMEOUT_S,
    )
    return done.stdout + done.stderr


def passed_tests(output: str, files: list[str]) -> set[str]:
    """The test ids of ``files`` that pytest's ``-rA`` output reports as passed."""
    found = re.findall(r"^PASSED (\S+)", output, re.M)
    return {test for test in found if test.split("::")[0] in files}


def per_file(output: str, tests: list[str]) -> dict[str, str]:
    """Each test file's result in pytest's ``-rA`` output: "passed" if it passed (or
    skipped) every test and passed one, else "failed"."""
    results = {}
    for test in tests:
        verdicts = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED) {re.escape(test)}\b", output, re.M)
        ok = verdicts and "FAILED" not in verdicts and "ERROR" not in verdicts
        results[test] = "passed" if ok and "PASSED" in verdicts else "failed"
    return results


def counted(output: str, files: list[str], deselected: int) -> str:
    """The counts of ``files``' tests in pytest's ``-rA`` output, written as pytest writes
    them ("4 passed, 2 skipped, 1 deselected"); ``deselected`` is given (pytest counts
    those over the whole run only)."""
    found = dict.fromkeys(VERDICTS, 0)
    found["deselected"] = deselected
    for verdict, test in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", output, re.M):
        if test.split("::")[0] in files:
            found[verdict.lower()] += 1
    for number, test in re.findall(r"^SKIPPED \[(\d+)\] (\S+?):\d+", output, re.M):
        if test in files:  # "SKIPPED [2] tests/test_x.py:12: reason"
            found["skipped"] += int(number)
    return ", ".join(f"{n} {verdict}" for verdict, n in found.items() if n)


def stated_counts(patch_text: str, version: str) -> str | None:
    """The counts a patch's message states for release ``version`` ("upstream-check on
    vLLM 0.34.0: 4 passed, 2 skipped"), None where it states none."""
    message = patch_text.split("\n---\n", 1)[0]
    stated = {found[1]: found[2] for found in STATED.finditer(message)}
    return stated.get(version.split("+")[0])


def vllm_tests_in(tree: Path, vllm_tests: Path, env: dict[str, str] | None) -> list[str]:
    """Copy vLLM's tests from ``vllm_tests`` into ``tree``; the test files there, and
    ``env`` with their extra dependencies (``site/``) on the path."""
    shutil.copytree(vllm_tests / "tests", tree / "tests", dirs_exist_ok=True)
    if env is not None:
        env["PYTHONPATH"] = os.pathsep.join((str(tree), str(vllm_tests / "site")))
    return [name for name in VLLM_TESTS if (tree / name).is_file()]


def check(
    patches: list[Path],
    source_root: Path,
    tree: Path,
    apply_only: bool,
    compiled_from: Path | None = None,
    env: dict[str, str] | None = None,
    vllm_tests: Path | None = None,
) -> list[Outcome | VllmTestsOutcome]:
    """Apply every patch in order to a copy of ``source_root`` in ``tree``, check the
    attributes each one reads right after it applies, then run the tests: the patches'
    own, and vLLM's ``vllm_tests`` (a directory from ``fetch_vllm_tests``) before the
    patches and after. Each patch's counts are held to those its message states for the
    source's release."""
    version = release_version(source_root)
    engine = compiled_from is None
    alone = [
        check_alone(patch, source_root, tree / patch.stem[:4], compiled_from) for patch in patches
    ]
    tree = tree / "series"
    copy_package(source_root, tree, compiled_from)
    env = dict(env or {})
    own_tests: list[str] = []
    as_is: set[str] = set()
    if vllm_tests is not None and not apply_only:
        own_tests = vllm_tests_in(tree, vllm_tests, env)
        as_is = passed_tests(run_pytest(own_tests, tree, env, engine), own_tests)
    outcomes = []
    for patch in patches:
        reason = apply(patch, tree)
        outcome = Outcome(f"{patch.name} (series)", reason is None, "skipped", reason or "")
        if reason is None:
            outcome.missing = undefined_self_reads(patch.read_text(), tree)
        outcomes.append(outcome)
    if apply_only:
        return [*alone, *outcomes]
    tests = {
        outcome.patch: ADDED_TEST.findall(patch.read_text())
        for patch, outcome in zip(patches, outcomes, strict=True)
        if outcome.applied
    }
    added = sorted({t for files in tests.values() for t in files})
    output = run_pytest(added + own_tests, tree, env, engine) if added or own_tests else ""
    results, tail = per_file(output, added), "\n".join(output.strip().splitlines()[-25:])
    for patch, outcome in zip(patches, outcomes, strict=True):
        if not outcome.applied:
            outcome.tests = "not run"
        elif not tests[outcome.patch]:
            outcome.tests = "none"
        else:
            failed = [t for t in tests[outcome.patch] if results[t] != "passed"]
            outcome.tests = "failed" if failed else "passed"
            if failed:
                outcome.detail = f"failed: {', '.join(failed)}\n{tail}"
            text = patch.read_text()
            deselected = 0 if engine else len(re.findall(rf"^\+def {ENGINE_TESTS}", text, re.M))
            outcome.counts = counted(output, tests[outcome.patch], deselected)
            stated = stated_counts(text, version)
            if stated is not None and stated != outcome.counts:
                outcome.tests = "counted otherwise than its message says"
                said = f"the message says {stated} on vLLM {version}; the run gave {outcome.counts}"
                outcome.detail = "\n".join(filter(None, (said, outcome.detail)))
    if not own_tests:
        return [*alone, *outcomes]
    patched = passed_tests(output, own_tests)
    broken = sorted(as_is - patched)
    vllm = VllmTestsOutcome(len(as_is), len(patched), broken, tail if broken else "")
    return [*alone, *outcomes, vllm]


def check_alone(patch: Path, source_root: Path, tree: Path, compiled_from: Path | None) -> Outcome:
    """``patch`` applied by itself to a fresh copy of ``source_root``: whether it applies
    and reads only what exists (its tests run once, with the series)."""
    copy_package(source_root, tree, compiled_from)
    reason = apply(patch, tree)
    outcome = Outcome(f"{patch.name} (alone)", reason is None, "in the series", reason or "")
    if reason is not None:
        outcome.tests = "not run"
        return outcome
    outcome.missing = undefined_self_reads(patch.read_text(), tree)
    return outcome


def check_release(
    release: str, patches: Path, cache: Path, apply_only: bool, tree: Path
) -> tuple[str, list[Outcome | VllmTestsOutcome]]:
    """One release's label and outcomes: ``installed`` or a version from the registry."""
    installed = installed_vllm_root()
    if release == "installed":
        version = release_version(installed)
        vllm_tests = None if apply_only else fetch_vllm_tests(version, cache)
        outcomes = check(
            series(version, patches), installed, tree, apply_only, vllm_tests=vllm_tests
        )
        return f"vLLM {version} (installed, {installed})", outcomes
    source = fetch_release(release, cache)
    outcomes = check(
        series(release, patches),
        source,
        tree,
        apply_only,
        compiled_from=installed,
        env={"VLLM_TARGET_DEVICE": "cpu"},
        vllm_tests=None if apply_only else fetch_vllm_tests(release, cache),
    )
    return f"vLLM {release} (its wheel's Python, {source})", outcomes


def strict_check(version: str, cache: Path) -> tuple[str, bool]:
    """``check --strict`` of this checkout on release ``version``'s source: its summary
    line (every line it printed where it failed), and whether it passed."""
    source = fetch_release(version, cache)
    command = [sys.executable, "-m", "vllm_xpu_memfix.cli", "check", "--source", str(source)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [*command, "--strict"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "VLLM_XPU_MEMFIX": "1"},
    )
    said = next((x for x in done.stdout.splitlines() if x.startswith("targets: ")), "")
    passed = done.returncode == 0
    line = f"check --strict on vLLM {version}: {'passed' if passed else 'FAILED'}; {said}"
    return (line if passed else f"{line}\n{done.stdout}{done.stderr}"), passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=Path, default=PATCHES)
    parser.add_argument("--vllm-src", type=Path, help="a directory holding vllm/")
    parser.add_argument("--release", action="append", help="installed or X.Y.Z (repeatable)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--apply-only", action="store_true")
    parser.add_argument("--vllm-tests", type=Path, help="with --vllm-src: vLLM's tests")
    args = parser.parse_args(argv)
    if not sorted(args.patches.glob("*.patch")):
        print(f"upstream-check: no patches in {args.patches}", file=sys.stderr)
        return 1
    failed: list[str] = []
    for release in [None] if args.vllm_src else args.release or list(RELEASES):
        with tempfile.TemporaryDirectory(prefix="upstream-check-") as tmp:
            if release is None:
                version = release_version(args.vllm_src)
                label = f"vLLM {version} ({args.vllm_src})"
                patches = series(version, args.patches)
                outcomes = check(
                    patches, args.vllm_src, Path(tmp), args.apply_only, vllm_tests=args.vllm_tests
                )
            else:
                label, outcomes = check_release(
                    release, args.patches, args.cache, args.apply_only, Path(tmp)
                )
        print(f"== {label}", flush=True)
        for outcome in outcomes:
            print(outcome.line(), flush=True)
        for outcome in outcomes:
            if not outcome.ok:
                print(f"--- {outcome.patch}:\n{outcome.detail}", file=sys.stderr)
                failed.append(f"{outcome.patch} on {label.split(' (')[0]}")
    for version in [] if args.vllm_src or args.release else STRICT_CHECK:
        line, passed = strict_check(version, args.cache)
        print(line, flush=True)
        if not passed:
            failed.append(f"check --strict on vLLM {version}")
    if failed:
        print(f"upstream-check: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(
        "upstream-check: every patch applies, reads only what exists and passes its tests;"
        " vLLM's own tests pass as before"
        + (
            ""
            if args.vllm_src or args.release
            else f"; check --strict passes on {', '.join(STRICT_CHECK)}"
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
