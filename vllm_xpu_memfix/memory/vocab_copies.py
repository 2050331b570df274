"""Drop the vocabulary-matrix copies that vLLM's CPU backend makes but never reads.

On the CPU platform, ``UnquantizedEmbeddingMethod.process_weights_after_loading``
calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`` for every
``VocabParallelEmbedding``: each gets a prepacked GEMM copy of its weight (a
oneDNN handler or an SGL packed tensor, held by the ``layer.cpu_linear``
closure) and keeps its unpacked weight too. Linear layers get
``remove_weight=True``; the vocabulary layers cannot, because the one method
serves both kinds. So for an untied model two vocab x hidden matrices are dead:

* the input embedding's prepacked copy: the embedding only looks rows up in
  ``weight`` (``F.embedding``);
* the lm_head's unpacked ``weight``: logits go through ``cpu_linear``, which
  reads only the packed copy.

For a tied model the embedding's packed copy is still dead (the lm_head has its
own). Each matrix is vocab x hidden x dtype bytes: 125 MiB for the test bed's
1 B model, 1.16 GiB for Qwen3-8B in bf16.

Dropping the embedding's packed copy cannot change results: its ``cpu_linear``
becomes ``F.linear`` on the kept weight, which is what vLLM itself uses when
prepacking fails. Dropping the lm_head's weight would break code that reads
``lm_head.weight`` directly, so it is kept whenever such code may run (see
:func:`reasons_to_keep_lm_head_weight`).
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VocabCopy:
    name: str
    nbytes: int


@dataclass
class VocabRelease:
    released: list[VocabCopy] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # "<name>: <why it stays>"
    # Why there was nothing to look at, when no vocabulary layer holds a packed copy.
    nothing_packed: str = ""

    @property
    def nbytes(self) -> int:
        return sum(copy.nbytes for copy in self.released)


def _storage(tensor: Any) -> int:
    return int(tensor.untyped_storage().data_ptr())


def holds_packed_copy(module: Any) -> bool:
    """Whether ``module.cpu_linear`` keeps its own prepacked copy of ``module.weight``.

    vLLM's fallback (``F.linear`` on the weight) and zentorch without prepacking
    keep none; the oneDNN handler and the SGL packed tensor do.
    """
    import torch

    weight = getattr(module, "weight", None)
    cells = getattr(getattr(module, "cpu_linear", None), "__closure__", None) or ()
    if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
        return False
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "handler_tensor"):
            return True
        if (
            isinstance(value, torch.Tensor)
            and value.numel()
            and _storage(value) != _storage(weight)
        ):
            return True
    return False


def reasons_to_keep_lm_head_weight(model: Any, vllm_config: Any) -> list[str]:
    """Why code may still read ``lm_head.weight`` in this engine; empty when nothing does."""
    reasons = []
    if getattr(vllm_config, "lora_config", None) is not None:
        reasons.append("LoRA wraps the lm_head")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append("a draft model may share or compare the lm_head")
    model_config = getattr(vllm_config, "model_config", None)
    head_dtype = getattr(model_config, "head_dtype", None)
    if head_dtype is not None and head_dtype != getattr(model_config, "dtype", head_dtype):
        reasons.append(f"head_dtype {head_dtype} projects with lm_head.weight")
    source_module = inspect.getmodule(type(model))
    try:
        source = inspect.getsource(source_module) if source_module is not None else None
    except (OSError, TypeError):
        source = None
    if source is None or source_module is None:
        reasons.append("the model's source cannot be read to rule out lm_head.weight readers")
    elif "lm_head.weight" in source:
        reasons.append(f"{source_module.__name__} mentions lm_head.weight")
    return reasons


def _why_nothing_is_packed(layers: list[tuple[str, Any]]) -> str:
    if not layers:
        return "the model has no vocabulary layers"
    if not any(hasattr(module, "cpu_linear") for _, module in layers):
        return "no CPU GEMM dispatch (not vLLM's CPU backend), so nothing is prepacked"
    # vLLM falls back to F.linear on the kept weight where oneDNN has no matmul for the
    # dtype on this CPU, e.g. bf16 without AVX-512 (model_executor/layers/utils.py, 0.32).
    return "vLLM's CPU GEMM kept no packed copy of them (torch linear on the weight on this CPU)"


def release_unused_vocab_copies(model: Any, vllm_config: Any) -> VocabRelease:
    """Drop the dead copies described in the module docstring; returns what went and what stayed."""
    import torch

    result = VocabRelease()
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )
    except ImportError as exc:
        result.kept.append(f"all: this vLLM has no vocab_parallel_embedding layers ({exc})")
        return result
    layers: list[tuple[str, Any]] = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, VocabParallelEmbedding)
    ]
    vocab = [(name, module) for name, module in layers if holds_packed_copy(module)]
    if not vocab:
        result.nothing_packed = _why_nothing_is_packed(layers)
        return result
    names_per_module = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    has_lm_head = any(isinstance(m, ParallelLMHead) for m in model.modules())
    keep_head_weight = reasons_to_keep_lm_head_weight(model, vllm_config)
    for name, module in vocab:
        weight: torch.Tensor = module.weight
        nbytes = int(weight.nbytes)
        if isinstance(module, ParallelLMHead):
            shared = any(
                _storage(p) == _storage(weight)
                for owner in model.modules()
                if owner is not module
                for p in owner.parameters(recurse=False)
            )
            if shared or keep_head_weight:
                why = "tied to another parameter" if shared else "; ".join(keep_head_weight)
                result.kept.append(f"{name}.weight: {why}")
                continue
            module.weight = torch.nn.Parameter(
                torch.empty(0, dtype=weight.dtype, device=weight.device),
                requires_grad=False,
            )
            result.released.append(VocabCopy(f"{name}.weight (GEMM reads the packed copy)", nbytes))
        elif not has_lm_head or names_per_module[id(module)] > 1:
            result.kept.append(f"{name} packed copy: this module may also compute the logits")
        else:
            module.cpu_linear = torch.nn.functional.linear
            result.released.append(VocabCopy(f"{name} packed copy (lookups read .weight)", nbytes))
    return result
