"""The preflight: the start-up model run on the engine's own configuration, in the process
that builds it, before any worker starts; and the line after an OOM-killed start-up.

The in-process tests build the configuration with the installed vLLM's
``EngineArgs.create_engine_config`` (the call ``vllm serve``'s API server and ``LLM`` make);
the Intel GPUs are described by a sysroot (tests/hosts.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hosts import B70, build_host, qwen_27b_like

from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.numbers import ConfigError
from vllm_xpu_memfix.core.patching import Patcher, State
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


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = preflight.logger
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def engine_config(model: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> object:
    """``create_engine_config`` with every requested fix installed as register() does."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

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
        args = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True)
        return args.create_engine_config()
    finally:
        target = (config.PREFLIGHT.key, "vllm.engine.arg_utils:EngineArgs.create_engine_config")
        if settings.requested(config.PREFLIGHT):
            assert patcher.state(target)[0] is State.APPLIED
        patcher.revert_all()


@pytest.fixture
def b70_27b(tmp_path: Path) -> tuple[Path, Path]:
    """One 32 GiB Arc Pro B70 and a sparse 27B BF16 checkpoint (no weights on disk)."""
    host = build_host(tmp_path / "host", [B70])
    model = qwen_27b_like(tmp_path / "model")
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
                "max_position_embeddings": 4096,
                "tie_word_embeddings": False,
            }
        )
    )
    return host, model


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
    assert "WILL RUN OUT OF MEMORY at load on the device" in message
    assert "Arc Pro B70" in message and "VLLM_XPU_MEMFIX_PREFLIGHT=refuse" in message
    (warning,) = [line for line in records.lines(logging.WARNING) if line.startswith(LINE)]
    assert "main cause device_overcommit" in warning and len(warning) <= 320
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


def test_auto_never_refuses_and_logs_one_warning(b70_27b, monkeypatch, records, clean_env):
    host, model = b70_27b
    engine_config(model, {"VLLM_XPU_MEMFIX_SYSROOT": str(host)}, monkeypatch)
    assert len([line for line in records.lines(logging.WARNING) if line.startswith(LINE)]) == 1


def test_without_intel_gpus_the_line_says_the_device_is_not_judged(
    tiny_model, monkeypatch, records, clean_env
):
    engine_config(tiny_model, {}, monkeypatch)
    (line,) = [line for line in records.lines(logging.INFO) if line.startswith(LINE)]
    assert "FITS" in line and "no Intel GPU visible" in line and "device not judged" in line
    cause = line.split("main cause ")[1].split(";")[0]
    assert line.endswith(f"; see vllm-xpu-memfix explain {cause}"), line


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


def test_after_an_oom_kill_one_line_names_the_process_its_phase_and_the_cause(tmp_path, records):
    host = build_host(tmp_path / "host", [])
    _vmstat(host, 2)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    settings = config.load(
        {"VLLM_XPU_MEMFIX_SYSROOT": str(host), "VLLM_XPU_MEMFIX_LEDGER_DIR": str(ledger)}
    )
    judged = preflight.Judgement("", "at risk", "driver_host_copy", 2, started=100.0)
    rows = [
        {"phase": "process start", "pid": 7, "role": "worker-0", "ts": 101.0, "rss_anon": 1},
        {
            "phase": "weights loaded",
            "pid": 7,
            "role": "worker-0",
            "ts": 102.0,
            "rss_anon": 9 * 2**30,
            "mem_available": 2**30,
            "mem_total": 64 * 2**30,
        },
    ]
    (ledger / "ledger-h-7.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    assert records.lines() == [], "the counter has not risen: nothing to say"
    _vmstat(host, 3)
    preflight.after_the_fact(settings, judged, RuntimeError("Engine core initialization failed"))
    (line,) = records.lines()
    assert "oom_kill 2 -> 3" in line and "worker-0 pid=7 after phase 'weights loaded'" in line
    assert "MemAvailable 1.0 of 64.0 GiB" in line and "driver_host_copy" in line
    assert len(line) <= 320
    recorded = [
        json.loads(text)
        for path in ledger.glob("ledger-*.jsonl")
        if path.name != "ledger-h-7.jsonl"
        for text in path.read_text().splitlines()
    ]
    assert [r["phase"] for r in recorded] == ["killed by the OOM killer"]
    assert recorded[0]["victim_pid"] == 7 and recorded[0]["oom_kill_after"] == 3
