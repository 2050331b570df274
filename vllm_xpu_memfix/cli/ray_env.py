"""``vllm-xpu-memfix ray-env``: the driver variables a Ray node needs, ready to paste.

vLLM's Ray workers start the Intel driver before they load plugins, so the
driver guard cannot set the variables there (docs/multi-node.md). This command
decides on the node it runs on, from sysfs, the compute-runtime and the kernel
under ``VLLM_XPU_MEMFIX_SYSROOT`` and ``VLLM_XPU_MEMFIX_DRIVER_ENV``, exactly as
the guard would, and prints the variables as ``export`` lines (the output can be
``eval``'d) with the Ray ``runtime_env`` form and any compute-runtime #916
warning as comments; ``--json`` prints only the ``runtime_env``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.lines import WIDTH, wrap
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver_facts as facts


def ray_line() -> str:
    """Whether Ray is installed here, without importing it."""
    if importlib.util.find_spec("ray") is None:
        return (
            "Ray is not installed in this environment; vLLM's Ray executor needs it where "
            "vLLM runs (pip install ray)"
        )
    try:
        return f"Ray {importlib.metadata.version('ray')} is installed here"
    except importlib.metadata.PackageNotFoundError:
        return "Ray is importable here, but its version cannot be read"


def _comment(text: str, indent: int = 0) -> None:
    """``text`` as shell comments of at most :data:`WIDTH` characters (``core.lines``)."""
    for line in wrap(" " * indent + text, width=WIDTH - 2):
        print(f"# {line}")


def main(args: argparse.Namespace) -> int:
    settings = config.load()
    # What the node needs, whatever this shell already holds, and whatever the plugin's
    # switches here: with the guard off the variables are the user's to set.
    environ = driver_env.without_guard(os.environ)
    guard_off = not settings.requested(config.DRIVER_ENV)
    if guard_off:
        environ = {**environ, config.MASTER.name: "1", config.DRIVER_ENV.env: "auto"}
    decision = driver_env.decide(config.load(environ), environ)
    needed = decision.env
    runtime_env = {"env_vars": needed}
    if args.json:
        print(json.dumps(runtime_env))
        return 0
    if not needed:
        _comment(f"this node needs no driver variables: {decision.reason}")
        for remark in driver_env.remarks(decision):
            _comment(remark, indent=2)
        return 0
    _comment(f"this node needs the driver guard: {decision.reason} ({driver_env.EVIDENCE})")
    if guard_off:
        _comment("the plugin's driver guard is off here: these are yours to set")
    if driver_env.NO_PEER in needed:
        _comment(f"{driver_env.NO_PEER}=0 turns P2P off: {facts.NO_PEER_ACCESS_COST}")
    if decision.xe_peer_oom is not None:
        warning, remedies = driver_env.xe_peer_oom_lines(decision.xe_peer_oom)
        _comment(warning)
        _comment(remedies, indent=2)
    _comment(ray_line())
    print("# 1) in every node's environment before `ray start` (Ray workers start with it):")
    for name, value in needed.items():
        print(f"export {name}={value}")
    print("# 2) or in the Ray job's runtime_env, e.g. ray.init(runtime_env=...) before the")
    print("#    engine is created (Ray merges the job's env_vars into vLLM's worker actors):")
    print(f"# {json.dumps(runtime_env)}")
    already = {k: os.environ[k] for k in needed if k in os.environ}
    if already:
        shown = " ".join(f"{k}={v}" for k, v in already.items())
        print(f"# this shell already has {shown}")
    return 0
