"""The unused vocabulary copies of vLLM's CPU backend, on vLLM's real layers.

The layers are vLLM's own VocabParallelEmbedding and ParallelLMHead, processed by their
own process_weights_after_loading; only the surrounding model is a skeleton
(tests/helpers/vocab_models.py). Whether that processing prepacks depends on the CPU:
every test runs in bf16 and float32 and asks the installed build which of them it
prepacks here (tests/helpers/cpu_gemm.py). Where it prepacks, the dead copies go and the
outputs stay bit-identical; where it falls back to torch linear, nothing is released or
kept, one line says why, and the outputs are unchanged. The last test repeats the module
with oneDNN limited to AVX2, so both paths run on every x86-64 machine.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from helpers.cpu_gemm import cpu_features, vllm_prepacks  # noqa: E402

from vllm_xpu_memfix.cli.demo.server import free_port  # noqa: E402
from vllm_xpu_memfix.memory.vocab_copies import (  # noqa: E402
    holds_packed_copy,
    release_unused_vocab_copies,
)

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="float32")]
NO_PACKED_COPY = "vLLM's CPU GEMM kept no packed copy"


@pytest.fixture(scope="module", autouse=True)
def vllm_world():
    """A one-rank gloo world: the vocabulary layers ask for their tensor-parallel rank."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        parallel_state.initialize_model_parallel(1, 1)
        yield
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def engine(**overrides):
    model_config = SimpleNamespace(head_dtype=None, dtype=torch.bfloat16)
    fields = {"lora_config": None, "speculative_config": None, "model_config": model_config}
    return SimpleNamespace(**{**fields, **overrides})


def packed_objects(module):
    return [c.cell_contents for c in module.cpu_linear.__closure__ or ()]


def outputs(model):
    from helpers.vocab_models import embed, logits

    dtype = model.lm_head.weight.dtype
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 512, generator=generator).to(dtype)
    ids = torch.tensor([0, 7, 4095, 123])
    return logits(model, hidden), embed(model, ids)


def assert_same(before, after):
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def assert_left_alone(model, result, before):
    """The fallback: nothing released or kept, one line saying why, the same outputs."""
    assert not result.released and not result.kept
    assert result.nothing_packed.startswith(NO_PACKED_COPY), result.nothing_packed
    assert "\n" not in result.nothing_packed
    assert model.lm_head.weight.numel() > 0 and model.model.embed_tokens.weight.numel() > 0
    assert_same(before, outputs(model))


def released_names(result):
    return [c.name.split()[0] for c in result.released]


@pytest.mark.parametrize("dtype", DTYPES)
def test_untied_model_drops_both_dead_copies_and_computes_the_same(dtype):
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM(dtype=dtype))
    head, embedding = model.lm_head, model.model.embed_tokens
    assert holds_packed_copy(head) is holds_packed_copy(embedding) is vllm_prepacks(dtype)
    before = outputs(model)
    matrix_bytes = head.weight.nbytes
    embedding_packed = [weakref.ref(o) for o in packed_objects(embedding)]

    result = release_unused_vocab_copies(model, engine())

    if not vllm_prepacks(dtype):
        assert_left_alone(model, result, before)
        return
    assert released_names(result) == ["model.embed_tokens", "lm_head.weight"]
    assert result.nbytes == 2 * matrix_bytes and not result.kept and not result.nothing_packed
    assert head.weight.numel() == 0 and embedding.weight.numel() > 0
    gc.collect()
    assert all(ref() is None for ref in embedding_packed), "the packed copy is freed"
    assert_same(before, outputs(model))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_model_keeps_the_shared_weight_and_drops_the_embedding_packed_copy(dtype):
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM(tied=True, dtype=dtype))
    before = outputs(model)
    result = release_unused_vocab_copies(model, engine())
    if not vllm_prepacks(dtype):
        assert_left_alone(model, result, before)
        return
    assert released_names(result) == ["model.embed_tokens"]
    assert result.kept == ["lm_head.weight: tied to another parameter"]
    assert model.lm_head.weight.numel() > 0
    assert_same(before, outputs(model))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"lora_config": object()}, "LoRA"),
        ({"speculative_config": object()}, "draft model"),
        (
            {"model_config": SimpleNamespace(head_dtype=torch.float32, dtype=torch.bfloat16)},
            "head_dtype",
        ),
    ],
)
def test_engine_features_that_read_the_head_weight_keep_it(overrides, reason, dtype):
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM(dtype=dtype))
    before = outputs(model)
    result = release_unused_vocab_copies(model, engine(**overrides))
    if not vllm_prepacks(dtype):
        assert_left_alone(model, result, before)
        return
    assert model.lm_head.weight.numel() > 0
    assert len(result.kept) == 1 and reason in result.kept[0]
    assert released_names(result) == ["model.embed_tokens"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_code_that_reads_the_head_weight_keeps_it(dtype):
    from helpers.head_readers import ScoresFromHead
    from helpers.vocab_models import process

    model = process(ScoresFromHead(dtype=dtype))
    before = outputs(model)
    result = release_unused_vocab_copies(model, engine())
    if not vllm_prepacks(dtype):
        assert_left_alone(model, result, before)
    else:
        assert result.kept == ["lm_head.weight: helpers.head_readers mentions lm_head.weight"]
    assert model.score_rows(torch.tensor([1, 2])).shape == (2, 512)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_reused_as_the_head_keeps_its_packed_copy(dtype):
    from helpers.vocab_models import EmbeddingAsHead, process

    model = process(EmbeddingAsHead(dtype=dtype))
    result = release_unused_vocab_copies(model, engine())
    assert not result.released
    if not vllm_prepacks(dtype):
        assert not result.kept and result.nothing_packed.startswith(NO_PACKED_COPY)
        return
    assert "may also compute the logits" in result.kept[0]
    assert holds_packed_copy(model.lm_head)


def test_layers_without_a_packed_copy_are_left_alone_with_a_reason():
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    for module in (model.lm_head, model.model.embed_tokens):
        module.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    assert not holds_packed_copy(model.lm_head)
    before = outputs(model)
    assert_left_alone(model, release_unused_vocab_copies(model, engine()), before)


def test_layers_outside_the_cpu_backend_are_left_alone_with_a_reason():
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    for module in (model.lm_head, model.model.embed_tokens):
        del module.cpu_linear
    result = release_unused_vocab_copies(model, engine())
    assert not result.released and not result.kept
    assert "not vLLM's CPU backend" in result.nothing_packed


def test_a_vllm_without_the_vocabulary_layers_is_skipped_with_a_reason(monkeypatch):
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.vocab_parallel_embedding", None)
    result = release_unused_vocab_copies(model, engine())
    assert not result.released and "no vocab_parallel_embedding" in result.kept[0]
    assert model.lm_head.weight.numel() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_class_without_readable_source_keeps_the_head_weight(dtype):
    from helpers.vocab_models import CausalLM, process

    generated = type("Generated", (CausalLM,), {"__module__": "made_at_runtime"})
    model = process(generated(dtype=dtype))
    before = outputs(model)
    result = release_unused_vocab_copies(model, engine())
    if not vllm_prepacks(dtype):
        assert_left_alone(model, result, before)
        return
    assert model.lm_head.weight.numel() > 0
    assert result.kept == [
        "lm_head.weight: the model's source cannot be read to rule out lm_head.weight readers"
    ]


AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_the_same_module_passes_with_onednn_limited_to_avx2():
    """The AVX2-only path on any machine: oneDNN then has no bf16 matmul, so bf16 takes
    vLLM's torch-linear fallback while float32 still prepacks (both asserted above)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip(f"this run is already limited by ONEDNN_MAX_CPU_ISA ({cpu_features()})")
    env = {**os.environ, **AVX2_ONLY}
    tests = Path(__file__).parent
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; from helpers.cpu_gemm import vllm_prepacks; "
            "print(vllm_prepacks(torch.bfloat16), vllm_prepacks(torch.float32))",
        ],
        env={**env, "PYTHONPATH": str(tests)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    if probe.stdout.split()[-2] == "True":
        pytest.skip(
            f"oneDNN builds a bf16 matmul here even when limited to AVX2 "
            f"({cpu_features()}): no fallback path to run"
        )
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not limited_to_avx2",
        ],
        env=env,
        cwd=tests.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:]
    assert " passed" in child.stdout and "failed" not in child.stdout
