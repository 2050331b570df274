"""The plugin in Ray actors started as vLLM's Ray workers are, on a real local Ray cluster.

vLLM's CPU platform refuses the Ray executor, so no vLLM server runs on Ray here. The
actors are what vLLM 0.32's RayExecutorV2 starts for each rank: a fresh Ray worker
process, named ``vllm_Worker_<instance id>_TP<rank>``, with its own ``runtime_env``
``env_vars``, that calls ``vllm.plugins.load_general_plugins()``
(tests/helpers/ray_actors.py). The host is the constructed 4x Arc Pro B70 tree of
tests/hosts.py, given to each actor as ``VLLM_XPU_MEMFIX_SYSROOT`` in its runtime_env;
the Intel driver is a stand-in shared object named like it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hosts import B70, build_host

ray = pytest.importorskip("ray", reason="ray is not installed (it is in the `test` extra)")

from helpers.ray_actors import VllmWorkerStandIn  # noqa: E402

from vllm_xpu_memfix.core.log import LIMIT  # noqa: E402
from vllm_xpu_memfix.core.process import START_VARIABLE  # noqa: E402
from vllm_xpu_memfix.fixes.driver_env import GUARD_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER_PATH = os.pathsep.join([str(REPO), str(REPO / "tests")])
GUARD_LINE = "set NEOReadDebugKeys=1 EnableDeferBacking=0 in this"
UNSET = {"NEOReadDebugKeys": None, "EnableDeferBacking": None}
RAY_START = "4242-777-abcdef"
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.server,  # a real Ray cluster: slow, so out of `make test-fast`
]


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    """One local Ray head; its raylet, and so every Ray worker, starts without plugin or
    driver variables."""
    with pytest.MonkeyPatch.context() as env:
        for name in list(os.environ):
            if name.startswith("VLLM_XPU_MEMFIX") or name in GUARD_ENV or name == "VLLM_PLUGINS":
                env.delenv(name)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hosts")
    no_gpu = root / "no-gpu"
    no_gpu.mkdir()
    return {"4x B70": build_host(root / "4xB70", [B70] * 4), "no GPU": no_gpu}


@pytest.fixture(scope="module")
def stand_in_driver(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An empty shared object named like compute-runtime's Level Zero driver."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver library")
    directory = tmp_path_factory.mktemp("driver")
    (directory / "empty.c").write_text("int stand_in_driver;\n")
    library = directory / "libze_intel_gpu.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(library), str(directory / "empty.c")], check=True
    )
    return str(library)


def instance_id() -> str:
    return str(time.time_ns())  # vLLM 0.32's VllmConfig.instance_id is time.time_ns() digits


def start(name: str, sysroot: Path, env: dict[str, str] | None = None) -> Any:
    env_vars = {
        "PYTHONPATH": WORKER_PATH,
        "VLLM_PLUGINS": "xpu_memfix",
        "VLLM_XPU_MEMFIX_SYSROOT": str(sysroot),
        **(env or {}),
    }
    actor = ray.remote(VllmWorkerStandIn)
    return actor.options(name=name, num_cpus=0, runtime_env={"env_vars": env_vars}).remote()


@pytest.fixture(scope="module")
def registrations(ray_cluster: Any, hosts: dict[str, Path], stand_in_driver: str) -> dict:
    """Each case is one fresh actor; all register at once (each worker imports vLLM)."""
    b70 = hosts["4x B70"]
    cases: dict[str, tuple[Any, dict[str, Any]]] = {
        "driver loaded": (
            start(f"vllm_Worker_{instance_id()}_TP0", b70),
            {"driver_library": stand_in_driver},
        ),
        "driver loaded, env copied later": (
            start(f"vllm_Worker_{instance_id()}_TP0", b70),
            {"driver_library": stand_in_driver, "late_env": dict(GUARD_ENV)},
        ),
        "runtime_env": (
            start(f"vllm_Worker_{instance_id()}_TP0", b70, dict(GUARD_ENV)),
            {"driver_library": stand_in_driver},
        ),
        "no Intel GPU": (start(f"vllm_Worker_{instance_id()}", hosts["no GPU"]), {}),
    }
    job = another_job(ray_cluster, b70, stand_in_driver)
    refs = {case: actor.register.remote(**kwargs) for case, (actor, kwargs) in cases.items()}
    results = dict(zip(refs, ray.get(list(refs.values()), timeout=240), strict=True))
    for actor, _ in cases.values():
        ray.kill(actor)
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err[-3000:]
    results["job runtime_env"] = json.loads(out.strip().splitlines()[-1])
    return results


def another_job(address: str, sysroot: Path, driver_library: str) -> subprocess.Popen[str]:
    """A second Ray job on the cluster, with the guard in its runtime_env; its one actor has
    env_vars of its own, as vLLM's worker actors do. Prints the actor's registration."""
    code = textwrap.dedent(
        f"""
        import json, sys, ray
        sys.path[:0] = {WORKER_PATH.split(os.pathsep)!r}
        from helpers.ray_actors import VllmWorkerStandIn
        ray.init(address={address!r}, log_to_driver=False,
                 runtime_env={{"env_vars": {dict(GUARD_ENV)!r}}})
        own = {{"PYTHONPATH": {WORKER_PATH!r}, "VLLM_PLUGINS": "xpu_memfix",
                "VLLM_XPU_MEMFIX_SYSROOT": {str(sysroot)!r},
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        actor = ray.remote(VllmWorkerStandIn).options(
            name="vllm_Worker_{instance_id()}_TP0", num_cpus=0,
            runtime_env={{"env_vars": own}}).remote()
        print(json.dumps(ray.get(actor.register.remote({driver_library!r}), timeout=180)))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in GUARD_ENV}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines(result: dict, level: str) -> list[str]:
    return [line for line in result["lines"] if line.startswith(level + " ")]


def test_a_fresh_worker_is_a_ray_worker_with_rank_and_node_and_sets_the_guard(one_engine):
    result = one_engine["registered"][1]
    assert result["pid"] != os.getpid()
    assert result["plugin"].startswith(str(REPO)), "the worker runs this checkout's plugin"
    assert result["role"] == "ray_worker"
    registered = [line for line in result["lines"] if " registered (" in line]
    assert len(registered) == 1
    assert f"role=ray_worker rank=TP1 node={socket.gethostname()} ray_node=" in registered[0]
    # Nothing mapped the driver yet, so variables set now still reach it.
    guard = [line for line in result["lines"] if GUARD_LINE in line]
    assert guard == [
        line
        for line in lines(result, "WARNING")
        if "in this process (not inherited) (4 Battlemage GPUs visible, "
        "compute-runtime 26.14.37833.4-1~24.04)" in line
    ]
    assert len(guard) == 1
    assert result["env"] == GUARD_ENV
    assert lines(result, "ERROR") == []


def test_a_worker_with_the_driver_loaded_gives_the_error_and_sets_nothing(
    registrations, stand_in_driver
):
    result = registrations["driver loaded"]
    assert result["env"] == UNSET
    assert not any(GUARD_LINE in line for line in result["lines"])
    (error,) = lines(result, "ERROR")
    assert error.startswith("ERROR vllm-xpu-memfix: driver guard cannot take effect in this ")
    assert "the Intel driver started without NEOReadDebugKeys=1 EnableDeferBacking=0" in error
    assert "it will pin a host copy of every device allocation" in error
    assert "Set them before the process starts (vllm-xpu-memfix ray-env prints them)" in error
    assert error.endswith("See vllm-xpu-memfix explain driver_host_copy")
    assert len(error) - len("ERROR ") <= LIMIT  # the driver's file and the reason: DEBUG


def test_variables_copied_in_after_the_driver_loaded_are_called_too_late(registrations):
    """RayExecutorV2 copies the driver's environment into the worker at initialize_worker,
    after the worker resolved vLLM's platform; the guard must not take them as working."""
    result = registrations["driver loaded, env copied later"]
    (error,) = lines(result, "ERROR")
    assert "NEOReadDebugKeys=1 EnableDeferBacking=0 were set after the Intel driver started" in (
        error
    )
    assert "it will pin a host copy of every device allocation" in error
    assert not any("driver variables in this worker" in line for line in result["lines"])


def test_variables_from_runtime_env_are_respected_even_with_the_driver_loaded(registrations):
    result = registrations["runtime_env"]
    assert result["env"] == GUARD_ENV
    assert lines(result, "ERROR") == []
    assert [line for line in result["lines"] if "driver variables in this worker" in line] == [
        "INFO vllm-xpu-memfix: driver guard: driver variables in this worker: "
        "NEOReadDebugKeys=1 EnableDeferBacking=0"
    ]


def test_a_node_without_intel_gpus_gives_one_line_and_no_error(registrations, hosts):
    result = registrations["no Intel GPU"]
    assert result["env"] == UNSET
    assert lines(result, "ERROR") == [] and lines(result, "WARNING") == []
    drm = hosts["no GPU"] / "sys/class/drm"
    guard = [line for line in result["lines"] if "driver guard" in line]
    assert guard == [
        f"INFO vllm-xpu-memfix: driver guard not needed on this node: no Intel GPU visible "
        f"under {drm}; the host copy needs 2 or more Battlemage"
    ]
    assert any("role=ray_worker rank=0 " in line for line in result["lines"])


def test_the_job_runtime_env_reaches_actors_that_set_their_own_env_vars(registrations):
    """What docs/multi-node.md tells Ray users: the job's runtime_env env_vars (ray.init in
    the process that creates the engine) are merged into a worker actor that has env_vars
    of its own, as vLLM's actors have on CUDA, and are there when the worker process starts."""
    result = registrations["job runtime_env"]
    assert result["env"] == GUARD_ENV
    assert lines(result, "ERROR") == []
    assert any("driver variables in this worker" in line for line in result["lines"])


@pytest.fixture(scope="module")
def one_engine(ray_cluster, hosts, tmp_path_factory) -> dict:
    """Two ranks of one engine on this node, with the instance-scoped warm-up lock and
    ledger JSON lines; both start vLLM's real warm-up at the same moment."""
    lock_dir = tmp_path_factory.mktemp("locks")
    ledger_dir = tmp_path_factory.mktemp("ledger")
    engine = instance_id()
    env = {
        "VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir),
        "VLLM_XPU_MEMFIX_WARMUP_SCOPE": "instance",
        "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir),
        # The start-up's identity, as vLLM 0.32's Ray executors copy the driver's VLLM_*.
        START_VARIABLE: RAY_START,
    }
    ranks = [start(f"vllm_Worker_{engine}_TP{r}", hosts["4x B70"], env) for r in (0, 1)]
    registered = ray.get([r.register.remote() for r in ranks], timeout=240)
    go_at = time.time() + 3.0  # after both workers have imported the warm-up module
    warm_ups = ray.get([r.warm_up.remote(go_at, 1.0) for r in ranks], timeout=240)
    ledgers = ray.get([r.process_weights.remote() for r in ranks], timeout=240)
    for rank in ranks:
        ray.kill(rank)
    return {
        "engine": engine,
        "registered": registered,
        "warm_ups": warm_ups,
        "ledgers": ledgers,
        "ledger_dir": ledger_dir,
    }


def test_two_ranks_of_one_engine_queue_on_one_node_local_warm_up_slot(one_engine, registrations):
    first, second = sorted(one_engine["warm_ups"], key=lambda w: w["start"])
    assert first["end"] <= second["start"], "the second rank ran its warm-up inside the first's"
    names = {r["warmup_lock"] for r in one_engine["registered"]}
    assert names == {f"warmup-vllm{one_engine['engine']}"}
    # Ray actors are all children of the raylet: the parent pid cannot tell engines apart.
    other_engine = registrations["driver loaded"]["warmup_lock"]
    assert other_engine.startswith("warmup-vllm") and other_engine not in names
    waited = [line for line in second["lines"] if "warm-up lock: qwen_triton_warmup waited" in line]
    assert len(waited) == 1 and f"for pid {first['pid']} since" in waited[0]
    assert not any("for pid" in line for line in first["lines"])


def test_each_ray_worker_writes_its_own_ledger_file(one_engine):
    host = socket.gethostname()
    pids = sorted(r["pid"] for r in one_engine["registered"])
    files = sorted(one_engine["ledger_dir"].iterdir())
    assert [f.name for f in files] == sorted(f"ledger-{host}-{pid}.jsonl" for pid in pids)
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["phase"] for r in rows] == ["weights loaded", "weights processed"]
        assert {r["role"] for r in rows} == {"ray_worker"}
        assert {r["start"] for r in rows} == {RAY_START}, "the driver's start-up, not a new one"
        assert {r["pid"] for r in rows} == {int(path.stem.rsplit("-", 1)[1])}


def test_the_driver_process_of_a_ray_job_is_not_a_ray_worker(ray_cluster):
    from vllm_xpu_memfix.core.process import current_role

    role = current_role()
    assert (role.role, role.ray, role.note) == ("main", None, None)
