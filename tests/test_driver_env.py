"""Driver guard on constructed host trees (see tests/hosts.py for their formats)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hosts import B60, B70, NVIDIA_L4, build_host

from vllm_xpu_memfix import config, driver
from vllm_xpu_memfix.fixes import driver_env


def settings_for(root: Path, **env: str):
    return config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root), **env})


def test_sysfs_gives_intel_gpus_in_pci_order_without_connectors(tmp_path):
    root = build_host(tmp_path, [B70, NVIDIA_L4, B70])
    gpus = driver.intel_gpus(root)
    assert [(g.card, g.device_id, g.pci_slot) for g in gpus] == [
        ("card1", 0xE223, "0000:03:00.0"),
        ("card3", 0xE223, "0000:05:00.0"),
    ]
    assert all(g.is_battlemage and g.family == "Battlemage G31" for g in gpus)
    assert gpus[0].vram_bytes == 32 * 1024**3 and gpus[0].product == "Arc Pro B70"


@pytest.mark.parametrize(
    ("env", "visible"),
    [
        ({}, [0, 1, 2, 3]),
        ({"ZE_AFFINITY_MASK": "0"}, [0]),
        ({"ZE_AFFINITY_MASK": "1,3"}, [1, 3]),
        ({"ZE_AFFINITY_MASK": "0.0,0.1,2.0"}, [0, 2]),
        ({"ONEAPI_DEVICE_SELECTOR": "level_zero:2"}, [2]),
        ({"ONEAPI_DEVICE_SELECTOR": "level_zero:*"}, [0, 1, 2, 3]),
        ({"ONEAPI_DEVICE_SELECTOR": "!level_zero:0"}, [1, 2, 3]),
        ({"ONEAPI_DEVICE_SELECTOR": "*:gpu;!level_zero:3"}, [0, 1, 2]),
        ({"ONEAPI_DEVICE_SELECTOR": "opencl:*"}, []),
        ({"ZE_AFFINITY_MASK": "0,1", "ONEAPI_DEVICE_SELECTOR": "level_zero:1,2"}, [1]),
    ],
)
def test_visibility_variables(tmp_path, env, visible):
    gpus = driver.intel_gpus(build_host(tmp_path, [B70] * 4))
    assert [gpus.index(g) for g in driver.visible_gpus(gpus, env)] == visible


def test_runtime_from_dpkg_then_library_name(tmp_path):
    rt = driver.compute_runtime(build_host(tmp_path / "a", [B70], runtime="26.09.37435.1"))
    assert (rt.build, rt.affected, rt.source) == (37435, True, "dpkg: intel-opencl-icd")
    old = driver.compute_runtime(build_host(tmp_path / "b", [B70], runtime="26.05.37020.3"))
    assert (old.build, old.affected) == (37020, False)
    lib = driver.compute_runtime(build_host(tmp_path / "c", [B70], runtime=None, lib_build="37435"))
    assert lib.build == 37435 and lib.source.endswith("libze_intel_gpu.so.1.14.37435")
    assert driver.compute_runtime(build_host(tmp_path / "d", [B70], runtime=None)) is None
    assert driver.level_zero_loader(tmp_path / "a") == "1.28.2-1~24.04"


@pytest.mark.parametrize(
    ("case", "gpus", "runtime", "env", "applies"),
    [
        ("4x B70, runtime 26.14", [B70] * 4, "26.14.37833.4", {}, True),
        ("1x B60", [B60], "26.14.37833.4", {}, False),
        ("2x B70, runtime 26.05", [B70] * 2, "26.05.37020.3", {}, False),
        (
            "2x B70, ZE_AFFINITY_MASK=0",
            [B70] * 2,
            "26.14.37833.4",
            {"ZE_AFFINITY_MASK": "0"},
            False,
        ),
        ("NVIDIA only", [NVIDIA_L4] * 4, "26.14.37833.4", {}, False),
        (
            "user's EnableDeferBacking=1",
            [B70] * 4,
            "26.14.37833.4",
            {"EnableDeferBacking": "1"},
            False,
        ),
        ("2x B60 + 2x B70, version unknown", [B60, B60, B70, B70], None, {}, True),
    ],
)
def test_guard_decision(tmp_path, case, gpus, runtime, env, applies):
    root = build_host(tmp_path, gpus, runtime=runtime)
    decision = driver_env.decide(settings_for(root), env)
    assert decision.apply is applies, (case, decision.reason)
    if "EnableDeferBacking" in env:
        assert "respecting EnableDeferBacking=1" in decision.reason
    environ = dict(env)
    driver_env.apply(decision, environ)
    assert (environ.get("EnableDeferBacking") == "0") is applies
    assert environ.get("EnableDeferBacking") == env.get(
        "EnableDeferBacking", environ.get("EnableDeferBacking")
    )


def test_switch_on_forces_and_off_never_sets(tmp_path):
    root = build_host(tmp_path, [B60])
    assert driver_env.decide(settings_for(root, VLLM_XPU_MEMFIX_DRIVER_ENV="on"), {}).apply
    root4 = build_host(tmp_path / "4", [B70] * 4)
    assert not driver_env.decide(settings_for(root4, VLLM_XPU_MEMFIX_DRIVER_ENV="off"), {}).apply
    assert not driver_env.decide(settings_for(root4, VLLM_XPU_MEMFIX="0"), {}).apply


def test_bad_sysroot_is_a_clear_error(tmp_path):
    with pytest.raises(
        config.ConfigError, match=r"VLLM_XPU_MEMFIX_SYSROOT=.*an existing directory"
    ):
        config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(tmp_path / "missing")})


def run_script(script: Path, code: str, sysroot: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script (spawn needs a file) on ``sysroot``, without guard variables."""
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in driver_env.GUARD_ENV}
    env["VLLM_XPU_MEMFIX_SYSROOT"] = str(sysroot)
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result


def test_spawned_children_inherit_what_process_0_set(tmp_path):
    root = build_host(tmp_path / "host", [B70] * 4)
    code = textwrap.dedent(
        """
        import json, multiprocessing as mp, os
        import vllm_xpu_memfix

        def report(queue):
            queue.put({k: os.environ.get(k) for k in ("NEOReadDebugKeys", "EnableDeferBacking")})

        if __name__ == "__main__":
            vllm_xpu_memfix.register()
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=report, args=(queue,))
            child.start()
            print(json.dumps(queue.get(timeout=60)))
            child.join()
        """
    )
    result = run_script(tmp_path / "spawn_check.py", code, root)
    assert json.loads(result.stdout) == {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
    warning = [line for line in result.stderr.splitlines() if "EnableDeferBacking=0" in line]
    assert len(warning) == 1
    assert "4 Battlemage GPUs visible" in warning[0] and "#50269" in warning[0]
    assert "VLLM_XPU_MEMFIX_DRIVER_ENV=off" in warning[0]


def test_a_worker_that_did_not_inherit_the_variables_sets_them_itself(tmp_path):
    """As on a Ray node: the worker's plugin runs before the worker starts the driver."""
    root = build_host(tmp_path / "host", [B70] * 2, runtime="26.09.37435.1")
    code = textwrap.dedent(
        """
        import json, multiprocessing as mp, os

        def worker(queue):
            import vllm_xpu_memfix
            vllm_xpu_memfix.register()
            queue.put({k: os.environ.get(k) for k in ("NEOReadDebugKeys", "EnableDeferBacking")})

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=worker, args=(queue,), name="VllmWorker-0")
            child.start()
            print(json.dumps(queue.get(timeout=60)))
            child.join()
            print(json.dumps({k: os.environ.get(k) for k in ("EnableDeferBacking",)}))
        """
    )
    result = run_script(tmp_path / "worker_check.py", code, root)
    child, parent = (json.loads(line) for line in result.stdout.splitlines())
    assert child == {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
    assert parent == {"EnableDeferBacking": None}, "the parent never registered the plugin"
    assert "which did not inherit them" in result.stderr
    assert "compute-runtime 26.09.37435.1" in result.stderr
