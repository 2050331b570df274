"""The KV cache as vLLM 0.32.0 lays it out: per layer type, what one sequence holds.

- full attention and MLA keep every token: K and V of each KV head a rank holds
  (``max(1, heads // tp)``, ``ModelConfig.get_num_kv_heads``), or MLA's one latent of
  ``kv_lora_rank + qk_rope_head_dim``, one "head" that every rank holds whole
  (``get_num_kv_heads`` returns 1; ``MLAAttentionSpec`` has no V);
- sliding-window and chunked-local layers keep at most their window plus the tokens in
  flight (``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec.max_admission_blocks_per_
  request``); with the hybrid allocator off they cost full attention
  (``vllm/v1/core/kv_cache_utils.py:unify_hybrid_kv_cache_specs``), and vLLM turns it off
  for chunked-local models (``vllm/config/vllm.py:VllmConfig.__post_init__``);
- mamba and linear-attention layers keep a fixed state per sequence (``MambaSpec``: one
  block, two in the ``align`` cache mode), split over the TP ranks;
- cross-attention keeps the encoder's tokens (``CrossAttentionSpec``);
- encoder-only models keep none, and a pooling runner runs no sampler.

With several layer types, vLLM groups the layers and pads each type to a multiple of the
smallest type's count (``kv_cache_utils.py:_get_kv_cache_groups_uniform_page_size``); one
sequence takes the blocks of every group (``_max_memory_usage_bytes_from_groups``), and the
pool keeps one block back (``get_kv_cache_configs``). Where vLLM is installed the layer
facts come from its ``VllmConfig`` (``from_vllm``), else from config.json (``from_config``);
the tests hold both equal on real config.json files. Not modelled: the platform's page
unification of attention and mamba pages (after the model is built), DCP, HiSparse.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.memory.checkpoint import text_config

FULL, SLIDING, CHUNKED, STATE, CROSS = "full", "sliding", "chunked", "state", "cross"
DEFAULT_BLOCK = 16  # CacheConfig's block size where the platform sets none
# vLLM's runner from the architecture's name (vllm/config/model.py:_SUFFIX_TO_DEFAULTS):
# these suffixes pool; "*ForCausalLM" and the other generating ones are matched first.
_GENERATE = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")
_POOL = ("ForTextEncoding", "EmbeddingModel", "ForSequenceClassification", "Model")
# Bidirectional encoders vLLM runs with EncoderOnlyAttention (no KV cache).
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "new"})
_MAMBA_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "conv"})


@dataclass(frozen=True)
class Layers:
    """Layers of one kind. ``width``: elements per KV head and token (K and V; MLA: the
    latent). ``window``: the sliding window, chunk or encoder tokens. ``state_bytes``: a
    state layer's bytes per sequence on one rank at TP 1."""

    kind: str
    count: int
    kv_heads: int = 0
    width: int = 0
    window: int = 0
    state_bytes: float = 0.0

    def token_bytes(self, tp: int, element: float) -> float:
        """One token of one layer on one rank."""
        return max(1, self.kv_heads // tp) * self.width * element


@dataclass(frozen=True)
class KvLayout:
    """What one sequence holds in the KV cache, and whether a sampler runs."""

    layers: tuple[Layers, ...]
    sampler: bool = True
    hybrid_allocator: bool = True
    block_size: int = DEFAULT_BLOCK
    in_flight: int = 8192  # tokens scheduled and not yet freed (VllmConfig.max_in_flight_tokens)
    state_blocks: int = 1
    share: float = 1.0  # the largest pipeline stage's share of the layers
    source: str = "config.json"

    @property
    def allocates(self) -> bool:
        """Whether vLLM allocates a KV cache at all (not for encoder-only models)."""
        return bool(self.layers)

    def _kinds(self) -> list[Layers]:
        """The layer types as vLLM's allocator sees them (the hybrid allocator off, or
        chunked-local layers beside full ones: the local layers cost full attention)."""
        full = any(group.kind == FULL for group in self.layers)
        promote = full and not self.hybrid_allocator
        return [
            replace(group, kind=FULL, window=0)
            if promote and group.kind in (SLIDING, CHUNKED)
            else group
            for group in self.layers
        ]

    def _groups(self) -> tuple[list[tuple[Layers, int]], int]:
        """Each type with the number of vLLM groups it fills, and the layers a group
        holds: one type is one group; with several, a group holds as many layers as the
        smallest type has (the largest, where it is under 1.5 times the smallest), and
        each type fills whole groups, the last one padded."""
        merged: dict[tuple[str, int, int, int], Layers] = {}
        for group in self._kinds():
            key = (group.kind, group.window, group.kv_heads, group.width)
            if key in merged:
                group = replace(group, count=merged[key].count + group.count)
            merged[key] = group
        kinds = [group for group in merged.values() if group.count]
        if len(kinds) <= 1:
            return [(group, 1) for group in kinds], (kinds[0].count if kinds else 0)
        counts = [group.count for group in kinds]
        size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
        return [(group, -(-group.count // size)) for group in kinds], size

    def block(self, tp: int, element: float) -> int:
        """Tokens a block holds: beside mamba layers, raised until an attention page
        holds a mamba state (platforms/interface.py:Platform._align_hybrid_block_size,
        aligned to the configured block size)."""
        states = [g.state_bytes / tp for g in self.layers if g.kind == STATE]
        tokens = [g.token_bytes(tp, element) for g in self.layers if g.kind != STATE]
        if not states or not tokens or not max(tokens):
            return self.block_size
        per_block = self.block_size * max(tokens)
        return self.block_size * max(1, -(-int(max(states)) // int(per_block)))

    def _page(self, group: Layers, tp: int, element: float) -> float:
        """One block of one layer on one rank (a mamba state padded to the attention
        page where there is one)."""
        attention = [g for g in self.layers if g.kind != STATE]
        if group.kind != STATE:
            return group.token_bytes(tp, element) * self.block(tp, element)
        if attention:
            return max(group.state_bytes / tp, self._page(attention[0], tp, element))
        return group.state_bytes / tp

    def _blocks(self, group: Layers, length: int, block: int) -> int:
        if group.kind == SLIDING:
            return -(-min(group.window - 1 + self.in_flight, length) // block) + 1
        if group.kind == CHUNKED:
            return -(-min(group.window + self.in_flight, length) // block)
        if group.kind == CROSS:
            return -(-group.window // block)
        if group.kind == STATE:
            return self.state_blocks
        return -(-length // block)

    def reserved(self, tp: int, element: float) -> float:
        """Bytes of one block of the pool: every group's share of it (the largest group's
        layers); the pool also keeps one back (BlockPool's null block)."""
        groups, size = self._groups()
        pages = [size * self._page(group, tp, element) for group, _ in groups]
        return max(pages, default=0.0) * self.share

    def per_token(self, tp: int, element: float) -> float:
        """Bytes a rank adds per token of a long sequence: the layers that keep every
        token (full attention, MLA)."""
        groups, _ = self._groups()
        full = sum(n for group, n in groups if group.kind == FULL)
        return self.reserved(tp, element) * full / self.block(tp, element)

    def sequence_bytes(self, length: int, tp: int, element: float) -> float:
        """Bytes one sequence of ``length`` tokens takes on a rank: the blocks each group
        needs, at the pool's bytes per block."""
        groups, _ = self._groups()
        block = self.block(tp, element)
        blocks = sum(n * self._blocks(group, length, block) for group, n in groups)
        return self.reserved(tp, element) * blocks

    def tokens_within(self, budget: float, tp: int, element: float, limit: int) -> int:
        """The longest sequence (at most ``limit``) the budget holds; 0 where none."""
        usable = budget - self.reserved(tp, element)
        if self.sequence_bytes(1, tp, element) > usable:
            return 0
        low, high = 1, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.sequence_bytes(mid, tp, element) <= usable:
                low = mid
            else:
                high = mid - 1
        return low


# Where no layout is read: one layer of one element a token, so that the element's bytes
# are the bytes a rank adds per token (``phases.Inputs.kv_per_token``, a range).
UNREAD = KvLayout((Layers(FULL, 1, kv_heads=1, width=1),), source="not read")


def per_token_high(params: float, element: float, tp: int) -> float:
    """The most a rank can add per token for a model of ``params`` parameters whose layout
    is not read: every layer full multi-head attention (2 x hidden elements a layer, split
    over the ranks), as deep as a model of this size is (12 hidden^2 parameters a layer, at
    least 16 times as wide as deep: GPT-2 is 64, SmolLM-135M 19). An assumption: the widest
    KV cache a decoder of this size has, 2 to 10 times a real grouped-query one."""
    hidden = (params / 0.75) ** (1 / 3)
    return 2 * (hidden / 16) * hidden * element / tp


def config_int(section: dict[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that holds a positive integer."""
    for key in keys:
        value = section.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def runner_of(config: dict[str, Any], directory: Path | None) -> str:
    """vLLM's ``--runner auto``: pooling for a sentence-transformers checkpoint
    (modules.json) or a pooling architecture name, else generate."""
    if directory is not None and (directory / "modules.json").is_file():
        return "pooling"
    for arch in config.get("architectures") or []:
        if str(arch).endswith(_GENERATE):
            return "generate"
        if str(arch).endswith(_POOL):
            return "pooling"
    return "generate"


def _layer_types(text: dict[str, Any], layers: int) -> list[str]:
    """Each layer's type, as transformers' configs derive it where config.json lists none
    (Gemma-3's sliding_window_pattern, Qwen3-Next's full_attention_interval)."""
    listed = text.get("layer_types")
    if isinstance(listed, list) and len(listed) == layers:
        return [str(kind) for kind in listed]
    pattern = config_int(text, "sliding_window_pattern")
    if pattern and text.get("sliding_window"):
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    interval = config_int(text, "full_attention_interval")
    if interval:
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    window = text.get("sliding_window") if text.get("use_sliding_window", True) else None
    return ["sliding_attention" if window else "full_attention"] * layers


def _gated_delta_net_bytes(text: dict[str, Any], element: float) -> float | None:
    """A Qwen3-Next linear-attention layer's state at TP 1: the convolution state and the
    recurrent state (mamba_utils.py:MambaStateShapeCalculator.gated_delta_net_state_shape)."""
    k_heads, v_heads = (
        config_int(text, "linear_num_key_heads"),
        config_int(text, "linear_num_value_heads"),
    )
    k_dim, v_dim = (
        config_int(text, "linear_key_head_dim"),
        config_int(text, "linear_value_head_dim"),
    )
    kernel = config_int(text, "linear_conv_kernel_dim")
    if not (k_heads and v_heads and k_dim and v_dim and kernel):
        return None
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1)
    return (conv + v_heads * v_dim * k_dim) * element


def from_config(
    config: dict[str, Any],
    *,
    element: float,
    state_element: float,
    batched_tokens: int,
    pp: int = 1,
    directory: Path | None = None,
) -> KvLayout | None:
    """The layout from config.json alone (no vLLM): the same rules as ``from_vllm``.
    None where the sizes are missing."""
    text = text_config(config)
    layers = config_int(text, "num_hidden_layers")
    heads = config_int(text, "num_attention_heads")
    if not layers or not heads:
        return None
    runner = runner_of(config, directory)
    common: dict[str, Any] = {"sampler": runner == "generate", "in_flight": batched_tokens * pp}
    encoder = text.get("model_type") in _ENCODERS or text.get("is_causal") is False
    if runner == "pooling" and encoder:
        return KvLayout((), **common)
    kv_heads = config_int(text, "num_key_value_heads", "n_head_kv", "num_kv_heads") or heads
    head = (
        config_int(text, "head_dim", "hidden_size_per_head")
        or (config_int(text, "hidden_size") or 0) // heads
    )
    rank = config_int(text, "kv_lora_rank")
    attention = (
        Layers(FULL, 0, kv_heads=1, width=rank + (config_int(text, "qk_rope_head_dim") or 0))
        if rank
        else Layers(FULL, 0, kv_heads=kv_heads, width=2 * head)
    )
    types = _layer_types(text, layers)
    window = config_int(text, "sliding_window") or 0
    chunk = config_int(text, "attention_chunk_size") or 0
    state = _gated_delta_net_bytes(text, state_element) or 0.0
    counts: dict[str, int] = {}
    for kind in types:
        counts[kind] = counts.get(kind, 0) + 1
    groups = []
    for kind, count in counts.items():
        if kind == "sliding_attention":
            groups.append(replace(attention, kind=SLIDING, count=count, window=window))
        elif kind == "chunked_attention":
            groups.append(replace(attention, kind=CHUNKED, count=count, window=chunk))
        elif kind in _MAMBA_TYPES:
            groups.append(Layers(STATE, count, state_bytes=state))
        else:
            groups.append(replace(attention, count=count))
    # vLLM turns the hybrid allocator off for chunked-local attention by default, and
    # keeps two mamba blocks a sequence ("align") where prefix caching is on.
    aligned = state and runner == "generate"
    return KvLayout(
        tuple(groups), hybrid_allocator=not chunk, state_blocks=2 if aligned else 1, **common
    )


def _state_bytes(vllm_config: Any) -> float:
    """A mamba / linear-attention layer's state at TP 1, from the model class's own
    shapes and dtypes (the ones vLLM's MambaSpec is built from), without building it."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model = vllm_config.model_config
    cls: Any = ModelRegistry.resolve_model_cls(model.architectures, model)[0]
    spec = MambaSpec(
        block_size=1,
        shapes=tuple(cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(cls.get_mamba_state_dtype_from_config(vllm_config)),
    )
    return float(spec.page_size_bytes * vllm_config.parallel_config.tensor_parallel_size)


def _stage_types(model: Any, parallel: Any) -> list[str]:
    """The first pipeline stage's layer types, as vLLM counts them."""
    start, end = model.get_layers_start_end_indices(parallel)
    listed = getattr(model.hf_text_config, "layer_types", None)
    if isinstance(listed, list) and len(listed) >= end:
        return [str(kind) for kind in listed[start:end]]
    layers = end - start
    if model.is_attention_free:
        return ["mamba"] * layers
    if model.is_hybrid:
        attention = model.get_num_layers_by_block_type(parallel, "attention")
        return ["full_attention"] * attention + ["mamba"] * (layers - attention)
    return ["full_attention"] * layers


def from_vllm(vllm_config: Any) -> KvLayout:
    """The layout from vLLM's resolved configuration (``EngineArgs.create_engine_config``):
    ``ModelConfig``'s runner, attention type, head size, KV heads and MLA, its layer types
    and sliding window, the scheduler's hybrid-allocator switch and tokens in flight, the
    cache's block size and mamba mode. The counts are of the first pipeline stage."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    common: dict[str, Any] = {
        "sampler": model.runner_type == "generate",
        "hybrid_allocator": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "block_size": int(cache.block_size or DEFAULT_BLOCK),
        "in_flight": int(vllm_config.max_in_flight_tokens),
        "state_blocks": 2 if cache.mamba_cache_mode == "align" else 1,
        "source": "vLLM's VllmConfig",
    }
    if model.attn_type == "encoder_only":
        return KvLayout((), **common)
    attention = (
        Layers(FULL, 0, kv_heads=1, width=model.get_head_size())
        if model.use_mla
        else Layers(
            FULL, 0, kv_heads=model.get_total_num_kv_heads(), width=2 * model.get_head_size()
        )
    )
    types = _stage_types(model, parallel)
    if cache.sliding_window and all(kind == "full_attention" for kind in types):
        types = ["sliding_attention"] * len(types)
    state = _state_bytes(vllm_config) if any(t in _MAMBA_TYPES for t in types) else 0.0
    groups = [
        replace(
            attention,
            kind=SLIDING,
            count=types.count("sliding_attention"),
            window=model.get_sliding_window() or 0,
        ),
        replace(
            attention,
            kind=CHUNKED,
            count=types.count("chunked_attention"),
            window=model.attention_chunk_size or 0,
        ),
        Layers(STATE, sum(t in _MAMBA_TYPES for t in types), state_bytes=state),
    ]
    groups.append(replace(attention, count=len(types) - sum(g.count for g in groups)))
    if model.is_encoder_decoder:
        encoder = int(vllm_config.scheduler_config.max_num_encoder_input_tokens)
        groups.append(replace(attention, kind=CROSS, count=len(types), window=encoder))
    return KvLayout(tuple(g for g in groups if g.count), **common)
