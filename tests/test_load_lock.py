"""The load lock: its decision (sized from the host's room, read from recorded and hand-made
trees under tests/data/proc through VLLM_XPU_MEMFIX_SYSROOT), the ranks' agreement on it,
bad input, an unusable lock directory, the time-out, and real TP=2 servers on the test bed
(the replay's 0.21 legacy load in a tight container, where the lock must serialise the
ranks; the same load with this host's room, where auto must not; and its 0.26 layerwise
load, where auto must leave it off)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.host_lock import agree
from vllm_xpu_memfix.fixes import load_lock
from vllm_xpu_memfix.memory.room import host_room

DATA = Path(__file__).parent / "data" / "proc"
TIGHT = DATA / "container-v2-tight"  # 2,560 MiB left under a cgroup v2 limit
FULL = DATA / "container-v1-full"  # 96 MiB left under a cgroup v1 limit

torch = pytest.importorskip("torch")


def parallel(workers=None, world_size=2):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            max_parallel_loading_workers=workers,
            world_size=world_size,
            nnodes=1,
            distributed_timeout_seconds=None,
        )
    )


class FakeMethod:
    """A quant method whose class lives in the sym_int4 module, as the real one's does."""


FakeMethod.__module__ = load_lock.SYM_INT4


def model_with(device: str) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(256, 512, dtype=torch.bfloat16, device=device))
    layer.quant_method = FakeMethod()
    model = torch.nn.Module()
    model.layer = layer
    return model


def room_settings(tmp_path, sysroot, **more):
    return config.load(
        {
            "VLLM_XPU_MEMFIX_SYSROOT": str(sysroot),
            "VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "locks"),
            **more,
        }
    )


def cpu_staging(params: int) -> float:
    """A rank's staging as the lock plans it for one BF16 sym_int4 layer of ``params`` on
    the CPU test bed: startup.staging's figure, plus the converted weight, which stays in
    host memory where the device is the CPU."""
    from vllm_xpu_memfix.intel.catalog import ONE_LAYOUT
    from vllm_xpu_memfix.startup import staging

    return staging.per_rank(params, shard_bytes=2 * params) + params * ONE_LAYOUT


def test_a_shard_buffered_on_the_host_sizes_the_slots_from_the_room(tmp_path):
    """The model stages one 256 x 512 BF16 layer per rank (1.1 MiB with its temporaries and
    converted weight): a 96 MiB room holds 67 ranks' at 0.8 of it, so 8 ranks load at once,
    no lock; 300 ranks get 67 slots."""
    per_rank = cpu_staging(256 * 512)
    fits = int(96 * 2**20 * 0.8 // per_rank)
    assert fits == 67
    settings = room_settings(tmp_path, FULL)
    slots, why = load_lock.decide(settings, model_with("cpu"), parallel(world_size=8))
    assert slots is None and "-> 8 slot(s)" in why and "load unserialised" in why
    assert f"room 96 MiB, staging {per_rank / 2**20:,.1f} MiB per rank, 8 ranks on this host" in why
    settings = room_settings(tmp_path / "other", FULL)
    slots, why = load_lock.decide(settings, model_with("cpu"), parallel(world_size=300))
    assert slots == fits and f"the room holds {fits} of the 300 ranks' staging" in why


def test_a_tight_container_gives_one_slot_through_the_section(tmp_path, caplog):
    big = model_with("cpu")  # 64 MiB staged and ~230 MiB of temporaries; 96 MiB of room
    big.layer.weight = torch.nn.Parameter(torch.empty(1024, 32768, dtype=torch.bfloat16))
    section = load_lock.LoadSection(room_settings(tmp_path, FULL))
    with caplog.at_level(logging.DEBUG, logger=load_lock.logger.name):
        section.enter(big, parallel())
    try:
        assert section.holding is not None and section.holding.acquired
        assert section.semaphore is not None and section.semaphore.slots == 1
    finally:
        section.leave()
    sized = next(r for r in caplog.records if "sized from the room" in r.getMessage())
    line = sized.getMessage()
    per_rank = cpu_staging(1024 * 32768)
    assert "room 96 MiB" in line and f"{per_rank / 2**20:,.1f} MiB per rank" in line
    assert "-> 1 slot(s)" in line
    assert sized.levelname == "WARNING" and line.endswith("vllm-xpu-memfix explain quant_staging")
    room = next(r for r in caplog.records if host_room(FULL).describe() in r.getMessage())
    assert room.levelname == "DEBUG", "the deciding rank's room in full, as a detail"


def test_a_garbage_cgroup_file_logs_why_and_takes_one_slot(tmp_path, caplog):
    import shutil

    tree = Path(shutil.copytree(TIGHT, tmp_path / "tree"))
    (tree / "sys/fs/cgroup/memory.max").write_text("\x00\x01 nonsense\n")
    section = load_lock.LoadSection(room_settings(tmp_path, tree))
    with caplog.at_level(logging.INFO):
        section.enter(model_with("cpu"), parallel())
    try:
        assert section.semaphore is not None and section.semaphore.slots == 1
    finally:
        section.leave()
    why, sized = (r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "room unknown: cgroup unreadable" in why and "memory.max" in why, "the file first"
    assert "room unknown" in sized and "conservative" in sized
    assert f"{cpu_staging(256 * 512) / 2**20:,.1f} MiB per rank" in sized
    assert "-> 1 slot(s)" in sized


def test_the_flag_and_explicit_slots_win_over_the_room(tmp_path):
    settings = room_settings(tmp_path, DATA / "cpu-vm-v1")  # a room for everything
    assert load_lock.decide(settings, model_with("cpu"), parallel(workers=1))[0] == 1
    fixed = room_settings(tmp_path, DATA / "cpu-vm-v1", VLLM_XPU_MEMFIX_LOAD_SLOTS="1")
    slots, why = load_lock.decide(fixed, model_with("cpu"), parallel())
    assert slots == 1 and why.endswith("VLLM_XPU_MEMFIX_LOAD_SLOTS")
    assert not (tmp_path / "locks").exists()  # neither read the room nor wrote a decision


def test_ranks_that_see_different_rooms_queue_on_the_first_ones_number(tmp_path):
    """One rank reads a tight container, the other a roomy host: both get the first's."""
    first = room_settings(tmp_path, FULL)
    roomy = room_settings(tmp_path, DATA / "cpu-vm-v1")
    big = model_with("cpu")
    big.layer.weight = torch.nn.Parameter(torch.empty(1024, 32768, dtype=torch.bfloat16))
    assert load_lock.decide(first, big, parallel())[0] == 1
    slots, why = load_lock.decide(roomy, big, parallel())
    assert slots == 1 and "as the engine's first rank decided" in why and "room 96 MiB" in why


def test_agreement_is_one_value_under_concurrency(tmp_path):
    answers, lock = [], threading.Lock()

    def rank(n):
        def decide_here():
            time.sleep(0.05)  # the others arrive while this one decides
            return f"{n} from rank {n}"

        result = agree(tmp_path, "load-slots-x", "engine1@5", decide_here)
        with lock:
            answers.append(result)

    threads = [threading.Thread(target=rank, args=(n,)) for n in range(1, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({value for value, _ in answers}) == 1
    assert sum(mine for _, mine in answers) == 1


def test_a_stale_or_half_written_decision_is_decided_afresh(tmp_path):
    path = tmp_path / "load-slots-x.decision"
    assert agree(tmp_path, "load-slots-x", "engine1@5", lambda: "2 old") == ("2 old", True)
    # The same pid again, started later: another instance.
    assert agree(tmp_path, "load-slots-x", "engine1@9", lambda: "1 new") == ("1 new", True)
    path.write_text("engine1@9\n1 new")  # a writer that died before the closing line
    assert agree(tmp_path, "load-slots-x", "engine1@9", lambda: "3 again") == ("3 again", True)
    assert agree(tmp_path, "load-slots-x", "engine1@9", lambda: "4 late") == ("3 again", False)


def test_streaming_and_layerwise_loads_keep_it_off():
    slots, why = load_lock.decide(config.load({}), model_with("meta"), parallel())
    assert slots is None and "no layer buffers" in why


def test_unquantized_host_weights_are_not_staging():
    model = model_with("cpu")
    model.layer.quant_method = object()
    assert load_lock.decide(config.load({}), model, parallel())[0] is None


def test_the_vllm_flag_wins_and_on_forces_the_lock():
    assert load_lock.decide(config.load({}), model_with("meta"), parallel(workers=3))[0] == 3
    forced = config.load({"VLLM_XPU_MEMFIX_LOAD_LOCK": "on", "VLLM_XPU_MEMFIX_LOAD_SLOTS": "2"})
    assert load_lock.decide(forced, model_with("meta"), parallel()) == (
        2,
        "VLLM_XPU_MEMFIX_LOAD_LOCK=on",
    )


@pytest.mark.parametrize(
    ("feature", "reason"),
    [
        ({"load_format": "runai_streamer_sharded"}, "runs a collective while loading"),
        ({"load_format": "fastsafetensors"}, "runs a collective while loading"),
        ({"decode_context_parallel_size": 2}, "decode context parallel all-gathers"),
        ({"enable_expert_parallel": True}, "all-to-all handles"),
    ],
)
def test_a_load_that_runs_a_collective_never_queues_even_with_the_flag(feature, reason):
    vllm_config = parallel(workers=1)
    vllm_config.load_config = SimpleNamespace(load_format=feature.get("load_format", "auto"))
    for name in ("decode_context_parallel_size", "enable_expert_parallel"):
        if name in feature:
            setattr(vllm_config.parallel_config, name, feature[name])
    slots, why = load_lock.decide(config.load({}), model_with("cpu"), vllm_config)
    assert slots is None and reason in why


def test_vllms_online_quantization_never_queues_at_tp_above_one():
    class Online:
        pass

    Online.__module__ = "vllm.model_executor.layers.quantization.online.fp8"
    model = model_with("meta")
    model.layer.quant_method = Online()
    vllm_config = parallel(workers=2)
    vllm_config.parallel_config.tensor_parallel_size = 2
    slots, why = load_lock.decide(config.load({}), model, vllm_config)
    assert slots is None and "all-reduces weight scales" in why


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "nan", "inf", "", "1025", str(10**29)])
def test_bad_slot_counts_are_refused_with_the_variable_and_the_range(value):
    with pytest.raises(numbers.ConfigError) as err:
        config.load({"VLLM_XPU_MEMFIX_LOAD_SLOTS": value})
    message = str(err.value)
    assert (
        "VLLM_XPU_MEMFIX_LOAD_SLOTS" in message and "an integer from 1 to 1024, or auto" in message
    )


def test_slots_default_to_auto():
    assert config.load({}).load_slots is None
    assert config.load({"VLLM_XPU_MEMFIX_LOAD_SLOTS": " Auto "}).load_slots is None
    assert config.load({"VLLM_XPU_MEMFIX_LOAD_SLOTS": "3"}).load_slots == 3


def test_an_unusable_lock_directory_logs_an_error_and_loads_unlocked(tmp_path, caplog):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    settings = config.load(
        {"VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "link"), "VLLM_XPU_MEMFIX_LOAD_SLOTS": "1"}
    )
    section = load_lock.LoadSection(settings)
    with caplog.at_level(logging.ERROR):
        section.enter(model_with("cpu"), parallel())
    assert section.holding is None
    assert any(
        "loads unlocked" in r.getMessage() and "symlink" in r.getMessage() for r in caplog.records
    )
    section.leave()  # nothing held: a no-op


def test_an_unusable_lock_directory_for_the_rooms_decision_loads_unlocked(tmp_path, caplog):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    settings = config.load({"VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path / "link")})
    after_construction = load_lock.patches(settings)[0]
    model = model_with("cpu")
    with caplog.at_level(logging.ERROR):
        built = after_construction.wrapper(lambda **_: model, None, (), {"vllm_config": parallel()})
    assert built is model
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "this rank loads unlocked" in line and "symlink" in line


def test_a_rank_that_times_out_loads_unlocked_and_names_the_holder(tmp_path, caplog):
    from test_warmup_lock import start_holder

    lock_dir = tmp_path / "locks"
    holder = start_holder(lock_dir, "load")
    settings = config.load(
        {
            "VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir),
            "VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S": "1",
            "VLLM_XPU_MEMFIX_LOAD_SLOTS": "1",
        }
    )
    try:
        section = load_lock.LoadSection(settings)
        with caplog.at_level(logging.WARNING):
            section.enter(model_with("cpu"), parallel())
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"pid {holder.pid}" in w and "loading without the lock" in w for w in warnings)
        assert "VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S" in warnings[-1]
        section.leave()
    finally:
        holder.kill()
        holder.wait()


def test_a_queue_longer_than_the_collective_timeout_is_warned_about(caplog):
    from vllm_xpu_memfix.core.host_lock import Holding

    section = load_lock.LoadSection(config.load({}))
    section.vllm_config = parallel(world_size=4)
    section.vllm_config.parallel_config.distributed_timeout_seconds = 100
    holding = Holding(0, 0.0, "", held_s=30.0)
    with caplog.at_level(logging.WARNING):
        # The multiprocessing executor waits for every rank's load without a time-out.
        section._warn_if_the_queue_outlasts_the_timeout(holding)
        assert not caplog.records
        section.vllm_config.parallel_config.distributed_executor_backend = "external_launcher"
        section._warn_if_the_queue_outlasts_the_timeout(holding)
    line = next(r.getMessage() for r in caplog.records)
    assert "4 ranks loading 1 at a time" in line and "about 90 s" in line
    assert "--distributed-timeout-seconds" in line


LOCK_LINE = re.compile(r"rank (\d) load lock: waited ([\d.]+) s(?: for pid (\d+))?")


@pytest.mark.server
def test_tp2_legacy_load_serialises_in_a_tight_container_not_with_room_and_layerwise_never(
    serve, small_model, tmp_path
):
    """The 134 M model: each rank's section (its ledger's "weights loaded" to "weights
    processed", inside the locked span) lasts seconds, so unlocked ranks would overlap.
    The tight container is the hand-made v1 tree (96 MiB left under its limit, read through
    VLLM_XPU_MEMFIX_SYSROOT); this host's own room holds both ranks' staging."""
    import json

    pytest.importorskip("vllm")
    ledger_dir = tmp_path / "ledger"
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT": "1",
        "SYM_INT4_REPLAY_LAYOUT": "0.21",
    }
    args = ["--quantization", "sym_int4", "--tensor-parallel-size", "2"]
    tight = {**env, "VLLM_XPU_MEMFIX_SYSROOT": str(FULL)}
    legacy = serve(
        small_model, env={**tight, "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger_dir)}, extra_args=args
    )
    legacy.wait_ready(timeout_s=400)
    text = legacy.complete("Hello", max_tokens=2, temperature=0)["choices"][0]["text"]
    legacy.stop()
    log = legacy.log_text()
    lines = LOCK_LINE.findall(log)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"], log[-3000:]
    sized = re.findall(r"load lock sized from the room \((.+?)\): room 96 MiB.*-> 1 slot", log)
    assert sorted(sized) == ["as the engine's first rank decided", "this rank decided"], sized
    # The ledger reports the same room as the lock.
    assert log.count(f"host at ready: {host_room(FULL).describe()}") == 2
    pids = dict(re.findall(r"\(Worker_TP(\d) pid=(\d+)\)", log))
    for rank, waited, pid in lines:
        if float(waited) > 0.1:  # a rank that queued names the other rank's worker
            assert pid == pids[str(1 - int(rank))], (rank, waited, pid)
    sections = []
    for path in ledger_dir.glob("ledger-*.jsonl"):
        rows = {
            json.loads(line)["phase"]: json.loads(line) for line in path.read_text().splitlines()
        }
        if str(rows["process start"].get("role", "")).startswith("worker"):
            sections.append((rows["weights loaded"]["ts"], rows["weights processed"]["ts"]))
    assert len(sections) == 2
    first, second = sorted(sections)
    assert first[1] <= second[0], f"the ranks loaded at the same time: {sections}"

    roomy = serve(small_model, env=env, extra_args=args)
    roomy.wait_ready(timeout_s=400)
    assert roomy.complete("Hello", max_tokens=2, temperature=0)["choices"][0]["text"] == text
    roomy.stop()
    log = roomy.log_text()
    assert log.count("-> 2 slot(s): every rank's staging fits at once") == 2, log[-3000:]
    assert not LOCK_LINE.findall(log)

    layerwise = serve(small_model, env={**env, "SYM_INT4_REPLAY_LAYOUT": "0.26"}, extra_args=args)
    layerwise.wait_ready(timeout_s=400)
    assert layerwise.complete("Hello", max_tokens=2, temperature=0)["choices"][0]["text"] == text
    layerwise.stop()
    assert "load lock" not in layerwise.log_text()


def test_the_replay_is_what_the_tests_above_rely_on():
    """The server test needs the replay installed into vLLM (scripts/setup.sh does it)."""
    pytest.importorskip("vllm")
    import importlib.util

    spec = importlib.util.find_spec(load_lock.SYM_INT4)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent.name == "quantization"
    assert os.environ.get("SYM_INT4_REPLAY_LAYOUT", "0.26") in ("0.14", "0.21", "0.26")
