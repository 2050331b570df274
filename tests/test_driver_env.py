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

from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver


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
    assert (rt.build, rt.pins_host_copy, rt.source) == (37435, True, "dpkg: intel-opencl-icd")
    old = driver.compute_runtime(build_host(tmp_path / "b", [B70], runtime="26.05.37020.3"))
    assert (old.build, old.pins_host_copy) == (37020, False)
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
        numbers.ConfigError, match=r"VLLM_XPU_MEMFIX_SYSROOT=.*an existing directory"
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


def test_loaded_driver_libraries_come_from_the_maps_file(tmp_path):
    maps = tmp_path / "maps"
    lib = "/usr/lib/x86_64-linux-gnu"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 11 /usr/bin/python3.11\n"
        f"7f10-7f11 r--p 00000000 08:01 12 {lib}/libze_loader.so.1.28.2\n"
        f"7f11-7f12 r-xp 00001000 08:01 12 {lib}/libze_loader.so.1.28.2\n"
        f"7f20-7f21 r--p 00000000 08:01 13 {lib}/libze_tracing_layer.so.1\n"
        "7f30-7f31 rw-p 00000000 00:00 0 \n"
        f"7f40-7f41 r--p 00000000 08:01 14 {lib}/libze_intel_gpu.so.1.14.37435\n"
        "7f50-7f51 rw-p 00000000 00:00 0 [heap]\n"
    )
    assert driver.loaded_driver_libraries(maps) == [
        f"{lib}/libze_loader.so.1.28.2",
        f"{lib}/libze_intel_gpu.so.1.14.37435",
    ]
    assert driver.loaded_driver_libraries(tmp_path / "missing") == []
    assert driver.loaded_driver_libraries() == [], "this test process has no Level Zero"


@pytest.fixture
def guard_in_process(tmp_path, monkeypatch, caplog):
    """Run driver_env.install here as a process of ``role`` with the driver mapped or not,
    ``at_start`` the environment it started with; returns the records and os.environ."""
    import logging

    from vllm_xpu_memfix.core.process import ProcessRole

    for name in GUARD_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(driver_env, "logger", logging.getLogger("test.driver_env"))
    caplog.set_level(logging.DEBUG, "test.driver_env")

    def run(role, gpus=(B70,) * 4, loaded=(), at_start=None, now=None):
        root = build_host(tmp_path / f"host{len(list(tmp_path.iterdir()))}", list(gpus))
        monkeypatch.setattr(driver_env, "current_role", lambda: ProcessRole(role))
        monkeypatch.setattr(driver, "loaded_driver_libraries", lambda: list(loaded))
        monkeypatch.setattr(driver_env, "environ_at_start", lambda: dict(at_start or {}))
        for name, value in (now or {}).items():
            monkeypatch.setenv(name, value)
        caplog.clear()
        driver_env.install(None, settings_for(root))
        records = [(r.levelname, r.getMessage()) for r in caplog.records]
        return records, {k: os.environ.get(k) for k in GUARD_NAMES}

    return run


GUARD_NAMES = tuple(driver_env.GUARD_ENV)
LIB = "/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1"


def test_a_rank_with_the_driver_loaded_sets_nothing_and_says_the_mirror_stays(guard_in_process):
    records, env = guard_in_process("worker", loaded=[LIB])
    assert env == {"NEOReadDebugKeys": None, "EnableDeferBacking": None}
    assert [level for level, _ in records] == ["ERROR"]
    message = records[0][1]
    assert f"the Intel GPU driver is already loaded ({LIB})" in message
    assert "will be pinned in this process" in message and "Nothing was set" in message
    assert "4 Battlemage GPUs visible" in message


def test_variables_set_after_start_in_a_rank_with_the_driver_loaded_are_too_late(
    guard_in_process,
):
    records, env = guard_in_process(
        "ray_worker", loaded=[LIB], at_start={}, now=dict(driver_env.GUARD_ENV)
    )
    assert env == driver_env.GUARD_ENV  # left as they were, but not taken as working
    assert [level for level, _ in records] == ["ERROR"]
    assert "were set in this process after it started" in records[0][1]


def test_variables_the_rank_started_with_are_taken_as_working(guard_in_process):
    guard = dict(driver_env.GUARD_ENV)
    records, env = guard_in_process("worker", loaded=[LIB], at_start=guard, now=guard)
    assert env == guard
    assert records == [
        (
            "INFO",
            "vllm-xpu-memfix: driver variables in this worker: "
            "NEOReadDebugKeys=1 EnableDeferBacking=0",
        )
    ]


def test_no_error_where_the_guard_is_not_needed_even_with_the_driver_loaded(guard_in_process):
    records, env = guard_in_process("worker", gpus=[B60], loaded=[LIB])
    assert env == {"NEOReadDebugKeys": None, "EnableDeferBacking": None}
    assert [level for level, _ in records] == ["DEBUG"]


def test_process_0_with_the_driver_loaded_still_sets_them_for_the_processes_it_starts(
    guard_in_process,
):
    records, env = guard_in_process("main", loaded=[LIB])
    assert env == driver_env.GUARD_ENV
    assert [level for level, _ in records] == ["WARNING"]
    assert records[0][1].endswith(
        f"The Intel driver is already loaded here ({LIB}), so they take effect in the "
        "processes this one spawns, not in this one nor in Ray workers (docs/multi-node.md)"
    )


def test_a_rank_without_the_driver_loaded_still_sets_them(guard_in_process):
    records, env = guard_in_process("ray_worker")
    assert env == driver_env.GUARD_ENV
    assert [level for level, _ in records] == ["WARNING"]
    assert "in this process, which did not inherit them" in records[0][1]
