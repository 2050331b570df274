"""The warm-up lock: real vLLM warm-up functions in several processes, crash safety,
time-out, lock-directory safety, and the allow-list against the installed source."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.warm_ups import one_warm_up

from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.host_lock import HostSemaphore, LockDirError, prepare_lock_dir
from vllm_xpu_memfix.fixes import warmup_lock
from vllm_xpu_memfix.vllm_code import warmup_section

HELPERS = Path(__file__).parent / "helpers"


def base_env(lock_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")}
    return {**env, "VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir), **extra}


def max_overlap(intervals: list[list[float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    depth = best = 0
    for _, step in events:
        depth += step
        best = max(best, depth)
    return best


class Racer:
    """``helpers/warmup_race.py``, started on the first race: one vLLM import serves the
    module's races, each in freshly forked engine processes with that race's variables."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    def race(self, tmp_path: Path, engines: int = 1, ranks: int = 4, **env: str) -> list:
        pytest.importorskip("vllm")
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(HELPERS / "warmup_race.py")],
                env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self._answer(180) == "ready"
        request = {"env": {"VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "locks"), **env}}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({**request, "engines": engines, "ranks": ranks}) + "\n")
        self.process.stdin.flush()
        answer = self._answer(180)
        assert not isinstance(answer, dict), answer["error"]
        return answer

    def _answer(self, timeout_s: float) -> object:
        assert self.process is not None and self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            self.close()
            pytest.fail(f"the warm-up race gave no answer within {timeout_s:.0f} s")
        return json.loads(line)

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@pytest.fixture(scope="module")
def racer() -> Iterator[Racer]:
    started = Racer()
    yield started
    started.close()


def race(racer: Racer, tmp_path: Path, **env: str) -> list[list[float]]:
    """Four ranks of one engine racing for the warm-up."""
    (intervals,) = racer.race(tmp_path, **env)
    return intervals


def test_one_slot_serialises_the_real_qwen_warmup(racer, tmp_path):
    intervals = race(racer, tmp_path)
    assert len(intervals) == 4
    assert max_overlap(intervals) == 1


def test_two_slots_let_two_run_at_once(racer, tmp_path):
    assert max_overlap(race(racer, tmp_path, VLLM_XPU_MEMFIX_WARMUP_SLOTS="2")) <= 2
    # Whether two did overlap is the scheduler's; that a free second slot is taken while
    # another process holds the first is the lock's.
    assert not _gave_up_beside_a_holder(tmp_path, VLLM_XPU_MEMFIX_WARMUP_SLOTS="2")


def test_with_the_fix_off_nothing_queues(racer, tmp_path):
    """Off, four real warm-ups run while another process holds the only slot for good
    (with the lock on they would wait for it: a hang, which race()'s time limit catches)."""
    holder = start_holder(tmp_path / "locks", "warmup")
    try:
        intervals = race(
            racer,
            tmp_path,
            VLLM_XPU_MEMFIX_WARMUP_LOCK="off",
            VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S="86400",
        )
    finally:
        holder.kill()
        holder.wait()
    assert len(intervals) == 4


HOLDER = """
import sys, time
from pathlib import Path
from vllm_xpu_memfix.core.host_lock import HostSemaphore
with HostSemaphore(Path(sys.argv[1]), sys.argv[2], 1).hold(timeout_s=5) as holding:
    assert holding.acquired
    print("holding", flush=True)
    time.sleep(120)
"""


def start_holder(lock_dir: Path, name: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_dir), name], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def _gave_up_beside_a_holder(tmp_path: Path, **env: str) -> bool:
    """Whether a warm-up gave up on the lock while another process held one slot."""
    lock_dir = tmp_path / "locks"
    holder = start_holder(lock_dir, "warmup")
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm_xpu_memfix")
    logger.addHandler(handler)
    try:
        variables = {"VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir), **env}
        settings = config.load({"VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S": "1", **variables})
        ran: list[bool] = []
        one_warm_up("qwen_triton_warmup", settings)(lambda: ran.append(True), None, (), {})
        assert ran == [True]
    finally:
        logger.removeHandler(handler)
        holder.kill()
        holder.wait()
    return any("gave up" in message for message in messages)


def test_a_killed_holder_frees_its_slot(tmp_path):
    """The kernel drops a dead holder's lock: the slot is acquired, not given up on."""
    lock_dir = tmp_path / "locks"
    holder = start_holder(lock_dir, "warmup")
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with HostSemaphore(lock_dir, "warmup", 1).hold(timeout_s=30) as holding:
            assert holding.acquired
    finally:
        holder.kill()


def test_time_out_proceeds_without_the_lock_and_names_the_holder(tmp_path, caplog):
    lock_dir = tmp_path / "locks"
    holder = start_holder(lock_dir, "warmup")
    try:
        settings = config.load(
            {"VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir), "VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S": "2"}
        )
        ran = []
        wrapper = one_warm_up("qwen_triton_warmup", settings)
        started = time.monotonic()
        wrapper(lambda: ran.append(True), None, (), {})
        waited = time.monotonic() - started
        assert ran == [True]
        assert waited >= 2.0, "it waited its time-out, then went on (how much longer is load)"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(f"pid {holder.pid}" in w and "gave up after 2." in w for w in warnings), warnings
    finally:
        holder.kill()
        holder.wait()


def test_three_instances_share_the_host_scope_without_deadlock(racer, tmp_path):
    """Three engines (distinct parents, so distinct instance keys) still queue on one host lock."""
    engines = racer.race(tmp_path, engines=3, ranks=1, VLLM_XPU_MEMFIX_WARMUP_SCOPE="host")
    intervals = [interval for (interval,) in engines]
    assert len(intervals) == 3
    assert max_overlap(intervals) == 1


def test_lock_dir_is_created_private(tmp_path):
    path = prepare_lock_dir(tmp_path / "new")
    assert (path.stat().st_mode & 0o777) == 0o700


def test_symlinked_lock_dir_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LockDirError, match="is a symlink; refusing"):
        prepare_lock_dir(tmp_path / "link")


def test_world_writable_lock_dir_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(LockDirError, match=r"group- or world-writable .*mode 777"):
        prepare_lock_dir(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_foreign_owned_lock_dir_is_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(LockDirError, match="owned by uid 65534"):
        prepare_lock_dir(foreign)


def test_relative_lock_dir_setting_is_refused():
    with pytest.raises(numbers.ConfigError, match="VLLM_XPU_MEMFIX_LOCK_DIR='locks'"):
        config.load({"VLLM_XPU_MEMFIX_LOCK_DIR": "locks"})


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_slot_counts_are_refused(value):
    with pytest.raises(numbers.ConfigError, match="VLLM_XPU_MEMFIX_WARMUP_SLOTS"):
        config.load({"VLLM_XPU_MEMFIX_WARMUP_SLOTS": value})


def installed_kernel_warmup_source() -> str:
    from vllm_xpu_memfix.cli import compat

    root = compat.installed_vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    return (root / "vllm/model_executor/warmup/kernel_warmup.py").read_text()


def test_patches_wrap_only_kernel_warmup_and_allow_listed_process_local_warmups():
    """Fails if a patch wraps anything but kernel_warmup where the workers call it, or a
    name off the allow-list; and if an allow-listed name is called where kernel_warmup may
    already have run collectives (after `if process_local_only`)."""
    for patch in warmup_lock.patches(config.load({})):
        module, _, name = patch.target.partition(":")
        if name == "kernel_warmup":
            assert patch.target in warmup_lock.SECTION_TARGETS
        else:
            assert module == warmup_lock.MODULE and name in warmup_lock.ALLOWED, patch.target
    found = warmup_section.process_local_section(installed_kernel_warmup_source())
    assert found.usable, found.why_not
    for name in warmup_lock.ALLOWED:
        assert name in found.calls, f"{name} is not called in the process-local section"


def test_the_installed_process_local_section_calls_no_collective():
    found = warmup_section.process_local_section(installed_kernel_warmup_source())
    assert found.usable and found.collectives == ()
    assert "warmup" in found.calls, "the JIT registry's warmup() is inside the section"


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("def kernel_warmup(worker):\n    qwen_triton_warmup(worker)\n", "no keyword-only"),
        (
            "def kernel_warmup(worker, *, process_local_only=False):\n"
            "    if process_local_only and worker.x:\n        return\n",
            "reads process_local_only 1 times, not once as",
        ),
        (
            "def kernel_warmup(worker, *, process_local_only=False):\n"
            "    a(process_local_only)\n    if process_local_only:\n        return\n",
            "reads process_local_only 2 times",
        ),
        ("def kernel_warmup(:\n", "does not parse"),
        ("def other():\n    pass\n", "no kernel_warmup"),
    ],
)
def test_a_kernel_warmup_of_another_shape_falls_back_to_the_allow_list(source, why):
    found = warmup_section.process_local_section(source)
    assert not found.usable and why in found.why_not and found.calls == ()


def test_a_collective_in_the_section_would_be_seen():
    source = (
        "def kernel_warmup(worker, *, process_local_only=False):\n"
        "    registry.warmup()\n    torch.distributed.all_reduce(x)\n"
        "    if process_local_only:\n        return\n    barrier()\n"
    )
    found = warmup_section.process_local_section(source)
    assert found.calls == ("warmup", "all_reduce") and found.collectives == ("all_reduce",)


class StopAfterSection(Exception):
    pass


@pytest.mark.parametrize("local_only", [False, True])
def test_the_slot_covers_the_whole_section_of_the_real_kernel_warmup(
    tmp_path, monkeypatch, caplog, local_only
):
    """vLLM's own kernel_warmup, called through the binding the worker calls
    (gpu_worker.kernel_warmup): every function of its process-local section, the JIT
    registry's warmup() included, runs while this process holds the slot; the first call
    after `if process_local_only: return` finds it free; the allow-listed warm-ups inside
    do not queue a second time; an exception from vLLM passes through unchanged."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.model_executor.warmup import kernel_warmup as module
    from vllm.v1.worker import gpu_worker

    from vllm_xpu_memfix.core.patching import Patcher, _PatchWrapper

    lock_dir = tmp_path / "locks"
    seen: list[tuple[str, bool]] = []

    def slot_free() -> bool:
        probe = HostSemaphore(lock_dir, "warmup", 1)
        holding = probe.acquire(timeout_s=0)
        probe.release(holding)
        return holding.acquired

    def recorder(name):
        def record(*_args, **_kwargs):
            seen.append((name, slot_free()))

        return record

    section = warmup_section.process_local_section(installed_kernel_warmup_source())
    for name in section.calls:
        if callable(getattr(module, name, None)) and not name.startswith("_"):
            monkeypatch.setattr(module, name, recorder(name))

    def after_section(*_args, **_kwargs):
        seen.append(("after", slot_free()))
        raise StopAfterSection

    monkeypatch.setattr(module, "flashinfer_sparse_mla_decode_autotune_warmup", after_section)
    # The plugin may be registered in this test process already (vLLM loads its plugins
    # on some imports): the worker's binding then holds its wrapper, with other settings.
    bound = gpu_worker.kernel_warmup
    while isinstance(bound, _PatchWrapper):
        bound = bound.__wrapped__
    monkeypatch.setattr(gpu_worker, "kernel_warmup", bound)
    # kernel_warmup imports this one first; its module needs torchvision, absent here.
    minimax = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
    monkeypatch.setitem(sys.modules, minimax, SimpleNamespace(minimax_m3_msa_warmup=None))
    kernel = SimpleNamespace(enable_jit_warmup=True, enable_cutedsl_warmup=False)
    worker = SimpleNamespace(
        use_v2_model_runner=True,
        model_runner=SimpleNamespace(jit_warmup_registry=SimpleNamespace(warmup=recorder("jit"))),
        vllm_config=SimpleNamespace(
            kernel_config=kernel,
            model_config=None,
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]),
        ),
    )
    settings = config.load(
        {"VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir), "VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S": "3"}
    )
    patcher = Patcher()
    warmup_lock.install(patcher, settings)
    try:
        with caplog.at_level(logging.INFO):
            if local_only:
                assert gpu_worker.kernel_warmup(worker, process_local_only=True) is None
            else:
                with pytest.raises(StopAfterSection):
                    gpu_worker.kernel_warmup(worker)
    finally:
        patcher.revert_all()
    inside = [(name, free) for name, free in seen if name != "after"]
    assert ("jit", False) in inside and ("qwen_triton_warmup", False) in inside
    assert all(not free for _, free in inside), inside
    assert [entry for entry in seen if entry[0] == "after"] == (
        [] if local_only else [("after", True)]
    )
    assert slot_free()
    lines = [r.getMessage() for r in caplog.records if "warm-up lock" in r.getMessage()]
    assert any("covers kernel_warmup's process-local section" in line for line in lines)
    held = [line for line in lines if "kernel_warmup's process-local section waited" in line]
    assert len(held) == 1 and not any("gave up" in line for line in lines), lines


@pytest.mark.parametrize(("mode", "waits"), [("auto", False), ("on", True)])
def test_per_rank_triton_cache_skips_the_lock_unless_forced(
    tmp_path, monkeypatch, caplog, mode, waits
):
    """vLLM's compiled mode gives each rank its own Triton cache: waiting would save nothing."""
    lock_dir = tmp_path / "locks"
    holder = start_holder(lock_dir, "warmup")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache/abc/rank_1_0/triton_cache"))
    try:
        settings = config.load(
            {
                "VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir),
                "VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S": "1.5",
                "VLLM_XPU_MEMFIX_WARMUP_LOCK": mode,
            }
        )
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            one_warm_up("qwen_triton_warmup", settings)(lambda: None, None, (), {})
        gave_up = [r for r in caplog.records if "gave up" in r.getMessage()]
        assert bool(gave_up) is waits, "only a rank that queued behind the holder gives up"
        if waits:
            assert time.monotonic() - started >= 1.5
    finally:
        holder.kill()
        holder.wait()


def test_two_users_get_two_lock_directories_each_created_private(tmp_path, monkeypatch):
    """Users differ by XDG_RUNTIME_DIR, or by uid where it is unset: never one directory
    for two of them; and the lock code creates the directory (and a missing parent) 0700."""
    runtime_a, runtime_b = tmp_path / "run-a", tmp_path / "run-b"
    dir_a = config.load({"XDG_RUNTIME_DIR": str(runtime_a)}).lock_dir
    dir_b = config.load({"XDG_RUNTIME_DIR": str(runtime_b)}).lock_dir
    assert dir_a != dir_b

    def lock_dir_of(uid: int) -> Path:
        monkeypatch.setattr(os, "geteuid", lambda: uid)
        monkeypatch.setattr(os, "getuid", lambda: uid)
        return config.load({}).lock_dir

    assert lock_dir_of(1000) != lock_dir_of(1001)
    monkeypatch.undo()

    with HostSemaphore(dir_a, "warmup", 1).hold(timeout_s=1) as holding:
        assert holding.acquired
    assert dir_a.is_dir() and not dir_b.exists()
    assert (dir_a.stat().st_mode & 0o777) == 0o700
    assert (runtime_a.stat().st_mode & 0o777) == 0o700
