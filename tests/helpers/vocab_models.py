"""Model skeletons with vLLM's real vocabulary layers, for tests/test_vocab_copies.py.

Kept in their own module because the release reads the model's module source: this one
never names the lm_head's weight attribute, ``head_readers`` below does.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

VOCAB, HIDDEN = 4096, 512


class Body(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=dtype)


class CausalLM(torch.nn.Module):
    """The Qwen3/Llama layout: model.embed_tokens and a ParallelLMHead, tied or not."""

    def __init__(self, tied: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model = Body(dtype)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=dtype)
        if tied:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)


class EmbeddingAsHead(torch.nn.Module):
    """Tied by reusing the embedding module as the head (no ParallelLMHead at all)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model = Body(dtype)
        self.lm_head = self.model.embed_tokens


def process(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights, then each vocabulary layer's own process_weights_after_loading."""
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=generator))
    seen = set()
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and id(module) not in seen:
            seen.add(id(module))
            module.quant_method.process_weights_after_loading(module)
    return model


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    head = model.lm_head
    return head.quant_method.apply(head, hidden)


def embed(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens(ids)
