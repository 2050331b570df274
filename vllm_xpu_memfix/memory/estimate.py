"""Device bytes of the logits + sampler burst that vLLM runs after sizing the KV cache.

Pure arithmetic: no torch, no vLLM. Every term below is read from vLLM 0.32's
code path ``Worker.compile_or_warm_up_model`` -> ``GPUModelRunner._dummy_sampler_run``
with ``B = min(max_num_seqs, max_num_batched_tokens)`` requests. The burst is a
sequence of stages; the peak is the stage with the most bytes alive at once, so
the estimate reports every stage and the terms alive at the peak.

Sizes are rounded up to 512 bytes, the block size of PyTorch's caching allocators
(CUDA's and XPU's): that is the size ``memory_allocated()`` counts. The sort's
scratch comes from PyTorch's CUDA ``launch_stable_sort_kernel`` (SortStable.cu),
the one part not in vLLM's code; XPU's SYCL sort is assumed to need no more.

One constant is fitted rather than read: a block that reuses a cached block is
not split when less than 1 MiB would remain, so it can count up to 1 MiB more
than asked. Counting the full 1 MiB per block doubled small bursts; the H200 data
(docs/design/kv-headroom.md) is covered by ``ALLOCATOR_SLACK`` of each block above 1 MiB,
at most 1 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_xpu_memfix.core.units import MiB, figure, size

ALLOCATOR_BLOCK = 512
# vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_VOCAB_PADDING = 64
# Per-request vectors alive at the peak, counted in _dummy_sampler_run and Sampler:
# six dummy_tensors (temperature, top_p, top_k, three penalties), the first call's
# sampled ids, greedy_sample's argmax, apply_temperature's torch.where, the top-k/top-p
# casts of k and p, and random_sample's argmax.
PER_REQUEST_VECTORS = 12
ALLOCATOR_SLACK = 0.3
# PyTorch's stable sort hands a single segment, or rows of a million or more, to
# one radix sort per row; fewer than 128 rows to a full sort of (value, row) pairs.
LARGE_SEGMENT = 1_000_000
FULL_SORT_BELOW_ROWS = 128
CUB_SCRATCH = 64 * 1024

TopKTopP = Literal["sort", "triton"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def _block(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


def pad_vocab(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING) -> int:
    """``vocab_parallel_embedding.pad_vocab_size``: ParallelLMHead's row count."""
    return -(-vocab_size // pad_to) * pad_to


def dtype_bytes(dtype: object) -> int:
    """Element size of a torch dtype or its name (``torch.bfloat16``, ``"float16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(
            f"unsupported logits dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}"
        )
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class BurstShape:
    """What the burst depends on. ``num_reqs`` is B; ``vocab_size`` the model's own."""

    num_reqs: int
    vocab_size: int
    logits_dtype_bytes: int = 2
    tp_size: int = 1
    hidden_size: int = 0
    topk_topp: TopKTopP = "sort"
    vocab_padding: int = DEFAULT_VOCAB_PADDING

    def __post_init__(self) -> None:
        for name in ("num_reqs", "vocab_size", "logits_dtype_bytes", "tp_size", "vocab_padding"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if pad_vocab(self.vocab_size, self.vocab_padding) % self.tp_size:
            raise ValueError(
                f"padded vocab {pad_vocab(self.vocab_size, self.vocab_padding)} is not "
                f"divisible by tp_size {self.tp_size}"
            )

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size, self.vocab_padding)


@dataclass(frozen=True)
class Term:
    name: str
    nbytes: int
    source: str


@dataclass(frozen=True)
class Stage:
    name: str
    terms: tuple[Term, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.terms)

    def with_allocator_slack(self) -> Stage:
        slack = sum(min(MiB, int(t.nbytes * ALLOCATOR_SLACK)) for t in self.terms if t.nbytes > MiB)
        term = Term("allocator rounding", slack, "caching allocator: unsplit reused blocks")
        return Stage(self.name, (*self.terms, term))


@dataclass(frozen=True)
class BurstEstimate:
    shape: BurstShape
    stages: tuple[Stage, ...]

    @property
    def peak_stage(self) -> Stage:
        return max(self.stages, key=lambda s: s.nbytes)

    @property
    def peak(self) -> int:
        return self.peak_stage.nbytes

    def term(self, name: str) -> Term:
        for stage in self.stages:
            for term in stage.terms:
                if term.name == name:
                    return term
        raise KeyError(name)

    @property
    def gathered_logits(self) -> int:
        """Full-vocabulary logits of B requests: all_gather's output, or the lm_head's at TP 1."""
        return self.term("gathered logits" if self.shape.tp_size > 1 else "lm_head logits").nbytes

    def peak_parts(self) -> str:
        """``torch.sort (per-request vectors 0.12, ..., allocator rounding 7 MiB)``."""
        stage = self.peak_stage
        parts = ", ".join(f"{t.name} {figure(t.nbytes / MiB, 0)}" for t in stage.terms if t.nbytes)
        return f"{stage.name} ({parts} MiB)"

    def breakdown(self) -> str:
        return f"peak {size(self.peak, MiB)} at {self.peak_parts()}"


def estimate_sampler_burst(shape: BurstShape) -> BurstEstimate:
    """The stages of ``_dummy_sampler_run`` and the bytes alive in each."""
    b, v, vp, d = shape.num_reqs, shape.vocab_size, shape.padded_vocab, shape.logits_dtype_bytes
    bv = b * v

    small = Term(
        "per-request vectors",
        PER_REQUEST_VECTORS * _block(b * 8),
        "_dummy_sampler_run dummy_tensors; Sampler.sample",
    )
    hidden = Term(
        "hidden copy",
        _block(b * shape.hidden_size * d),
        "_dummy_sampler_run: torch.rand_like(hidden_states)",
    )
    shard = Term(
        "lm_head logits",
        _block(b * vp // shape.tp_size * d),
        "LogitsProcessor._apply_head: this rank's vocab shard",
    )
    stages = []
    if shape.tp_size > 1:
        gathered = Term(
            "gathered logits",
            _block(b * vp * d),
            "DeviceCommunicatorBase.all_gather: output_tensor",
        )
        reordered = Term(
            "gather reorder copy",
            _block(b * vp * d),
            "DeviceCommunicatorBase.all_gather: movedim + reshape copies",
        )
        stages.append(Stage("all_gather", (small, hidden, shard, gathered, reordered)))
        logits = Term("gathered logits", gathered.nbytes, gathered.source)
    else:
        stages.append(Stage("lm_head", (small, hidden, shard)))
        logits = shard

    fp32 = Term("fp32 logits", _block(bv * 4), "Sampler.forward: logits.to(torch.float32)")
    if shape.topk_topp == "sort":
        values = Term("sorted values", _block(bv * 4), "apply_top_k_top_p_pytorch: logits.sort")
        indices = Term("sort indices", _block(bv * 8), "apply_top_k_top_p_pytorch: int64 indices")
        stages.append(
            Stage("torch.sort", (small, hidden, logits, fp32, values, indices, *sort_scratch(b, v)))
        )
        # Once the sort returns: the top-k and top-p masks and the sorted softmax.
        stages.append(
            Stage(
                "top-k/top-p masks",
                (
                    small,
                    hidden,
                    logits,
                    fp32,
                    values,
                    indices,
                    Term("top-k mask", _block(bv), "apply_top_k_top_p_pytorch: logits_sort < kth"),
                    Term("sorted softmax", _block(bv * 4), "apply_top_k_top_p_pytorch: softmax"),
                    Term("top-p mask", _block(bv), "apply_top_k_top_p_pytorch: probs_sum <= 1-p"),
                ),
            )
        )
    # "triton": apply_top_k_top_p_triton works in place; its per-device buffer is
    # cached from the profile run, so it is not new memory after the KV cache.
    # XPU's fused sampler kernel (first warm-up call) allocates less than the
    # generator-seeded second call, which always takes forward_native below.
    stages.append(
        Stage(
            "random sample",
            (
                small,
                hidden,
                logits,
                fp32,
                Term("probs", _block(bv * 4), "TopKTopPSampler.forward_native: softmax"),
                Term("exponential noise", _block(bv * 4), "random_sample: empty_like(probs)"),
            ),
        )
    )
    return BurstEstimate(shape, tuple(stage.with_allocator_slack() for stage in stages))


def sort_scratch(rows: int, vocab: int) -> tuple[Term, ...]:
    """What ``torch.sort`` of fp32 ``[rows, vocab]`` allocates besides its outputs."""
    n = rows * vocab
    source = "PyTorch SortStable.cu launch_stable_sort_kernel"
    if rows == 1 or vocab >= LARGE_SEGMENT:  # segmented_sort_large_segments
        return (
            Term("sort row indices", _block(vocab * 8), source),
            Term("radix sort buffers", _block(vocab * 12) + CUB_SCRATCH, source),
        )
    if rows < FULL_SORT_BELOW_ROWS:  # segmented_sort_pairs_by_full_sort
        return (
            Term("sort (index, row) pairs", 2 * _block(n * 8), source),
            Term("sorted keys", _block(n * 4), source),
            Term("radix sort buffers", _block(n * 12) + CUB_SCRATCH, source),
        )
    return (  # segmented_sort_pairs
        Term("sort row indices", _block(n * 8), source),
        Term("radix sort buffers", _block(n * 12) + CUB_SCRATCH, source),
    )
