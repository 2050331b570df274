"""The sdist and the wheel, built as ``python -m build`` builds them (the wheel from the
unpacked sdist), through setuptools' PEP 517 hooks in the test bed, from a copy of the files
git would commit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _hook(hook: str, source: Path, out: Path) -> Path:
    """setuptools' PEP 517 ``hook`` run in ``source``; the file it wrote into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


def build_release(tmp: Path) -> tuple[Path, Path]:
    """(sdist, wheel) of the files git would commit here, built under ``tmp``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    source = tmp / "checkout"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    sdist = _hook("build_sdist", source, tmp / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    return sdist, _hook("build_wheel", unpacked, tmp / "dist")
