"""Process roles and the lock scope key, with Ray's runtime context replaced by stand-ins.

The real-Ray counterparts are in tests/test_ray.py; these cover the shapes a real local
cluster does not give: vLLM's legacy unnamed RayWorkerWrapper actors, other Ray actors,
and a Ray whose runtime context is missing or broken.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import pytest

from vllm_xpu_memfix.core import host_lock
from vllm_xpu_memfix.core.process import current_role, environ_at_start, instance_key


def fake_ray(monkeypatch, *, initialized=True, **context) -> None:
    values = {
        "actor_id": "a1b2",
        "actor_name": None,
        "task_name": None,
        "node_id": "e826eb67f5c4e6cf5e75258c3543b273",
        "placement_group_id": None,
        "job_id": "01000000",
        **context,
    }
    runtime = SimpleNamespace(**{f"get_{k}": (lambda v=v: v) for k, v in values.items()})
    module = ModuleType("ray")
    module.is_initialized = lambda: initialized  # type: ignore[attr-defined]
    module.get_runtime_context = lambda: runtime  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", module)


def test_a_v2_worker_actor_is_named_by_vllm_with_its_instance_and_rank(monkeypatch):
    fake_ray(
        monkeypatch,
        actor_name="vllm_Worker_1796306673536_TP1_PP0",
        task_name="RayWorkerProc.initialize_worker",
        placement_group_id="pg9",
    )
    role = current_role()
    assert (role.role, role.ray.rank, role.ray.instance) == (
        "ray_worker",
        "TP1_PP0",
        "1796306673536",
    )
    assert role.describe().startswith("role=ray_worker rank=TP1_PP0 node=")
    assert role.describe().endswith(" ray_node=e826eb67")
    assert instance_key() == "vllm1796306673536"
    assert host_lock.scoped_name("load", "instance") == "load-vllm1796306673536"
    assert host_lock.scoped_name("load", "host") == "load"


def test_a_legacy_unnamed_worker_actor_is_keyed_by_its_placement_group_then_its_job(monkeypatch):
    fake_ray(monkeypatch, task_name="RayWorkerWrapper.execute_method", placement_group_id="pg/7")
    role = current_role()
    assert role.role == "ray_worker" and role.ray.rank is None
    assert "rank=unknown" in role.describe()
    assert instance_key() == "pgpg_7", "a key is a file-name part"
    fake_ray(monkeypatch, task_name="RayWorkerWrapper.execute_method")
    assert instance_key() == "job01000000"


def test_another_ray_actor_keeps_its_process_role_and_the_engine_core_key(monkeypatch):
    fake_ray(monkeypatch, actor_name="SERVE_REPLICA::llm#x", task_name="ServeReplica.handle")
    role = current_role()
    assert role.role == "main" and role.ray is not None  # e.g. a Ray Serve replica running LLM
    assert instance_key() == f"engine{os.getppid()}"


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(ModuleType("ray"), id="no runtime-context API"),
        pytest.param(
            SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: 1 / 0),
            id="runtime context raises",
        ),
    ],
)
def test_a_ray_without_a_runtime_context_gives_one_note_and_the_process_role(monkeypatch, broken):
    monkeypatch.setitem(sys.modules, "ray", broken)
    role = current_role()
    assert (role.role, role.ray) == ("main", None)
    assert role.describe().startswith("role=main; ray is imported but gives no runtime context (")
    assert role.describe().endswith("); role taken from the process name")
    assert instance_key() == f"engine{os.getppid()}"


def test_ray_not_imported_or_not_initialised_is_no_ray_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert current_role().describe() == "role=main"
    fake_ray(monkeypatch, initialized=False)
    assert current_role().describe() == "role=main"
    fake_ray(monkeypatch, actor_id=None)  # the driver of a Ray job
    assert current_role().describe() == "role=main"


def test_environ_at_start_ignores_later_changes(monkeypatch):
    monkeypatch.setenv("VLLM_XPU_MEMFIX_TEST_LATE", "1")
    at_start = environ_at_start()
    assert at_start is not None and "PATH" in at_start
    assert "VLLM_XPU_MEMFIX_TEST_LATE" not in at_start
