"""The parallel layout of a start-up, as vLLM places it: the ranks on this node, the
pipeline stages' share of the weights, and the experts' share under expert parallelism.

- TP x PP ranks make one engine; DP engines; ``--data-parallel-size-local`` of them on this
  node (else DP / nnodes). Without DP, the one engine's ranks are spread over ``--nnodes``.
  Under Ray, ranks may be on any node: the GPUs here are not counted against them.
- PP: vLLM 0.32.0 ``vllm/distributed/utils.py:get_pp_indices`` splits the layers evenly,
  the remainder going to the stages before the last; the first stage holds the embeddings,
  the last the head (a copy of tied embeddings too). The largest stage is judged.
- Expert parallel: each rank holds whole experts, E / (TP x DP), instead of a TP shard of
  every expert: with DP > 1 that is DP times fewer expert bytes a rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config

_EXPERT = re.compile(r"\.experts\.")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    engines_here: int
    ranks_here: int
    placed: bool  # False under Ray: the ranks may be on other nodes
    expert_ranks: int  # the DP engines that share the experts (1: none)

    @property
    def world(self) -> int:
        return self.tp * self.pp


def of(
    tp: int,
    pp: int,
    dp: int,
    dp_local: int | None,
    nnodes: int,
    backend: str | None,
    expert_parallel: bool,
) -> Layout:
    """The layout of these engine arguments, on the node that runs them."""
    nnodes = max(1, nnodes)
    if dp > 1:
        engines = dp_local if dp_local else max(1, dp // nnodes)
        ranks = engines * tp * pp
    else:
        engines = 1
        ranks = math.ceil(tp * pp / nnodes)
    placed = (backend or "").lower() != "ray"
    return Layout(tp, pp, engines, ranks, placed, dp if expert_parallel and dp > 1 else 1)


def stages(layers: int, pp: int) -> list[int]:
    """Layers per stage, as get_pp_indices splits them (VLLM_PP_LAYER_PARTITION unset)."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return parts


def _int(section: dict[str, Any], key: str) -> int | None:
    value = section.get(key)
    return value if type(value) is int and value > 0 else None


def largest_stage(config: dict[str, Any], total_bytes: float, pp: int) -> tuple[float, int | None]:
    """(the largest stage's share of the weights, its layers). Without the config's sizes,
    an even split."""
    text = text_config(config)
    layers = _int(text, "num_hidden_layers")
    if pp <= 1:
        return 1.0, layers
    if layers is None or total_bytes <= 0:
        return 1.0 / pp, None
    parts = stages(layers, pp)
    hidden, vocab = _int(text, "hidden_size"), _int(text, "vocab_size")
    per_element = total_bytes / max(1, _params_estimate(text) or 1)
    ends = float(hidden * vocab) * per_element if hidden and vocab else 0.0
    per_layer = max(0.0, total_bytes - 2 * ends) / layers
    sizes = [n * per_layer for n in parts]
    sizes[0] += ends
    sizes[-1] += ends
    largest = max(range(pp), key=lambda i: sizes[i])
    return min(1.0, sizes[largest] / total_bytes), max(parts)


def _params_estimate(text: dict[str, Any]) -> int | None:
    """Parameters from the sizes, to turn bytes into bytes per parameter."""
    hidden, layers, vocab = (
        _int(text, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")
    )
    if not (hidden and layers and vocab):
        return None
    inter = _int(text, "moe_intermediate_size") or _int(text, "intermediate_size") or 4 * hidden
    experts = _int(text, "num_experts") or _int(text, "num_local_experts") or 1
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter * experts)


def expert_share(ckpt: Checkpoint) -> float:
    """The experts' share of the checkpoint's bytes (from the tensor names, else the config)."""
    if ckpt.tensors:
        total = sum(t.nbytes for t in ckpt.tensors) or 1
        return sum(t.nbytes for t in ckpt.tensors if _EXPERT.search(t.name)) / total
    text = text_config(ckpt.config)
    experts = _int(text, "num_experts") or _int(text, "num_local_experts")
    params = _params_estimate(text)
    hidden, inter = _int(text, "hidden_size"), _int(text, "moe_intermediate_size")
    layers = _int(text, "num_hidden_layers")
    if not (experts and params and hidden and inter and layers):
        return 0.0
    return min(1.0, layers * 3 * hidden * inter * experts / params)
