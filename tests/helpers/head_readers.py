"""A model whose code reads the head's weight directly, as diffusion_gemma and the
adapters in vLLM do; the release must keep it."""

from __future__ import annotations

from helpers.vocab_models import CausalLM


class ScoresFromHead(CausalLM):
    def score_rows(self, rows):
        return self.lm_head.weight[rows]
