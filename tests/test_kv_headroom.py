"""KV headroom: the burst estimator, the reserve on a real VllmConfig, and the OOM hint.

The worker tests build the configuration with vLLM's own ``EngineArgs`` from a
model config of vocabulary 248,320 (llm-scaler #703's Qwen) and call the real
plugin-wrapped ``Worker.determine_available_memory``; only the profiling it wraps is
a stub, since it needs a device. The OOM message is #703's, recorded.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import wrapt

import vllm_xpu_memfix
from vllm_xpu_memfix import fixes
from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.log import LIMIT
from vllm_xpu_memfix.core.patching import Patcher, State
from vllm_xpu_memfix.fixes import kv_headroom
from vllm_xpu_memfix.memory.estimate import (
    BurstShape,
    dtype_bytes,
    estimate_sampler_burst,
    pad_vocab,
)

MiB = 1024**2
GiB = 1024**3
VOCAB_703 = 248320
DOCS_DATA = Path(__file__).parent.parent / "docs" / "data"
PREFLIGHT_TARGET = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
# The failure of llm-scaler #703, worker TP1, as logged.
OOM_703 = (
    "XPU out of memory. Tried to allocate 122.00 MiB. GPU 1 has a total capacity of 31.89 GiB "
    "of which 2.56 GiB is free. Of the allocated memory 26.14 GiB is allocated by PyTorch, and "
    "162.84 MiB is reserved by PyTorch but unallocated."
)


# --- estimator -------------------------------------------------------------------------


def test_703_gathered_logits_are_the_122_mib_that_failed():
    burst = estimate_sampler_burst(BurstShape(256, VOCAB_703, 2, tp_size=4, hidden_size=5120))
    assert burst.gathered_logits / MiB == pytest.approx(121.3, abs=0.05)
    # The OOM message rounds the same allocation to 122.00 MiB.
    assert round(burst.gathered_logits / MiB) == 121


def test_sort_fallback_peaks_inside_torch_sort_with_its_scratch():
    bv = 256 * VOCAB_703
    burst = estimate_sampler_burst(BurstShape(256, VOCAB_703, 2, tp_size=4, topk_topp="sort"))
    assert burst.peak_stage.name == "torch.sort"
    names = {t.name: t.nbytes for t in burst.peak_stage.terms}
    assert names["sort indices"] == bv * 8
    assert names["sorted values"] == names["fp32 logits"] == bv * 4
    # 256 rows: segmented_sort_pairs, int64 row indices + radix key/value buffers.
    assert names["sort row indices"] == bv * 8
    # bf16 logits + fp32 copy + sort outputs 12 + scratch 20 bytes per element.
    # Plus up to 1 MiB of allocator rounding per large block.
    assert bv * (2 + 4 + 12 + 20) <= burst.peak <= bv * (2 + 4 + 12 + 20) + 7 * MiB


def test_sort_scratch_follows_pytorchs_three_strategies():
    def per_element(rows: int, vocab: int = 151936) -> float:
        burst = estimate_sampler_burst(BurstShape(rows, vocab, 2, topk_topp="sort"))
        sort = next(stage for stage in burst.stages if stage.name == "torch.sort")
        scratch = sum(t.nbytes for t in sort.terms if t.source.startswith("PyTorch"))
        return scratch / (rows * vocab)

    assert per_element(64) == pytest.approx(8 + 8 + 4 + 12, rel=0.01)  # full sort of pairs
    assert per_element(512) == pytest.approx(8 + 12, rel=0.01)  # segmented sort
    assert per_element(1) == pytest.approx(8 + 12, rel=0.03)  # one row (+ 64 KiB cub scratch)
    assert per_element(2, vocab=2_000_000) == pytest.approx((8 + 12) / 2, rel=0.01)


def test_triton_path_peaks_at_the_random_sample():
    burst = estimate_sampler_burst(BurstShape(256, VOCAB_703, 2, tp_size=4, topk_topp="triton"))
    assert burst.peak_stage.name == "random sample"
    exact = 256 * VOCAB_703 * (2 + 4 + 4 + 4)
    assert exact <= burst.peak <= exact + 5 * MiB
    sort = estimate_sampler_burst(BurstShape(256, VOCAB_703, 2, tp_size=4, topk_topp="sort"))
    assert burst.peak < sort.peak


@pytest.mark.parametrize(
    ("recording", "tp", "shapes"),
    [
        ("kv-headroom-h200.json", 1, 60),
        ("kv-headroom-h200-tp2.json", 2, 20),
        ("kv-headroom-h200-tp4.json", 4, 20),
        ("kv-headroom-h200-tp8.json", 8, 20),
    ],
)
def test_estimate_covers_every_shape_measured_on_the_h200(recording, tp, shapes):
    """Recorded H200 runs (docs/data/): vLLM's own Sampler, both top-k/top-p paths; TP 1:
    fp16/bf16, V in {32000, 151936, 248320}; TP 2/4/8 (one rank, its shard gathered by vLLM's
    DeviceCommunicatorBase.all_gather): bf16, V in {151936, 248320}; B in {1..1024}."""
    recorded = json.loads((DOCS_DATA / recording).read_text())
    assert recorded.get("tp", 1) == tp and len(recorded["rows"]) == shapes
    for row in recorded["rows"]:
        shape = BurstShape(row["batch"], row["vocab"], 2, tp, recorded["hidden"], row["path"])
        estimate = estimate_sampler_burst(shape).peak
        assert row["torch_peak"] <= estimate <= 1.25 * row["torch_peak"], row


def test_all_gather_holds_shard_output_and_reordered_copy():
    burst = estimate_sampler_burst(BurstShape(64, 151936, 2, tp_size=8))
    gather = next(s for s in burst.stages if s.name == "all_gather")
    terms = {t.name: t.nbytes for t in gather.terms}
    assert terms["lm_head logits"] == 64 * 151936 // 8 * 2
    assert terms["gathered logits"] == terms["gather reorder copy"] == 64 * 151936 * 2
    single = estimate_sampler_burst(BurstShape(64, 151936, 2, tp_size=1))
    assert "all_gather" not in {s.name for s in single.stages}
    assert single.gathered_logits == 64 * 151936 * 2


def test_padded_vocab_sets_the_logits_width_and_fp32_uses_the_real_vocab():
    assert pad_vocab(32001) == 32064
    burst = estimate_sampler_burst(BurstShape(8, 32001, 2, tp_size=2))
    assert burst.gathered_logits == 8 * 32064 * 2
    assert burst.term("fp32 logits").nbytes == -(-8 * 32001 * 4 // 512) * 512


def test_scales_linearly_in_batch_and_vocab():
    one = estimate_sampler_burst(BurstShape(128, 65536, 2)).peak
    two_b = estimate_sampler_burst(BurstShape(256, 65536, 2)).peak
    two_v = estimate_sampler_burst(BurstShape(128, 131072, 2)).peak
    assert two_b == pytest.approx(2 * one, rel=0.01)
    assert two_v == pytest.approx(2 * one, rel=0.01)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_reqs": 0}, "num_reqs"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"tp_size": 3, "vocab_size": 64}, "tp_size 3"),
    ],
)
def test_bad_shapes_are_refused_with_the_field_named(kwargs, named):
    base = {"num_reqs": 8, "vocab_size": 32000, "logits_dtype_bytes": 2}
    with pytest.raises(ValueError, match=named):
        BurstShape(**{**base, **kwargs})


def test_dtype_names():
    torch = pytest.importorskip("torch")
    assert dtype_bytes(torch.bfloat16) == dtype_bytes("float16") == 2
    assert dtype_bytes(torch.float32) == 4
    with pytest.raises(ValueError, match="unsupported logits dtype"):
        dtype_bytes(torch.int8)


# --- the reserve on a real VllmConfig ----------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config_703(tmp_path_factory):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    directory = tmp_path_factory.mktemp("qwen-248k")
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 512,
                "intermediate_size": 1024,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 128,
                "vocab_size": VOCAB_703,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
                "tie_word_embeddings": False,
            }
        )
    )
    # EngineArgs loads vLLM's general plugins (in __post_init__): keep this plugin's
    # register() out, or every fix stays patched for the rest of the pytest session
    # (test_the_module_leaves_vllm_as_it_found_it).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_PLUGINS", "none")
        args = EngineArgs(
            model=str(directory), skip_tokenizer_init=True, max_num_seqs=256, dtype="float16"
        )
        return args.create_engine_config()


STUB_BYTES = 20 * GiB


@pytest.fixture
def worker_with(vllm_config_703, monkeypatch):
    """A Worker whose profiling is a stub, wrapped by the plugin's real patch."""
    from vllm.v1.worker.gpu_worker import Worker

    def stub_profile(self):
        self.available_kv_cache_memory_bytes = self.stub_bytes
        return self.stub_bytes

    monkeypatch.setattr(Worker, "determine_available_memory", stub_profile)
    patchers: list[Patcher] = []

    def make(env: dict[str, str], stub_bytes: int = STUB_BYTES, kv_bytes: int | None = None):
        for earlier in patchers:
            earlier.revert_all()
        patchers.append(Patcher())
        patchers[-1].install(kv_headroom.patches(config.load(env))[0])
        worker = object.__new__(Worker)
        worker.vllm_config = vllm_config_703
        worker.cache_config = SimpleNamespace(kv_cache_memory_bytes=kv_bytes)
        worker.rank = 0
        worker.stub_bytes = stub_bytes
        return worker

    yield make
    for patcher in reversed(patchers):
        patcher.revert_all()


def _records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_reserve_is_subtracted_and_logged(worker_with, caplog):
    worker = worker_with({"VLLM_XPU_MEMFIX_KV_HEADROOM": "on"})
    with caplog.at_level(logging.INFO):
        available = worker.determine_available_memory()
    line = next(m for m in _records(caplog, logging.INFO) if "KV headroom" in m)
    reserve_mib = float(re.search(r"reserve ([\d,.]+) MiB", line).group(1).replace(",", ""))
    assert reserve_mib == pytest.approx(121.25 + 256, abs=0.1)
    assert available == pytest.approx(STUB_BYTES - reserve_mib * MiB, abs=0.1 * MiB)
    assert available < STUB_BYTES
    assert worker.available_kv_cache_memory_bytes == available
    assert "B=256 x vocab 248,320 x 2 B" in line
    assert "20.00 -> 19.63 GiB (1.84% given up)" in line
    assert line.endswith("See vllm-xpu-memfix explain sampler_burst") and len(line) <= LIMIT


def test_a_kv_size_set_by_vllms_start_up_plan_still_gets_the_reserve(worker_with, monkeypatch):
    """VLLM_ENABLE_STARTUP_PLAN=1 (vLLM 0.26+, v1/worker/startup_plan.py) sets
    kv_cache_memory_bytes inside determine_available_memory on a second boot; only a value
    set before the call is the user's."""
    from vllm.v1.worker.gpu_worker import Worker

    def planned_profile(self):  # maybe_apply_startup_plan, stood in
        self.cache_config.kv_cache_memory_bytes = self.stub_bytes
        self.available_kv_cache_memory_bytes = self.stub_bytes
        return self.stub_bytes

    monkeypatch.setattr(Worker, "determine_available_memory", planned_profile)
    worker = worker_with({"VLLM_XPU_MEMFIX_KV_HEADROOM": "on"})
    assert worker.determine_available_memory() < STUB_BYTES


def test_slack_switch_changes_the_reserve(worker_with):
    worker = worker_with(
        {"VLLM_XPU_MEMFIX_KV_HEADROOM": "on", "VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB": "0"}
    )
    assert STUB_BYTES - worker.determine_available_memory() == 256 * VOCAB_703 * 2


def test_auto_leaves_non_xpu_platforms_alone(worker_with):
    worker = worker_with({})
    assert worker.determine_available_memory() == STUB_BYTES


def test_user_set_kv_size_is_left_alone_and_warns_when_the_burst_cannot_fit(worker_with, caplog):
    worker = worker_with({"VLLM_XPU_MEMFIX_KV_HEADROOM": "on"}, kv_bytes=10 * GiB)
    worker.init_snapshot = SimpleNamespace(free_memory=10 * GiB + 3 * GiB + 200 * MiB)
    worker.model_runner = SimpleNamespace(model_memory_usage=3 * GiB)
    with caplog.at_level(logging.WARNING):
        assert worker.determine_available_memory() == STUB_BYTES
    warning = next(m for m in _records(caplog, logging.WARNING) if "kv-cache-memory-bytes" in m)
    assert "leaves 200 MiB" in warning and len(warning) <= LIMIT
    assert warning.endswith("See vllm-xpu-memfix explain sampler_burst")
    suggested = int(re.search(r"Lower --kv-cache-memory-bytes to (\d+)", warning).group(1))
    assert suggested < 10 * GiB

    roomy = worker_with({"VLLM_XPU_MEMFIX_KV_HEADROOM": "on"}, kv_bytes=10 * GiB)
    roomy.init_snapshot = SimpleNamespace(free_memory=20 * GiB)
    roomy.model_runner = SimpleNamespace(model_memory_usage=3 * GiB)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert roomy.determine_available_memory() == STUB_BYTES
    assert not [m for m in _records(caplog, logging.WARNING) if "kv-cache-memory-bytes" in m]


def test_oversize_reserve_fails_with_the_numbers_and_the_ways_out(worker_with):
    worker = worker_with({"VLLM_XPU_MEMFIX_KV_HEADROOM": "on"}, stub_bytes=300 * MiB)
    with pytest.raises(kv_headroom.KVHeadroomError) as error:
        worker.determine_available_memory()
    message = str(error.value)
    for fragment in (
        "377 MiB",
        "300 MiB",
        "256 requests",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
    ):
        assert fragment in message


def test_invalid_slack_is_a_config_error():
    with pytest.raises(numbers.ConfigError, match="VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB"):
        config.load({"VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB": "-5"})


# --- OOM hint ---------------------------------------------------------------------------


def test_recorded_703_oom_is_recognised_with_its_size():
    torch = pytest.importorskip("torch")
    is_oom, tried = kv_headroom.device_oom(torch.OutOfMemoryError(OOM_703))
    assert is_oom and tried == 122 * MiB
    # vLLM's _dummy_sampler_run re-raises OOMs as a plain RuntimeError "from" the original.
    try:
        try:
            raise torch.OutOfMemoryError(OOM_703)
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("CUDA out of memory occurred when warming up sampler") from inner
    except RuntimeError as outer:
        assert kv_headroom.device_oom(outer) == (True, 122 * MiB)
    assert kv_headroom.device_oom(RuntimeError("UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY")) == (
        True,
        None,
    )
    assert kv_headroom.device_oom(ValueError("shape mismatch"))[0] is False


def test_oom_in_warm_up_logs_the_kv_size_that_fits_and_reraises(vllm_config_703, caplog):
    torch = pytest.importorskip("torch")
    worker = SimpleNamespace(
        vllm_config=vllm_config_703,
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None),
        available_kv_cache_memory_bytes=int(20.62 * GiB),
    )

    def warm_up():
        raise torch.OutOfMemoryError(OOM_703)

    with caplog.at_level(logging.ERROR), pytest.raises(torch.OutOfMemoryError):
        kv_headroom.hint_on_oom(config.load({}), warm_up, worker, (), {})
    hint = next(m for m in _records(caplog, logging.ERROR) if "--kv-cache-memory-bytes=" in m)
    suggested = int(re.search(r"--kv-cache-memory-bytes=(\d+)", hint).group(1))
    expected = int(20.62 * GiB) - 122 * MiB - (256 * VOCAB_703 * 2 + 256 * MiB)
    assert suggested == expected
    assert "the failed allocation 122 MiB" in hint
    assert hint.endswith("See vllm-xpu-memfix explain sampler_burst") and len(hint) <= LIMIT


def test_other_errors_pass_through_without_a_hint(caplog):
    def fails():
        raise ValueError("not memory")

    with caplog.at_level(logging.ERROR), pytest.raises(ValueError):
        kv_headroom.hint_on_oom(config.load({}), fails, SimpleNamespace(), (), {})
    assert not _records(caplog, logging.ERROR)


def arithmetic_703() -> dict[str, float]:
    """#703's reserve, KV cache and workaround in bytes, from its logs: 20.62 GiB of KV cache
    per rank at utilisation 0.92 on 31.89 GiB cards, worked around with 0.85 (B 256, fp16,
    TP 4). docs/fixes.md states these figures; test_evidence reads them here."""
    shape = BurstShape(256, VOCAB_703, 2, tp_size=4, hidden_size=5120)
    slack = config.load({}).kv_headroom_slack_mib * MiB
    return {
        "reserve": estimate_sampler_burst(shape).gathered_logits + slack,
        "kv_cache": 20.62 * GiB,
        "utilisation": 0.92,
        "worked_around_at": 0.85,
        "workaround": (0.92 - 0.85) * 31.89 * GiB,
    }


def test_703_goal_reserve_is_under_3_percent_of_the_kv_cache_at_092():
    figures = arithmetic_703()
    assert figures["reserve"] == 256 * VOCAB_703 * 2 + config.load({}).kv_headroom_slack_mib * MiB
    assert figures["reserve"] / figures["kv_cache"] <= 0.03
    assert figures["reserve"] < figures["workaround"] / 5


# --- end to end -------------------------------------------------------------------------


@pytest.mark.server
def test_real_server_sizes_its_kv_cache_after_the_reserve(serve, tiny_model):
    """The CPU worker plays the XPU worker: same method, sized by utilisation (no
    VLLM_CPU_KVCACHE_SPACE); the tiny model's KV cache costs 512 bytes per token."""
    psutil = pytest.importorskip("psutil")
    util = round(3 * GiB / psutil.virtual_memory().total, 3)
    server = serve(
        tiny_model,
        env={"VLLM_CPU_KVCACHE_SPACE": None, "VLLM_XPU_MEMFIX_KV_HEADROOM": "on"},
        extra_args=["--gpu-memory-utilization", str(util)],
    )
    server.wait_ready()
    assert server.complete("Hello")["choices"]
    log = server.log_text()
    vllm_sized = float(re.search(r"Auto set \(([\d.]+)/[\d.]+\) GiB for KV cache", log).group(1))
    line = re.search(r"KV headroom .*KV cache ([\d.]+) -> ([\d.]+) GiB.*reserve ([\d.]+) MiB", log)
    before, after, reserve_mib = (float(g) for g in line.groups())
    assert before == vllm_sized
    assert reserve_mib == pytest.approx(256.1, abs=0.1)
    assert (before - after) * 1024 == pytest.approx(reserve_mib, abs=11)
    tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    assert after * GiB - 0.01 * GiB <= tokens * 512 <= after * GiB + 0.01 * GiB


# --- what this module leaves behind -------------------------------------------------------


def _wrapped_fix_targets() -> list[str]:
    """Every fix's target, in a module imported in this process, that a wrapper sits on
    (on the class or module the target names, where the Patcher places it)."""
    wrapped = []
    for patch in fixes.all_patches():
        parent = sys.modules.get(patch.module)
        *path, attribute = patch.attr_path.split(".")
        for name in path:
            parent = getattr(parent, name, None)
        if parent is not None and isinstance(vars(parent).get(attribute), wrapt.FunctionWrapper):
            wrapped.append(patch.target)
    return wrapped


def test_the_module_leaves_vllm_as_it_found_it(vllm_config_703):
    """Building the module's config runs vLLM's ``load_general_plugins`` in this process.
    Had that let this plugin's ``register()`` in, every fix would stay patched for the
    rest of the pytest session (test_preflight once saw its wrapper twice). Last in the
    module, after the worker tests have reverted their own patches: no patch of this
    plugin is applied and every fix target vLLM has imported is vLLM's own."""
    from vllm.engine.arg_utils import EngineArgs

    assert [k for k, (s, _) in vllm_xpu_memfix.PATCHER.states().items() if s is State.APPLIED] == []
    assert PREFLIGHT_TARGET in {p.target for p in fixes.all_patches()}
    assert not isinstance(vars(EngineArgs)["create_engine_config"], wrapt.FunctionWrapper)
    assert _wrapped_fix_targets() == []
