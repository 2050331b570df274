"""The demo server's sitecustomize asks for the AMX tile state in every process it starts.

Real system calls on this machine: ``arch_prctl(ARCH_GET_XCOMP_PERM)`` reports what the
process was granted. On a CPU without AMX the request fails harmlessly and nothing is
granted either way; the chaining to another ``sitecustomize`` is checked everywhere.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_xpu_memfix.cli.demo.server import AMX_SITE, with_amx_site

GRANTED = textwrap.dedent(
    """
    import ctypes
    mask = ctypes.c_uint64(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask))  # ARCH_GET_XCOMP_PERM
    print(bool(mask.value >> 18 & 1))  # XFEATURE_XTILEDATA
    """
)


def has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text()
    return platform.machine() == "x86_64" and " amx_tile" in flags


def run(code: str, pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_tile_state_is_granted_only_through_the_site():
    with_site = run(GRANTED, with_amx_site({})["PYTHONPATH"])
    without = run(GRANTED, "")
    assert without == "False"
    assert with_site == str(has_amx())


def test_another_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('the other one ran')\n")
    env = with_amx_site({"PYTHONPATH": str(tmp_path)})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AMX_SITE), str(tmp_path)]
    assert run("pass", env["PYTHONPATH"]) == "the other one ran"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="arch_prctl numbers are x86-64's")
def test_the_site_imports_nothing_heavy():
    code = "import sys; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = run(code, str(AMX_SITE))
    assert "'torch'" not in loaded and "'vllm'" not in loaded and "'ctypes'" in loaded
