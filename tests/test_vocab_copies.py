"""The unused vocabulary copies of vLLM's CPU backend, on vLLM's real layers.

The layers are vLLM's own VocabParallelEmbedding and ParallelLMHead, prepacked by
their own process_weights_after_loading (a real oneDNN handler or SGL packed tensor);
only the surrounding model is a skeleton (tests/helpers/vocab_models.py).
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_xpu_memfix.demo.server import free_port  # noqa: E402
from vllm_xpu_memfix.memory.vocab_copies import (  # noqa: E402
    holds_packed_copy,
    release_unused_vocab_copies,
)


@pytest.fixture(scope="module", autouse=True)
def vllm_world():
    """A one-rank gloo world: the vocabulary layers ask for their tensor-parallel rank."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )  # fmt: skip
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

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 512, generator=generator).to(torch.bfloat16)
    ids = torch.tensor([0, 7, 4095, 123])
    return logits(model, hidden), embed(model, ids)


def test_untied_model_drops_both_dead_copies_and_computes_the_same():
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    head, embedding = model.lm_head, model.model.embed_tokens
    assert holds_packed_copy(head) and holds_packed_copy(embedding)
    before = outputs(model)
    matrix_bytes = head.weight.nbytes
    embedding_packed = [weakref.ref(o) for o in packed_objects(embedding)]

    result = release_unused_vocab_copies(model, engine())

    assert [c.name.split()[0] for c in result.released] == ["model.embed_tokens", "lm_head.weight"]
    assert result.nbytes == 2 * matrix_bytes and not result.kept
    assert head.weight.numel() == 0 and embedding.weight.numel() > 0
    gc.collect()
    assert all(ref() is None for ref in embedding_packed), "the packed copy is freed"
    after = outputs(model)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_tied_model_keeps_the_shared_weight_and_drops_the_embedding_packed_copy():
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM(tied=True))
    before = outputs(model)
    result = release_unused_vocab_copies(model, engine())
    assert [c.name.split()[0] for c in result.released] == ["model.embed_tokens"]
    assert result.kept == ["lm_head.weight: tied to another parameter"]
    assert model.lm_head.weight.numel() > 0
    after = outputs(model)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"lora_config": object()}, "LoRA"),
        ({"speculative_config": object()}, "draft model"),
        ({"model_config": SimpleNamespace(head_dtype=torch.float32, dtype=torch.bfloat16)},
         "head_dtype"),
    ],
)  # fmt: skip
def test_engine_features_that_read_the_head_weight_keep_it(overrides, reason):
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    result = release_unused_vocab_copies(model, engine(**overrides))
    assert model.lm_head.weight.numel() > 0
    assert len(result.kept) == 1 and reason in result.kept[0]
    assert [c.name.split()[0] for c in result.released] == ["model.embed_tokens"]


def test_model_code_that_reads_the_head_weight_keeps_it():
    from helpers.head_readers import ScoresFromHead
    from helpers.vocab_models import process

    model = process(ScoresFromHead())
    result = release_unused_vocab_copies(model, engine())
    assert result.kept == ["lm_head.weight: helpers.head_readers mentions lm_head.weight"]
    assert model.score_rows(torch.tensor([1, 2])).shape == (2, 512)


def test_embedding_reused_as_the_head_keeps_its_packed_copy():
    from helpers.vocab_models import EmbeddingAsHead, process

    model = process(EmbeddingAsHead())
    result = release_unused_vocab_copies(model, engine())
    assert not result.released and "may also compute the logits" in result.kept[0]
    assert holds_packed_copy(model.lm_head)


def test_layers_without_a_packed_copy_are_left_alone():
    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    for module in (model.lm_head, model.model.embed_tokens):
        module.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    assert not holds_packed_copy(model.lm_head)
    result = release_unused_vocab_copies(model, engine())
    assert not result.released and not result.kept
    assert model.lm_head.weight.numel() > 0


def test_a_vllm_without_the_vocabulary_layers_is_skipped_with_a_reason(monkeypatch):
    import sys

    from helpers.vocab_models import CausalLM, process

    model = process(CausalLM())
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.vocab_parallel_embedding", None)
    result = release_unused_vocab_copies(model, engine())
    assert not result.released and "no vocab_parallel_embedding" in result.kept[0]
    assert model.lm_head.weight.numel() > 0


def test_a_model_class_without_readable_source_keeps_the_head_weight():
    from helpers.vocab_models import CausalLM, process

    generated = type("Generated", (CausalLM,), {"__module__": "made_at_runtime"})
    model = process(generated())
    result = release_unused_vocab_copies(model, engine())
    assert model.lm_head.weight.numel() > 0
    assert result.kept == ["lm_head.weight: the model's source cannot be read to rule out "
                           "lm_head.weight readers"]  # fmt: skip
