"""Driver guard on constructed host trees (see tests/hosts.py for their formats)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hosts import A770, B60, B70, NVIDIA_L4, build_host

from vllm_xpu_memfix.core import config, log, numbers
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import driver, driver_records


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
    lines = [line for line in result.stderr.splitlines() if "driver guard" in line]
    (set_it,) = [line for line in lines if "driver guard: set " in line]
    assert set_it.startswith("WARNING") and "4 Battlemage GPUs visible" in set_it
    assert "vllm-xpu-memfix explain driver_host_copy" in set_it
    assert any("#50269" in line and "26.05" in line for line in lines), "Intel's positions"
    assert any("VLLM_XPU_MEMFIX_DRIVER_ENV=off" in line for line in lines)


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
    assert "in this process (not inherited)" in result.stderr
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


DRIVER_NAMES = (*driver_env.DRIVER_KEYS, "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
REPO = Path(__file__).resolve().parent.parent
LIB = "/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1"
KERNEL_6 = "6.14.0-37-generic"  # before the xe fix of compute-runtime #916
READ, DEFER, NO_PEER = driver_env.READ, driver_env.DEFER, driver_env.NO_PEER


@pytest.fixture
def guard_in_process(tmp_path, monkeypatch):
    """Run driver_env.install here as a process of ``role`` with the driver mapped or not,
    ``at_start`` the environment it started with, ``now`` its environment at registration;
    returns the records, DEBUG included, and the driver keys in os.environ afterwards."""
    from vllm_xpu_memfix.core.process import ProcessRole

    for name in DRIVER_NAMES:
        # Set, then delete: monkeypatch then restores the key's absence after the test,
        # also when install() has set it in os.environ.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    caught: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = caught.append  # type: ignore[method-assign]
    driver_records.logger.addHandler(handler)
    monkeypatch.setattr(driver_records.logger, "level", logging.DEBUG)

    def run(role, gpus=(B70,) * 4, loaded=(), at_start=None, now=None, mode="auto", **host):
        root = build_host(tmp_path / f"host{len(list(tmp_path.iterdir()))}", list(gpus), **host)
        monkeypatch.setattr(driver_env, "current_role", lambda: ProcessRole(role))
        monkeypatch.setattr(driver, "loaded_driver_libraries", lambda: list(loaded))
        monkeypatch.setattr(driver_env, "environ_at_start", lambda: dict(at_start or {}))
        for name in DRIVER_NAMES:
            monkeypatch.delenv(name, raising=False)
        for name, value in (now or {}).items():
            monkeypatch.setenv(name, value)
        caught.clear()
        settings = settings_for(
            root, VLLM_XPU_MEMFIX_DRIVER_ENV=mode, VLLM_XPU_MEMFIX_LOCK_DIR=str(tmp_path / "lk")
        )
        driver_env.install(None, settings)
        records = [(r.levelname, r.getMessage()) for r in caught]
        return records, {k: os.environ[k] for k in driver_env.DRIVER_KEYS if k in os.environ}

    yield run
    driver_records.logger.removeHandler(handler)


def test_a_rank_with_the_driver_loaded_sets_nothing_and_says_the_copy_stays(guard_in_process):
    records, env = guard_in_process("worker", loaded=[LIB])
    assert env == {}
    assert [level for level, _ in records] == ["ERROR", "DEBUG", "DEBUG"]
    message = records[0][1]
    assert "the Intel driver started without NEOReadDebugKeys=1 EnableDeferBacking=0" in message
    assert "it will pin a host copy of every device allocation" in message
    assert message.endswith("See vllm-xpu-memfix explain driver_host_copy")
    assert records[1][1].endswith(LIB) and "4 Battlemage GPUs visible" in records[2][1]


def test_variables_set_after_start_in_a_rank_with_the_driver_loaded_are_too_late(
    guard_in_process,
):
    records, env = guard_in_process(
        "ray_worker", loaded=[LIB], at_start={}, now=dict(driver_env.GUARD_ENV)
    )
    assert env == driver_env.GUARD_ENV  # left as they were, but not taken as working
    assert [level for level, _ in records] == ["ERROR", "DEBUG", "DEBUG"]
    assert "EnableDeferBacking=0 were set after the Intel driver started" in records[0][1]


def test_variables_the_rank_started_with_are_taken_as_working(guard_in_process):
    guard = dict(driver_env.GUARD_ENV)
    records, env = guard_in_process("worker", loaded=[LIB], at_start=guard, now=guard)
    assert env == guard
    assert records == [
        (
            "INFO",
            "vllm-xpu-memfix: driver guard: driver variables in this worker: "
            "NEOReadDebugKeys=1 EnableDeferBacking=0",
        )
    ]


def test_no_error_where_the_guard_is_not_needed_even_with_the_driver_loaded(guard_in_process):
    records, env = guard_in_process("worker", gpus=[B60], loaded=[LIB])
    assert env == {}
    assert [level for level, _ in records] == ["DEBUG"]


def test_process_0_with_the_driver_loaded_still_sets_them_for_the_processes_it_starts(
    guard_in_process,
):
    records, env = guard_in_process("main", loaded=[LIB])
    assert env == driver_env.GUARD_ENV
    assert [level for level, _ in records] == [
        "WARNING",
        "WARNING",
        "INFO",
        "INFO",
        "DEBUG",
        "DEBUG",
    ]
    assert records[1][1] == (
        f"vllm-xpu-memfix: driver guard: the Intel driver is already loaded here ({LIB}): the "
        "variables take effect in the processes this one spawns, not in this one nor in Ray "
        "workers (vllm-xpu-memfix ray-env prints them for Ray)"
    )


def test_a_rank_without_the_driver_loaded_still_sets_them(guard_in_process):
    records, env = guard_in_process("ray_worker")
    assert env == driver_env.GUARD_ENV
    assert records[0][0] == "WARNING"
    assert "in this process (not inherited)" in records[0][1]


# --- the decision, row by row, in process 0 and in a late (Ray) worker -----------------


@dataclass(frozen=True)
class Row:
    """One row of the decision on a recorded host: what is set, a part of the reason,
    compute-runtime #916 (None, "certain" or "not ruled out"), and the level of the first
    (most serious) record and parts of the records in process 0 and in a Ray worker that
    started the driver before the plugin, with ``env`` in the environment it started with."""

    gpus: tuple[tuple[int, int], ...]
    sets: dict[str, str]
    reason: str
    main: tuple[str, tuple[str, ...]]
    late: tuple[str, tuple[str, ...]]
    env: dict[str, str] = field(default_factory=dict)
    runtime: str | None = "26.14.37833.4"
    kernel: str | None = "7.1.8+deb13-amd64"
    mode: str = "auto"
    oom: str | None = None


GUARD = dict(driver_env.GUARD_ENV)
SET_IT = ("set NEOReadDebugKeys=1 EnableDeferBacking=0 in this vLLM", "Intel's interim")
TOO_LATE = ("the Intel driver started without", "it will pin a host copy")
OOM = (
    "every device allocation fails with UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY here "
    "(compute-runtime #916",
    "remedies for compute-runtime #916: kernel 7.1 or later; compute-runtime 26.22.38646.4 or "
    "later (26.27 on master); or VLLM_XPU_MEMFIX_DRIVER_ENV=no_peer_access (no P2P)",
    "vllm-xpu-memfix explain xe_peer_context_oom",
)
NOT_RULED_OUT = ("compute-runtime #916 could not be ruled out", "remedies for compute-runtime #916")
MIXED = "1 Battlemage and 1 other Intel GPU(s) visible: the host copy is reported only between"
ROWS = {
    "one GPU visible (mask)": Row(
        (B70, B70),
        {},
        "1 Intel GPU visible to this process: no peer, so no host copy",
        ("DEBUG", ("driver guard not needed: 1 Intel GPU visible",)),
        ("INFO", ("driver guard not needed on this node: 1 Intel GPU visible",)),
        env={"ZE_AFFINITY_MASK": "0"},
        kernel=KERNEL_6,
    ),
    "one B60": Row(
        (B60,),
        {},
        "1 Intel GPU visible",
        ("DEBUG", ("driver guard not needed: 1 Intel GPU",)),
        ("INFO", ("not needed on this node: 1 Intel GPU",)),
    ),
    "no Intel GPU": Row(
        (NVIDIA_L4, NVIDIA_L4),
        {},
        "no Intel GPU visible under",
        ("DEBUG", ("driver guard not needed: no Intel GPU",)),
        ("INFO", ("not needed on this node: no Intel GPU",)),
    ),
    "ForceZe=0 set (and #916 avoided)": Row(
        (B70, B70),
        {},
        "NEOReadDebugKeys=1 ForceZeDeviceCanAccessPerReturnValue=0 set by the user: "
        "zeDeviceCanAccessPeer answers false, so no peer residency and no host copy",
        ("INFO", ("driver guard set nothing: NEOReadDebugKeys=1 ForceZe",)),
        ("INFO", ("driver variables in this worker: NEOReadDebugKeys=1 ForceZe",)),
        env={READ: "1", NO_PEER: "0"},
        kernel=KERNEL_6,
    ),
    "EnableDeferBacking=0 set": Row(
        (B70, B70),
        {},
        "NEOReadDebugKeys=1 EnableDeferBacking=0 set by the user: the peer imports' host "
        "backing is not pinned",
        ("INFO", ("driver guard set nothing: NEOReadDebugKeys=1 EnableDeferBacking=0",)),
        ("INFO", ("driver variables in this worker: NEOReadDebugKeys=1 EnableDeferBacking=0",)),
        env=GUARD,
    ),
    "NEOReadDebugKeys=1 alone": Row(
        (B70,) * 4,
        {DEFER: "0"},
        "4 Battlemage GPUs visible, compute-runtime 26.14.37833.4-1~24.04",
        ("WARNING", ("set EnableDeferBacking=0 in this vLLM", "Intel's interim")),
        ("ERROR", ("the Intel driver started without EnableDeferBacking=0",)),
        env={READ: "1"},
    ),
    "#916 on kernel 6.x": Row(
        (B70, B70),
        GUARD,
        "2 Battlemage GPUs visible",
        ("WARNING", (*SET_IT, *NOT_RULED_OUT)),
        ("ERROR", (*TOO_LATE, *NOT_RULED_OUT)),
        kernel=KERNEL_6,
        oom="not ruled out",
    ),
    "#916 condition on kernel 7.1": Row(
        (B70, B70),
        GUARD,
        "2 Battlemage GPUs visible",
        ("WARNING", SET_IT),
        ("ERROR", TOO_LATE),
        kernel="7.1.0-rc1",
    ),
    "A770 pair on kernel 6.x": Row(
        (A770, A770),
        {},
        "0 Battlemage and 2 other Intel GPU(s) visible",
        ("WARNING", ("driver guard set nothing", *NOT_RULED_OUT)),
        ("WARNING", ("driver guard set nothing", *NOT_RULED_OUT)),
        kernel=KERNEL_6,
        oom="not ruled out",
    ),
    "compute-runtime 26.05": Row(
        (B70, B70),
        {},
        "compute-runtime 26.05.37020.3-1~24.04 is outside the affected range",
        ("INFO", ("driver guard set nothing: compute-runtime 26.05",)),
        ("INFO", ("driver guard set nothing: compute-runtime 26.05",)),
        runtime="26.05.37020.3",
    ),
    "compute-runtime 26.05 on kernel 6.x": Row(
        (B70, B70),
        {},
        "outside the affected range",
        ("WARNING", ("driver guard set nothing", *NOT_RULED_OUT)),
        ("WARNING", ("driver guard set nothing", *NOT_RULED_OUT)),
        runtime="26.05.37020.3",
        kernel=KERNEL_6,
        oom="not ruled out",
    ),
    "compute-runtime 26.14": Row(
        (B70,) * 4,
        GUARD,
        "4 Battlemage GPUs visible, compute-runtime 26.14",
        ("WARNING", SET_IT),
        ("ERROR", TOO_LATE),
    ),
    "compute-runtime 26.27 on kernel 6.x": Row(
        (B70, B70),
        GUARD,
        "compute-runtime 26.27.39122.10",
        ("WARNING", SET_IT),
        ("ERROR", TOO_LATE),
        runtime="26.27.39122.10",
        kernel=KERNEL_6,
    ),
    # Newer than any tag in compute-runtime's tree (its build is made up): no release is
    # known to stop the copy (facts.HOST_COPY_FIXED is None), so it still pins.
    "compute-runtime 26.35": Row(
        (B70, B70),
        GUARD,
        "compute-runtime 26.35.39800.1",
        ("WARNING", SET_IT),
        ("ERROR", TOO_LATE),
        runtime="26.35.39800.1",
    ),
    "mixed Battlemage and A770": Row(
        (B70, A770),
        {},
        MIXED,
        ("INFO", (f"driver guard set nothing: {MIXED}",)),
        ("INFO", (f"driver guard set nothing: {MIXED}",)),
    ),
    "mixed on kernel 6.x": Row(
        (B70, A770),
        {},
        MIXED,
        ("WARNING", (MIXED, *NOT_RULED_OUT)),
        ("WARNING", (MIXED, *NOT_RULED_OUT)),
        kernel=KERNEL_6,
        oom="not ruled out",
    ),
    "two Battlemage beside an A770": Row(
        (B70, A770, B70),
        GUARD,
        "2 Battlemage GPUs visible (and 1 other Intel GPU(s))",
        ("WARNING", SET_IT),
        ("ERROR", TOO_LATE),
    ),
    "ForceZe=maybe": Row(
        (B70, B70),
        GUARD,
        "2 Battlemage GPUs visible",
        ("WARNING", (*SET_IT, "not understood, taken as absent: ForceZe")),
        ("ERROR", (*TOO_LATE, "not understood, taken as absent: ForceZe")),
        env={NO_PEER: "maybe"},
    ),
    "EnableDeferBacking=off": Row(
        (B70, B70),
        {DEFER: "0"},
        "2 Battlemage GPUs visible",
        ("WARNING", ("set EnableDeferBacking=0", "EnableDeferBacking='off' (accepted:")),
        ("ERROR", ("started without EnableDeferBacking=0", "EnableDeferBacking='off' (accepted:")),
        env={READ: "1", DEFER: "off"},
    ),
    "kernel release unparsable": Row(
        (B70, B70),
        GUARD,
        "2 Battlemage GPUs visible",
        ("WARNING", (*SET_IT, *NOT_RULED_OUT, "unknown: the kernel release")),
        ("ERROR", (*TOO_LATE, *NOT_RULED_OUT, "kernel release 'linux-next' is not")),
        kernel="linux-next",
        oom="not ruled out",
    ),
    "osrelease unreadable": Row(
        (B70, B70),
        GUARD,
        "2 Battlemage GPUs visible",
        ("WARNING", (*SET_IT, *NOT_RULED_OUT, "osrelease could not be read")),
        ("ERROR", (*TOO_LATE, *NOT_RULED_OUT)),
        kernel=None,
        oom="not ruled out",
    ),
    "runtime unknown on kernel 6.x": Row(
        (B70, B70),
        GUARD,
        "compute-runtime unknown (taken as affected)",
        ("WARNING", (*SET_IT, *NOT_RULED_OUT, "unknown: the compute-runtime version")),
        ("ERROR", (*TOO_LATE, *NOT_RULED_OUT)),
        runtime=None,
        kernel=KERNEL_6,
        oom="not ruled out",
    ),
    "NEOReadDebugKeys=0": Row(
        (B70, B70),
        {},
        "NEOReadDebugKeys=0 set by the user is left as it is",
        ("WARNING", ("driver guard set nothing", "will pin a host copy")),
        ("WARNING", ("driver guard set nothing", "will pin a host copy")),
        env={READ: "0"},
    ),
    "EnableDeferBacking=1": Row(
        (B70, B70),
        {},
        "EnableDeferBacking=1 set by the user is left as it is",
        ("WARNING", ("will pin a host copy",)),
        ("WARNING", ("will pin a host copy",)),
        env={READ: "1", DEFER: "1"},
    ),
    "EnableDeferBacking=0 without NEOReadDebugKeys": Row(
        (B70, B70),
        {READ: "1"},
        "EnableDeferBacking=0 was set without NEOReadDebugKeys=1",
        ("WARNING", ("set NEOReadDebugKeys=1 in this vLLM",)),
        ("ERROR", ("the Intel driver started without NEOReadDebugKeys=1",)),
        env={DEFER: "0"},
    ),
    "no_peer_access": Row(
        (B70, B70),
        {READ: "1", NO_PEER: "0"},
        "VLLM_XPU_MEMFIX_DRIVER_ENV=no_peer_access",
        (
            "WARNING",
            (
                "set NEOReadDebugKeys=1 ForceZeDeviceCanAccessPerReturnValue=0 in this vLLM",
                "no peer access, so no host copy and no #916 failure, but no P2P",
                "cost of no P2P: oneCCL falls back to its USM (host-staged) collectives",
            ),
        ),
        ("ERROR", ("ForceZeDeviceCanAccessPerReturnValue=0; P2P stays on", *NOT_RULED_OUT)),
        kernel=KERNEL_6,
        mode="no_peer_access",
    ),
    "on, one GPU": Row(
        (B60,),
        GUARD,
        "VLLM_XPU_MEMFIX_DRIVER_ENV=on",
        ("WARNING", SET_IT),
        ("ERROR", ("the Intel driver started without", "this process runs without them")),
        mode="on",
    ),
}


def _oom_kind(decision: driver_env.Decision) -> str | None:
    oom = decision.xe_peer_oom
    return None if oom is None else ("certain" if oom.certain else "not ruled out")


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_each_row_decides_the_environment(tmp_path, row):
    root = build_host(tmp_path, list(row.gpus), runtime=row.runtime, kernel=row.kernel)
    decision = driver_env.decide(settings_for(root, VLLM_XPU_MEMFIX_DRIVER_ENV=row.mode), row.env)
    assert (decision.env, decision.apply) == (row.sets, bool(row.sets)), decision.reason
    assert row.reason in decision.reason
    assert _oom_kind(decision) == row.oom
    environ = dict(row.env)
    driver_env.apply(decision, environ)
    assert environ == {**row.env, **row.sets}


def assert_records(records, row, expected):
    """The records of one process: the first at the row's level with the most serious
    finding, none less serious before a more serious one, each within the limit."""
    level, parts = expected
    texts = "\n".join(text for _, text in records)
    assert records[0][0] == level, records
    for part in parts:
        assert part in texts, (part, records)
    ranks = [logging.getLevelName(name) for name, _ in records]
    assert ranks == sorted(ranks, reverse=True), "the most serious first"
    assert all(len(text) <= log.LIMIT for _, text in records), records
    if row.oom == "certain":
        assert "every device allocation fails" in records[0][1], "the failure comes first"


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_each_row_gives_its_records_in_process_0(guard_in_process, row):
    host = {"runtime": row.runtime, "kernel": row.kernel}
    records, env = guard_in_process("main", row.gpus, now=row.env, mode=row.mode, **host)
    assert env == {k: v for k, v in {**row.env, **row.sets}.items() if k in env}
    assert_records(records, row, row.main)
    assert any(
        "#916 could not be ruled out" in t or "UR_RESULT_ERROR" in t for _, t in records
    ) is (row.oom is not None)


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_each_row_gives_its_records_in_a_late_ray_worker(guard_in_process, row):
    """vLLM's Ray worker has started the driver before the plugin loads: nothing is set,
    and the records judge the environment the worker started with."""
    host = {"runtime": row.runtime, "kernel": row.kernel}
    records, env = guard_in_process(
        "ray_worker", row.gpus, loaded=[LIB], at_start=row.env, now=row.env, mode=row.mode, **host
    )
    assert env == {k: v for k, v in row.env.items() if k in driver_env.DRIVER_KEYS}
    assert_records(records, row, row.late)


def test_the_interim_note_is_said_once_per_host_while_its_speaker_lives(tmp_path):
    """Two processes on one host (one lock directory): the first names Intel's positions,
    the second does not while the first lives; after it exits, the next one does."""
    root = build_host(tmp_path / "host", [B70] * 4)
    code = textwrap.dedent(
        """
        import sys
        from vllm_xpu_memfix.core import config
        from vllm_xpu_memfix.fixes import driver_env

        driver_env.install(None, config.load())
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    script = tmp_path / "guard.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in driver_env.DRIVER_KEYS}
    env.update(VLLM_XPU_MEMFIX_SYSROOT=str(root), VLLM_XPU_MEMFIX_LOCK_DIR=str(tmp_path / "lk"))

    def start() -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        return process

    def finish(process: subprocess.Popen[str]) -> str:
        _, err = process.communicate("\n", timeout=60)
        lines = [line for line in err.splitlines() if "driver guard" in line]
        assert (
            sum("driver guard: set NEOReadDebugKeys=1 EnableDeferBacking=0" in x for x in lines)
            == 1
        )
        return "\n".join(lines)

    first = start()
    second = start()
    second_line, first_line = finish(second), finish(first)
    assert "Intel's interim workaround" in first_line and "26.05" in first_line
    assert "Intel's interim workaround" not in second_line
    assert "Intel's interim workaround" in finish(start())


def test_a_speaker_is_a_live_process_by_pid_and_start_time(tmp_path):
    from vllm_xpu_memfix.core import host_lock
    from vllm_xpu_memfix.core.process import start_time

    speaker = tmp_path / "lk" / "note.speaker"
    assert host_lock.first_alive(tmp_path / "lk", "note")  # nobody yet
    assert host_lock.first_alive(tmp_path / "lk", "note")  # still this process
    parent = os.getppid()
    speaker.write_text(f"{parent} {start_time(parent)}\n")
    assert not host_lock.first_alive(tmp_path / "lk", "note")  # a live other process
    speaker.write_text(f"{parent} 1\n")  # its pid, but another start: a reused pid
    assert host_lock.first_alive(tmp_path / "lk", "note")
    assert speaker.read_text() == f"{os.getpid()} {start_time(os.getpid())}\n"


def test_an_unusable_lock_directory_says_the_note_rather_than_never(guard_in_process, tmp_path):
    # A world-writable directory: the setting takes it, the lock refuses it at use (a file
    # there is refused by the setting already).
    (tmp_path / "lk").mkdir()
    (tmp_path / "lk").chmod(0o777)
    records, _ = guard_in_process("main")
    assert any("Intel's interim workaround" in text for _, text in records)


# --- the records on three hosts: #916's, the host copy's, one GPU ---------------------

ANCHORS = re.compile(r'<a id="([a-z0-9_]+)"></a>')


def pointers(text: str) -> list[str]:
    return re.findall(r"vllm-xpu-memfix explain ([a-z0-9_]+)", text)


def assert_pointers_exist(records) -> None:
    """Every section a record points to is a cause code of doctor's with an anchor there."""
    from vllm_xpu_memfix.startup import codes

    anchors = set(ANCHORS.findall((REPO / "docs/troubleshooting.md").read_text()))
    for _, text in records:
        for code in pointers(text):
            assert code in codes.CAUSES and code in anchors, (code, text)


def test_on_the_916_host_the_possible_failure_comes_first_with_its_cause(guard_in_process):
    """compute-runtime #916's host (2 Battlemage, 26.14, kernel 6.14): the failure, then its
    remedies, before the setting that does not help it. The guard cannot read whether the
    GPUs reach each other, so the failure is possible, a WARNING, not certain."""
    records, _ = guard_in_process("main", (B70, B70), kernel=KERNEL_6)
    (level, failure), (_, remedies), (set_level, set_it), *_ = records
    assert (level, set_level) == ("WARNING", "WARNING")
    assert failure.startswith(
        "vllm-xpu-memfix: driver guard: compute-runtime #916 could not be ruled out (2 Intel GPUs"
    )
    assert pointers(remedies) == ["xe_peer_context_oom"] and "kernel 7.1 or later" in remedies
    assert "set NEOReadDebugKeys=1 EnableDeferBacking=0" in set_it
    assert pointers(set_it) == ["driver_host_copy"]
    assert all(len(text) <= log.LIMIT for _, text in records)
    assert not any("WARNING" in text for level, text in records if level == "DEBUG")
    assert_pointers_exist(records)


def test_on_the_host_copy_host_the_setting_comes_with_intels_two_positions(guard_in_process):
    """4 Battlemage, 26.14, kernel 7.1: the key is set (WARNING, driver_host_copy); Intel's
    two positions and the production route in one short INFO record; details at DEBUG."""
    records, _ = guard_in_process("main")
    assert [level for level, _ in records] == ["WARNING", "INFO", "INFO", "DEBUG", "DEBUG"]
    (_, set_it), (_, opt_out), (_, positions), *_ = records
    assert pointers(set_it) == ["driver_host_copy"] and "4 Battlemage GPUs visible" in set_it
    assert opt_out.endswith("VLLM_XPU_MEMFIX_DRIVER_ENV=off")
    for part in ("interim workaround (vllm #50269)", "debug-only", "26.05", "#953"):
        assert part in positions
    assert all(len(text) <= log.LIMIT for _, text in records)
    assert_pointers_exist(records)


def test_with_one_gpu_the_guard_says_one_debug_record(guard_in_process):
    records, _ = guard_in_process("main", (B60,))
    assert records == [
        (
            "DEBUG",
            "vllm-xpu-memfix: driver guard not needed: 1 Intel GPU visible to this process: no "
            "peer, so no host copy",
        )
    ]


def test_a_tp_worker_leaves_the_host_findings_to_the_process_that_said_them(
    guard_in_process, tmp_path
):
    """On the #916 host, with process 0 alive and speaking for the host, a worker that
    inherited the keys logs its variables at INFO and #916 only at DEBUG, without the word
    WARNING: the finding is said once per host, not by every TP worker."""
    from vllm_xpu_memfix.core import host_lock
    from vllm_xpu_memfix.core.process import start_time

    speaker = host_lock.prepare_lock_dir(tmp_path / "lk") / "driver_env-xe_peer_context_oom.speaker"
    parent = os.getppid()  # alive for the whole test: it stands for process 0
    speaker.write_text(f"{parent} {start_time(parent)}\n")
    records, _ = guard_in_process("worker", (B70, B70), now=GUARD, kernel=KERNEL_6)
    loud = [(level, text) for level, text in records if level != "DEBUG"]
    assert loud == [
        (
            "INFO",
            "vllm-xpu-memfix: driver guard: driver variables in this worker: "
            "NEOReadDebugKeys=1 EnableDeferBacking=0",
        )
    ]
    quiet = [text for level, text in records if level == "DEBUG"]
    assert any("#916 could not be ruled out" in text for text in quiet)
    assert not any("WARNING" in text for text in quiet)
    # With nobody speaking for the host (process 0 gone), the worker says it.
    speaker.write_text(f"{parent} 1\n")
    records, _ = guard_in_process("worker", (B70, B70), now=GUARD, kernel=KERNEL_6)
    assert records[0][0] == "WARNING" and "#916 could not be ruled out" in records[0][1]


def findings_from(out: str, head: str) -> list[str]:
    """The findings printed from the line that starts with ``head``: it and each line
    indented past it, a wrapped line's continuations (4 more than it) joined back to it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    base = len(head) - len(head.lstrip())
    found: list[tuple[int, str]] = []
    for line in lines[start:]:
        indent = len(line) - len(line.lstrip())
        if found and indent <= base:
            break
        assert len(line) <= 100, line
        if found and indent >= found[-1][0] + 4:
            found[-1] = (found[-1][0], f"{found[-1][1]} {line.strip()}")
        else:
            found.append((indent, line.strip()))
    return [text for _, text in found]


def test_check_shows_the_decision_the_guard_makes(tmp_path, capsys, clean_env, monkeypatch):
    from vllm_xpu_memfix.cli import main

    root = build_host(tmp_path / "host", [B70, B70], kernel=KERNEL_6)
    monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(root))
    for name in DRIVER_NAMES:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "src/vllm").mkdir(parents=True)
    assert main(["check", "--source", str(tmp_path / "src")]) == 0
    said = findings_from(capsys.readouterr().out, "driver_env:")
    decision = driver_env.decide(config.load(), os.environ)
    first, *remarks = driver_env.summary_lines(decision)
    assert said == [f"driver_env: {first}", *remarks]
    assert said[0].startswith(
        "driver_env: sets NEOReadDebugKeys=1 EnableDeferBacking=0: 2 Battlemage GPUs visible"
    )
    assert said[1].startswith("compute-runtime #916 could not be ruled out")
    assert said[2].startswith("Remedies: kernel 7.1 or later")


@pytest.mark.parametrize("kernel", [KERNEL_6, "7.1.8-arch1-1"])
def test_check_and_doctor_show_the_decision_the_guard_makes(
    tmp_path, capsys, clean_env, monkeypatch, kernel
):
    """One host, three readers: driver_env.decide, `check` and `doctor` (text and JSON)
    give the same findings, #916's warning included on the older kernel: the text a
    finding a line (wrapped at 100), the JSON in one string."""
    import json

    from vllm_xpu_memfix.cli import main

    root = build_host(tmp_path / "host", [B70, B70], kernel=kernel)
    monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(root))
    for name in DRIVER_NAMES:
        monkeypatch.delenv(name, raising=False)
    first, *remarks = driver_env.summary_lines(driver_env.decide(config.load(), os.environ))
    expected = driver_env.summary(driver_env.decide(config.load(), os.environ))
    assert expected == ". ".join([first, *remarks])
    (tmp_path / "src/vllm").mkdir(parents=True)
    assert main(["check", "--source", str(tmp_path / "src")]) == 0
    said = findings_from(capsys.readouterr().out, "driver_env:")
    assert said == [f"driver_env: {first}", *remarks]
    assert main(["doctor", "--params", "8B"]) == 0
    said = findings_from(capsys.readouterr().out, "  driver guard ")
    assert said == [f"driver guard {first}", *remarks]
    assert main(["doctor", "--params", "8B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"]["driver_guard"] == expected
    assert ("compute-runtime #916 could not be ruled out" in expected) is (kernel == KERNEL_6)
