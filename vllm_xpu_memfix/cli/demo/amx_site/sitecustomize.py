"""Put on ``PYTHONPATH`` by the demo's server: every process it starts asks Linux for the
AMX tile state before anything runs.

vLLM 0.32's CPU build executes AMX tile instructions in its bf16 kernels without asking
for that state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); on a CPU with
AMX (Intel Sapphire Rapids and later) its worker then dies of SIGILL at the first
forward pass. torch asks only when oneDNN itself uses AMX. The request is one system
call, made without importing torch; elsewhere it fails harmlessly. Any other
``sitecustomize`` further along the path still runs.
"""

import contextlib
import ctypes
import importlib.machinery
import importlib.util
import os
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _request_amx_tiles() -> None:
    if platform.machine() != "x86_64":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_request_amx_tiles()
_run_the_next_sitecustomize()
