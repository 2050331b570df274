"""The preflight: the start-up model run on the engine's own configuration, in the process
that builds it, before any worker starts; and the line after an OOM-killed start-up.

The in-process tests build the configuration with the installed vLLM's
``EngineArgs.create_engine_config`` (the call ``vllm serve``'s API server and ``LLM`` make);
the Intel GPUs are described by a sysroot (tests/hosts.py)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hosts import B60, B70, build_host, qwen_27b_like

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.numbers import ConfigError
from vllm_xpu_memfix.core.patching import Patcher, State
from vllm_xpu_memfix.core.process import start_identity
from vllm_xpu_memfix.fixes import preflight

LINE = "vllm-xpu-memfix preflight:"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def capture() -> Iterator[Records]:
    """The preflight's records, DEBUG included, for as long as the generator runs."""
    handler = Records()
    logger = preflight.logger
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture
def records() -> Iterator[Records]:
    yield from capture()


def engine_config(
    model: Path,
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    platform: str | None = "xpu",
    **engine_args: object,
) -> object:
    """``create_engine_config`` with every requested fix installed as register() does.
    ``platform``: the device type the preflight takes vLLM's platform for. The test bed's
    vLLM is the CPU build and no Intel GPU can run here, so the XPU cases set "xpu" (the
    sysroot describes the GPUs); None keeps the platform vLLM resolved (cpu)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    if platform is not None:
        monkeypatch.setattr(preflight, "platform_of", lambda _config: platform)

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM loads its plugins in this call: keep this plugin's register() out (it would
    # patch every fix for the rest of the session) and its preflight off, so only the one
    # installed here (with ``env``) acts.
    monkeypatch.setenv("VLLM_PLUGINS", "none")
    monkeypatch.setenv(config.PREFLIGHT.env, "off")
    # A test elsewhere in the session that let vLLM load this plugin in-process leaves its
    # wrapper on this method: start from vLLM's own function, restored after the test.
    import inspect

    monkeypatch.setattr(
        EngineArgs, "create_engine_config", inspect.unwrap(EngineArgs.create_engine_config)
    )
    settings = config.load(env)
    patcher = Patcher()
    for module in (fixes.module_of(config.PREFLIGHT),):
        if settings.requested(module.FIX):
            module.install(patcher, settings)
    try:
        args = EngineArgs(model=str(model), skip_tokenizer_init=True, **engine_args)
        return args.create_engine_config()
    finally:
        target = (config.PREFLIGHT.key, "vllm.engine.arg_utils:EngineArgs.create_engine_config")
        if settings.requested(config.PREFLIGHT):
            assert patcher.state(target)[0] is State.APPLIED
        patcher.revert_all()


def sparse_27b(directory: Path) -> Path:
    """A sparse 27B BF16 checkpoint (no weights on disk) with its config.json. Its 2048-token
    context leaves the CPU build's 1 GiB KV cache room: at 4096 one sequence needs exactly
    1 GiB, and vLLM keeps one block of the pool back (kv_cache_utils.get_kv_cache_configs)."""
    model = qwen_27b_like(directory)
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 5120,
                "intermediate_size": 17408,
                "num_hidden_layers": 64,
                "num_attention_heads": 48,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 248320,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 2048,
                "tie_word_embeddings": False,
            }
        )
    )
    return model


@pytest.fixture
def b70_27b(tmp_path: Path) -> tuple[Path, Path]:
    """One 32 GiB Arc Pro B70 and a sparse 27B BF16 checkpoint (no weights on disk)."""
    return build_host(tmp_path / "host", [B70]), sparse_27b(tmp_path / "model")


def test_doctor_and_the_preflight_build_the_same_machine_from_the_same_host(tmp_path, clean_env):
    """One mapping (``startup.host.machine``): doctor's facts and the preflight's, read
    from one host tree with the same switches, give equal machines. The preflight sees the
    guard's keys in its own environment (the guard ran before it in that process); doctor
    adds the guard's decision itself. Only the legacy load's reason differs: doctor reads
    the installed sym_int4 for it, the preflight takes the per-layer load without one."""
    from vllm_xpu_memfix.cli.doctor import facts
    from vllm_xpu_memfix.fixes import driver_env
    from vllm_xpu_memfix.memory.checkpoint import read_checkpoint
    from vllm_xpu_memfix.startup.sizing import ServeArgs

    host = build_host(tmp_path / "host", [B70] * 2, mem_available_gib=90, vram_gib=24)
    model = qwen_27b_like(tmp_path / "model")
    env = {
        "VLLM_XPU_MEMFIX_SYSROOT": str(host),
        config.LOAD_LOCK.env: "on",
        config.KV_HEADROOM.env: "on",
    }
    settings = config.load(env)
    args = ServeArgs(model=str(model), tensor_parallel_size=2)
    doctor = facts.measure(settings, args, env).machine()
    guarded = dict(env)
    driver_env.apply(driver_env.decide(settings, env), guarded)
    _, ours = preflight.this_machine(settings, args, read_checkpoint(model), guarded)
    assert doctor.legacy_load[0] is ours.legacy_load[0] is False
    assert ours == replace(doctor, legacy_load=ours.legacy_load)
    # Not an empty machine: every field the mapping fills is read from the tree.
    assert (ours.gpus_visible, ours.battlemage_visible, ours.device_bytes) == (2, 2, 24 * 2**30)
    assert ours.room == 90 * 2**30 and ours.kv_headroom and ours.load_slots == 1
    assert ours.runtime is not None and ours.kernel is not None
    assert set(driver_env.decide(settings, env).env) <= set(ours.environ)


def test_refuse_stops_a_27b_bf16_start_on_one_b70_before_loading_and_names_the_device(
    b70_27b, monkeypatch, records, clean_env
):
    host, model = b70_27b
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_PREFLIGHT": "refuse"}
    with pytest.raises(preflight.PreflightRefused) as refused:
        engine_config(model, env, monkeypatch)
    message = str(refused.value)
    assert isinstance(refused.value, RuntimeError), "a library caller can catch it"
    assert "WILL RUN OUT OF MEMORY at load on the device" in message
    assert "Arc Pro B70" in message and "VLLM_XPU_MEMFIX_PREFLIGHT=refuse" in message
    (error,) = records.lines(logging.WARNING)
    assert error == message and records.records[0].levelno == logging.ERROR
    assert "main cause device_overcommit; first remedy quantize" in error and len(error) <= 320
    debug = [line for line in records.lines() if "preflight json" in line]
    assert debug and all(len(line) <= 320 for line in debug)
    text = "".join(line.split(": ", 1)[1] for line in debug)
    assert json.loads(text)["fails_at"] == {"phase": "load", "where": "device"}


def test_a_config_only_checkpoint_is_sized_from_its_config(
    b70_27b, monkeypatch, records, clean_env
):
    host, model = b70_27b
    for shard in model.glob("*.safetensors"):
        shard.unlink()
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_PREFLIGHT": "refuse"}
    with pytest.raises(preflight.PreflightRefused, match="Arc Pro B70"):
        engine_config(model, env, monkeypatch)


def test_a_quantized_config_without_headers_is_a_range_not_16_bits_nor_its_width_alone(
    tmp_path, monkeypatch, records, clean_env
):
    """Issue 57, class 3: the headers are out of reach (here a directory of config.json
    alone; the same fallback as an offline cache). The FP8 config gives the method, not
    which modules stay 16-bit: the weights are 8-bit to 16-bit, so on a 16 GiB card the
    verdict is "at risk", naming the width at which it flips, and refuse lets it start."""
    import shutil

    from helpers.hub_standin import CONFIGS

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(CONFIGS / "llama-3.1-8b-instruct-fp8.json", model / "config.json")
    host = build_host(tmp_path / "host", [B60], vram_gib=16)
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_PREFLIGHT": "refuse"}
    engine_config(model, env, monkeypatch, max_model_len=4096)
    (line,) = [line for line in records.lines(logging.INFO) if line.startswith(LINE)]
    assert line.startswith(f"{LINE} AT RISK (TP 1)"), line
    debug = [line for line in records.lines() if "preflight json" in line]
    details = json.loads("".join(line.split(": ", 1)[1] for line in debug))
    assert details["checkpoint"] == "hf_config" and details["verdict"] == "at risk"
    assert "fits if the weights are at most 8-bit; runs out at 16-bit" in details["why"]
    assert "its headers not read" in details["why"]


def test_auto_never_refuses_and_logs_one_warning(b70_27b, monkeypatch, records, clean_env):
    host, model = b70_27b
    engine_config(model, {"VLLM_XPU_MEMFIX_SYSROOT": str(host)}, monkeypatch)
    assert len([line for line in records.lines(logging.WARNING) if line.startswith(LINE)]) == 1


def test_without_intel_gpus_the_line_says_the_device_is_not_judged(
    tiny_model, monkeypatch, records, clean_env
):
    """Issue 57, class 2: a device with no memory figure is "NOT JUDGED", never "FITS"."""
    engine_config(tiny_model, {}, monkeypatch)
    (line,) = [line for line in records.lines(logging.INFO) if line.startswith(LINE)]
    assert line.startswith(f"{LINE} NOT JUDGED") and "FITS" not in line
    assert "no Intel GPU visible" in line and "device not judged" in line


def test_off_judges_and_logs_nothing(b70_27b, monkeypatch, records, clean_env):
    host, model = b70_27b
    env = {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_PREFLIGHT": "off"}
    engine_config(model, env, monkeypatch)
    assert records.lines() == []


def test_a_bad_value_is_the_usual_one_line_error():
    with pytest.raises(ConfigError, match="VLLM_XPU_MEMFIX_PREFLIGHT='always' is not valid"):
        config.load({"VLLM_XPU_MEMFIX_PREFLIGHT": "always"})


def test_an_internal_error_is_one_debug_line_and_no_verdict(records):
    state: dict[str, preflight.Judgement] = {}
    preflight.run_preflight(object(), config.load({}), state)
    (line,) = records.lines()
    assert records.records[0].levelno == logging.DEBUG and "no verdict" in line
    assert state["last"].verdict is None


def _vmstat(host: Path, oom_kills: int) -> None:
    (host / "proc/vmstat").write_text(f"nr_free_pages 1000\noom_kill {oom_kills}\n")


def _dead_pid() -> int:
    """The pid of a process that has exited (a real one, so ``psutil`` finds it gone)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _oom_scene(tmp_path: Path, rows: list[dict[str, object]], extra: str = "") -> tuple:
    host = build_host(tmp_path / "host", [])
    _vmstat(host, 2)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    settings = config.load(
        {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}
    )
    # Rows of this start-up: those of another carry another identity (test_start_identity).
    text = "".join(json.dumps({"start": start_identity(), **r}) + "\n" for r in rows) + extra
    (ledger / "ledger-h-7.jsonl").write_text(text)
    judged = preflight.Judgement("", "at risk", "driver_host_copy", 2, started=100.0)
    return host, ledger, settings, judged


def test_after_an_oom_kill_one_line_names_the_process_its_phase_and_the_cause(tmp_path, records):
    pid = _dead_pid()
    rows = [
        {"phase": "process start", "pid": pid, "role": "worker-0", "ts": 101.0, "rss_anon": 1},
        {
            "phase": "weights loaded",
            "pid": pid,
            "role": "worker-0",
            "ts": 102.0,
            "rss_anon": 9 * 2**30,
            "mem_available": 2**30,
            "mem_total": 64 * 2**30,
        },
    ]
    host, ledger, settings, judged = _oom_scene(tmp_path, rows)
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    assert records.lines() == [], "the counter has not risen: nothing to say"
    _vmstat(host, 3)
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    (line,) = records.lines()
    assert "oom_kill 2 -> 3" in line and f"worker-0 pid={pid} after phase 'weights loaded'" in line
    assert "MemAvailable 1.0 of 64.0 GiB" in line and "driver_host_copy" in line
    assert len(line) <= 320 and "LEDGER_DIR" not in line and "skipped" not in line
    recorded = [
        json.loads(text)
        for path in ledger.glob("ledger-*.jsonl")
        if path.name != "ledger-h-7.jsonl"
        for text in path.read_text().splitlines()
    ]
    assert [r["phase"] for r in recorded] == ["killed by the OOM killer"]
    assert recorded[0]["victim_pid"] == pid and recorded[0]["oom_kill_after"] == 3


def test_the_oom_kill_line_skips_and_counts_malformed_rows_and_never_names_a_live_process(
    tmp_path, records
):
    """Rows of a hostile or torn ledger: not JSON, a list, a string pid, a string ts, a
    live process (this test's own parent, larger than the dead one), and a dead worker
    whose role and phase carry control characters that would forge a second line."""
    dead = _dead_pid()
    rows = [
        {"phase": "x", "pid": os.getppid(), "role": "worker-1", "ts": 101.0, "rss_anon": 99 << 30},
        {"phase": "x", "pid": "12", "role": "worker-2", "ts": 101.0},
        {"phase": "x", "pid": 13, "role": "worker-3", "ts": "soon"},
        {
            "phase": "load\nERROR forged\x1b[31m",
            "pid": dead,
            "role": "worker-0\r",
            "ts": 101.0,
            "rss_anon": 2**30,
            "mem_available": "lots",
        },
    ]
    host, _, settings, judged = _oom_scene(tmp_path, rows, extra="[1, 2]\n{not json\n")
    _vmstat(host, 3)
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    (line,) = records.lines()
    assert f"pid={dead}" in line and f"pid={os.getppid()}" not in line
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "load\\nERROR forged\\x1b[31m" in line and "worker-0\\r" in line
    assert "4 ledger row(s) skipped" in line and "MemAvailable" not in line


def test_a_fifo_named_like_a_ledger_file_never_blocks_the_line(tmp_path, records):
    """A FIFO without a writer would block a plain open() for ever: it is refused,
    counted, and the line still comes (asking for no LEDGER_DIR: it is set)."""
    host, ledger, settings, judged = _oom_scene(tmp_path, [])
    os.mkfifo(ledger / "ledger-h-8.jsonl")
    _vmstat(host, 3)
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    (line,) = records.lines()
    assert "likely a vLLM process (phase unknown)" in line and "1 ledger row(s) skipped" in line
    assert "LEDGER_DIR" not in line


# --- issue 46: judge only what vLLM will use; unknown is unknown; refuse only the certain


def _refuse(host: Path, **extra: str) -> dict[str, str]:
    return {"VLLM_XPU_MEMFIX_SYSROOT": str(host), config.PREFLIGHT.env: "refuse", **extra}


def _details(records: Records) -> dict:
    debug = [line for line in records.lines() if "preflight json" in line]
    return json.loads("".join(line.split(": ", 1)[1] for line in debug))


def _line(records: Records) -> str:
    (line,) = [line for line in records.lines(logging.INFO) if line.startswith(LINE)]
    assert len(line) <= 320
    return line


def test_another_platform_is_one_info_line_and_never_refused(
    b70_27b, monkeypatch, records, clean_env
):
    """An Intel GPU beside a CUDA (or any other) platform is not the device vLLM uses."""
    host, model = b70_27b
    engine_config(model, _refuse(host), monkeypatch, platform="cuda")
    (line,) = records.lines()
    assert records.records[0].levelno == logging.INFO
    assert "not judged: vLLM runs on its cuda platform" in line


def test_the_cpu_backend_is_judged_in_its_own_terms_not_the_xpu_baseline(
    tiny_model, tmp_path, monkeypatch, records, clean_env
):
    """A 3 GiB room on vLLM's CPU backend: its need is the weights and the 1 GiB KV cache
    (VLLM_CPU_KVCACHE_SPACE, set by engine_config), not 3.5 GiB a rank of the XPU
    baseline, so it fits; 0.5 GiB cannot hold the KV cache, and refuse stops it."""
    roomy = build_host(tmp_path / "roomy", [], mem_available_gib=3)
    engine_config(tiny_model, _refuse(roomy), monkeypatch, platform=None)
    line = _line(records)
    assert line.startswith(f"{LINE} FITS on vLLM's CPU backend") and "KV cache 1.0 GiB" in line
    tight = build_host(tmp_path / "tight", [], mem_available_gib=0.5)
    with pytest.raises(preflight.PreflightRefused) as refused:
        engine_config(tiny_model, _refuse(tight), monkeypatch, platform=None)
    assert "WILL RUN OUT OF MEMORY at kv_cache on the host on vLLM's CPU backend" in str(
        refused.value
    )
    assert "first remedy a smaller VLLM_CPU_KVCACHE_SPACE" in str(refused.value)


def _unreadable_room(host: Path) -> Path:
    (host / "proc/meminfo").write_text("MemTotal: 1 kB\n")
    return host


@pytest.mark.parametrize("platform", ["xpu", None])
def test_an_unreadable_room_is_not_judged_and_never_refused(
    tiny_model, tmp_path, monkeypatch, records, clean_env, platform
):
    host = _unreadable_room(build_host(tmp_path / "host", [B70], mem_available_gib=0.1))
    engine_config(tiny_model, _refuse(host), monkeypatch, platform=platform)
    line = _line(records)
    assert "host room unreadable" in line and "host need" not in line


def test_an_igpu_first_in_pci_order_is_not_the_device(b70_27b, monkeypatch, records, clean_env):
    from hosts import add_igpu

    host, model = b70_27b
    add_igpu(host)
    with pytest.raises(preflight.PreflightRefused, match=r"1x Arc Pro B70, 32\.0 GiB"):
        engine_config(model, _refuse(host), monkeypatch)


def test_two_tiles_are_two_devices_under_the_flat_hierarchy(
    tiny_model, tmp_path, monkeypatch, records, clean_env
):
    """TP 2 on one two-tile GPU: Level Zero's FLAT hierarchy (its default) shows two
    devices; COMPOSITE shows one, which vLLM cannot split TP 2 over."""
    from hosts import add_tiles

    host = add_tiles(build_host(tmp_path / "host", [B70]), "card1", 2)
    engine_config(tiny_model, _refuse(host), monkeypatch, tensor_parallel_size=2)
    assert "tp_exceeds_gpus" not in _line(records)
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    with pytest.raises(preflight.PreflightRefused, match=r"tp_exceeds_gpus.*1x Arc Pro B70, 64"):
        engine_config(tiny_model, _refuse(host), monkeypatch, tensor_parallel_size=2)


def test_a_27b_bf16_with_30_gib_offloaded_starts_on_one_b70(
    b70_27b, monkeypatch, records, clean_env
):
    """Issue 57 class 9: the 27B BF16 on one B70 with --cpu-offload-gb 30. vLLM's UVA
    offloader keeps 30 GiB of the weights in pinned host memory (vllm/model_executor/
    offloader/uva.py, 0.32.0): the device holds the rest, the host holds the 30 GiB, and
    refuse lets it start."""
    host, model = b70_27b
    with pytest.raises(preflight.PreflightRefused, match="at load on the device"):
        engine_config(model, _refuse(host), monkeypatch)  # without the offload
    whole = _details(records)["phases"]["load"]["device_gib"]
    records.records.clear()
    engine_config(model, _refuse(host), monkeypatch, cpu_offload_gb=30)
    details = _details(records)
    assert details["verdict"] == "fits", details["why"]
    load = details["phases"]["load"]
    assert load["device_gib"] == pytest.approx(whole - 30, abs=0.01)
    assert load["host_gib"] >= 30


def test_a_two_tile_max_1550_on_i915_is_two_devices_and_tp_2_starts(
    tiny_model, tmp_path, monkeypatch, records, clean_env
):
    """Issue 57 class 9: a Data Center GPU Max 1550 on i915, FLAT (Level Zero's default on
    it: gfx_core_helper_xe_hpc_core.cpp), TP 2. i915 shows its tiles as gt/gt0 and gt/gt1,
    not xe's tile directories: two devices, so refuse lets it start."""
    from hosts import MAX_1550, as_i915

    host = as_i915(build_host(tmp_path / "host", [MAX_1550]), "card1", 2)
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "FLAT")
    engine_config(tiny_model, _refuse(host), monkeypatch, tensor_parallel_size=2)
    assert "tp_exceeds_gpus" not in _line(records)
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    with pytest.raises(preflight.PreflightRefused, match="tp_exceeds_gpus"):
        engine_config(tiny_model, _refuse(host), monkeypatch, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("gpus", "engine_args"),
    [
        (2, {"pipeline_parallel_size": 2}),
        (1, {"cpu_offload_gb": 40}),
        (1, {"tensor_parallel_size": 2, "nnodes": 2}),
        (2, {"tensor_parallel_size": 2, "max_model_len": -1}),
    ],
    ids=["PP 2 over two GPUs", "40 GiB offloaded", "TP 2 over two nodes", "max_model_len -1"],
)
def test_what_vllm_resolved_is_judged_and_these_start_ups_are_not_refused(
    b70_27b, tmp_path, monkeypatch, records, clean_env, gpus, engine_args
):
    """Issue 46's false refusals of the 27B BF16 on 32 GiB B70s: each stage, the offload,
    this node's one rank, and the fitted context are read from vLLM's configuration."""
    _, model = b70_27b
    host = build_host(tmp_path / "b70s", [B70] * gpus)
    engine_config(model, _refuse(host), monkeypatch, **engine_args)
    assert "WILL" not in _line(records)


def test_enforce_eager_cannot_rescue_a_load_failure_and_refuse_refuses_it(
    b70_27b, monkeypatch, records, clean_env
):
    """--enforce-eager (on most of Intel's serve lines) only changes what runs after the
    weights are placed (startup.reach): the 27B BF16's weights alone above the B70 still
    fail at load, and refuse stops the start-up, naming the flag."""
    host, model = b70_27b
    with pytest.raises(preflight.PreflightRefused) as refused:
        engine_config(model, _refuse(host), monkeypatch, enforce_eager=True)
    assert "WILL RUN OUT OF MEMORY at load on the device" in str(refused.value)
    debug = [line for line in records.lines() if "preflight json" in line]
    why = json.loads("".join(line.split(": ", 1)[1] for line in debug))["why"]
    assert why.endswith("--enforce-eager set, which cannot lower the load phase")


def test_a_flag_that_could_lower_the_failing_phase_caps_the_verdict_and_never_refuses(
    b70_27b, monkeypatch, records, clean_env
):
    """--disable-custom-all-reduce's buffers are not settled from vLLM's code (any phase,
    either way): the load failure is at most at risk, and refuse lets it start."""
    host, model = b70_27b
    engine_config(model, _refuse(host), monkeypatch, disable_custom_all_reduce=True)
    line = _line(records)
    assert line.startswith(f"{LINE} AT RISK") and "--disable-custom-all-reduce can lower" in line


def test_a_nan_in_config_json_keeps_the_config(b70_27b, monkeypatch, records, clean_env):
    """vLLM accepts NaN in config.json (Python's json does): the preflight sizes the model
    from the engine's own hf_config, so the 27B is still too large for one B70."""
    host, model = b70_27b
    path = model / "config.json"
    path.write_text(
        path.read_text().replace(
            '"tie_word_embeddings"', '"rope_theta": NaN, "tie_word_embeddings"'
        )
    )
    with pytest.raises(preflight.PreflightRefused, match="at load on the device"):
        engine_config(model, _refuse(host), monkeypatch)


def test_the_oom_kill_line_is_given_the_host_side_cause(b70_27b, monkeypatch, clean_env):
    """The OOM killer acts on host memory: the cause kept for its line is the host side's
    largest, not the device cause that leads the preflight's own line."""
    host, model = b70_27b
    state: dict[str, preflight.Judgement] = {}
    monkeypatch.setattr(preflight, "run_preflight", _keeping(preflight.run_preflight, state))
    engine_config(model, {"VLLM_XPU_MEMFIX_SYSROOT": str(host)}, monkeypatch)
    assert state["last"].verdict == "will run out of memory"
    assert state["last"].cause == "process_baseline", "the host side's largest cause"


def _keeping(run, state):
    def kept(vllm_config, settings, _state, *args):
        return run(vllm_config, settings, state, *args)

    return kept


@pytest.mark.parametrize(
    ("environ", "devices"),
    [
        ({}, [("card1", 0), ("card1", 1), ("card2", None), ("card0", None)]),
        (
            {"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"},
            [("card1", None), ("card2", None), ("card0", None)],
        ),
        ({"ZE_AFFINITY_MASK": "1,2"}, [("card1", 1), ("card2", None)]),
        ({"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE", "ZE_AFFINITY_MASK": "0.1"}, [("card1", None)]),
        ({"ONEAPI_DEVICE_SELECTOR": "level_zero:3"}, [("card0", None)]),
    ],
    ids=["flat", "composite", "flat mask", "composite sub-device", "selector"],
)
def test_the_devices_level_zero_enumerates(tmp_path, environ, devices):
    """A two-tile GPU, a one-tile GPU and an iGPU first in PCI order: the discrete GPUs
    come first, each tile a device under FLAT (Level Zero's default), one root device each
    under COMPOSITE, narrowed by ZE_AFFINITY_MASK (FLAT indices; i.j a tile of root i) and
    ONEAPI_DEVICE_SELECTOR."""
    from hosts import add_igpu, add_tiles

    from vllm_xpu_memfix.intel import driver

    root = add_igpu(add_tiles(build_host(tmp_path, [B70, B70]), "card1", 2))
    seen = driver.visible_gpus(driver.intel_gpus(root), environ)
    assert [(gpu.card, gpu.tile) for gpu in seen] == devices
    if environ.get("ZE_AFFINITY_MASK") == "0.1":
        assert seen[0].vram_bytes == 32 * 2**30, "one tile's memory, not the card's two"


def test_on_the_cpu_backend_a_flag_that_cannot_lower_the_failing_phase_is_refused(
    tiny_model, tmp_path, monkeypatch, records, clean_env
):
    """0.5 GiB cannot hold the 1 GiB KV cache: more renderer processes only add host
    memory (startup.reach), so refuse still stops it; a multimodal processor cache of
    unsettled effect makes it uncertain, and it starts."""
    tight = build_host(tmp_path / "tight", [], mem_available_gib=0.5)
    with pytest.raises(preflight.PreflightRefused, match="at kv_cache on the host"):
        engine_config(
            tiny_model, _refuse(tight), monkeypatch, platform=None, renderer_num_workers=2
        )
    engine_config(tiny_model, _refuse(tight), monkeypatch, platform=None, mm_processor_cache_gb=8)
    last = [line for line in records.lines(logging.INFO) if line.startswith(LINE)][-1]
    assert last.startswith(f"{LINE} AT RISK") and "--mm-processor-cache-gb not modelled" in last
