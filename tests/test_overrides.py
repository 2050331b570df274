"""Platform workers that override a patched ``Worker`` method: the fixes reach the
override, act once when it calls ``super()``, and ``check`` says which is which.

Runs on vLLM's real ``Worker`` and ``XPUWorker`` classes (importable on the CPU build).
Intel's 0.14-based patch gave ``XPUWorker`` its own ``determine_available_memory``
without ``super()``; upstream's inherits it. The tests give the class such an override
for their duration, the way Intel's patch does, then install the plugin's patches.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core.patching import Patch, Patcher, State
from vllm_xpu_memfix.vllm_code import overrides

pytest.importorskip("vllm")

METHOD = "determine_available_memory"
TARGET = f"{overrides.WORKER}.{METHOD}"
XPU = "vllm.v1.worker.xpu_worker:XPUWorker"


@pytest.fixture
def xpu_worker():
    from vllm.v1.worker import xpu_worker

    return xpu_worker.XPUWorker


def install_counting(calls: list[str]) -> Patcher:
    def counting(wrapped, instance, args, kwargs):
        calls.append(type(instance).__name__)
        return wrapped(*args, **kwargs)

    patcher = Patcher()
    patcher.install_all(overrides.with_platform_overrides((Patch("t", TARGET, counting),)))
    return patcher


@pytest.mark.parametrize("calls_super", [False, True])
def test_an_override_is_patched_and_the_fix_acts_once(monkeypatch, xpu_worker, calls_super):
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.setattr(Worker, METHOD, lambda self: 100, raising=True)

    def own(self):
        return super(xpu_worker, self).determine_available_memory() + 1 if calls_super else 7

    monkeypatch.setattr(xpu_worker, METHOD, own, raising=False)
    calls: list[str] = []
    patcher = install_counting(calls)
    try:
        worker = object.__new__(xpu_worker)
        assert worker.determine_available_memory() == (101 if calls_super else 7)
        assert patcher.state(("t", f"{XPU}.{METHOD}"))[0] is State.APPLIED
    finally:
        patcher.revert_all()
    assert calls == ["XPUWorker"], "reached once, through the override"
    assert vars(xpu_worker)[METHOD] is own, "reverted to the override itself"


def test_an_inherited_method_is_patched_on_worker_only(xpu_worker):
    assert METHOD not in vars(xpu_worker), "upstream XPUWorker inherits it"
    calls: list[str] = []
    patcher = install_counting(calls)
    try:
        state, reason = patcher.state(("t", f"{XPU}.{METHOD}"))
        assert state is State.SKIPPED and "inherited, not overridden" in reason
        assert METHOD not in vars(xpu_worker), "nothing was put on the subclass"
    finally:
        patcher.revert_all()


def test_every_fix_patch_on_worker_reaches_the_platform_workers():
    patches = fixes.all_patches()
    derived = {p.target for p in patches if p.own_only}
    for method in overrides.patched_worker_methods(patches):
        for worker in overrides.PLATFORM_WORKERS:
            explicit = any(p.target == f"{worker}.{method}" and not p.own_only for p in patches)
            assert explicit or f"{worker}.{method}" in derived, (worker, method)


def test_check_reports_an_override_without_super(tmp_path):
    worker_dir = tmp_path / "vllm" / "v1" / "worker"
    worker_dir.mkdir(parents=True)
    (worker_dir / "xpu_worker.py").write_text(
        "class XPUWorker(Worker):\n"
        "    def __init__(self, *args):\n        super().__init__(*args)\n"
        "    def determine_available_memory(self):\n        return 1\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", "check", "--source", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # unwrapped
    assert (
        f"{XPU}.determine_available_memory: overrides without super() (the fixes patch "
        "the override too)" in text
    )
    assert (
        f"{XPU}.__init__: overrides, calls super() (patched there too; the fix acts "
        "once per call)" in text
    )
    assert "vllm.v1.worker.cpu_worker:CPUWorker: not in this vLLM" in text
    kv_headroom = text.split("kv_headroom (", 1)[1].split(" remove when ", 1)[0]
    assert kv_headroom.count("XPUWorker") == 1
    assert f"present {XPU}.determine_available_memory" in kv_headroom


def test_the_installed_check_names_cpu_workers_overrides():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", "check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model: overrides without "
        "super() (the fixes patch the override too)" in " ".join(result.stdout.split())
    )
