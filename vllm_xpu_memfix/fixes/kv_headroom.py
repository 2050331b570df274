"""KV headroom: keep device memory free for the logits and sampler warm-up after KV sizing.

Problem
    vLLM sizes the KV cache from a profile run, allocates it, and only then, in
    ``Worker.compile_or_warm_up_model``, runs ``_dummy_sampler_run`` for
    ``B = min(max_num_seqs, max_num_batched_tokens)`` requests: the lm_head,
    the logits ``all_gather`` (B x padded vocab x dtype) and the sampler,
    whose PyTorch fallback sorts the whole vocabulary. In llm-scaler #703 (4 x
    B70, TP 4, vocab 248,320, B 256) a worker died there: "XPU out of memory.
    Tried to allocate 122.00 MiB", the gathered fp16 logits, while torch still
    reported 2.56 GiB free. The user's way out, utilisation 0.92 -> 0.85, gave
    up 2.2 GiB of KV cache per GPU. What failed is not established: Intel's
    engineer got past the warm-up with the same image and arguments, and a
    host-side cause (the driver's pinned host copy) is not shown either: #703
    names no driver version (docs/fixes.md).
Mechanism
    ``profile_run`` already runs the same sampler pass with the same B, so its
    torch peak is part of the transient memory vLLM keeps out of the KV cache;
    re-reserving the whole burst (0.84 GiB per rank for #703 on the Triton
    path, 2.26 GiB on the sort path) would count it twice. What the profile
    cannot see is memory outside torch's allocator that appears after it
    (Level Zero modules of the kernel warm-up, oneCCL's buffers), which XPU's
    free-memory figure misses (pytorch #161381, vLLM #47134). So after
    ``determine_available_memory`` the fix subtracts a reserve of the burst's
    one large block that has to be new, contiguous memory, the gathered logits
    (``memory.estimate``), plus ``VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB`` for
    that outside growth. ``available_kv_cache_memory_bytes`` is lowered to
    match. The reserve depends only on the configuration, and the "too big"
    check uses the smallest available figure of all ranks, so every rank
    decides alike. A user-set ``--kv-cache-memory-bytes`` is never changed;
    the fix only warns when the burst will not fit beside it. On a device OOM
    in the warm-up it logs the ``--kv-cache-memory-bytes`` that leaves the
    failed allocation plus the reserve free.
Targets
    ``vllm.v1.worker.gpu_worker:Worker.determine_available_memory`` and
    ``vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model`` (XPUWorker
    inherits both);
    ``vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory``, which
    overrides it, so that ``on`` can be exercised end to end on the CPU build.
Switch
    ``VLLM_XPU_MEMFIX_KV_HEADROOM`` (auto: the reserve on the XPU platform only,
    the OOM hint everywhere; on: the reserve on every platform);
    ``VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB``.
Upstream
    Fold the post-KV burst into ``determine_available_memory`` (or run the
    sampler warm-up before the KV cache is allocated); see
    docs/design/kv-headroom.md.
Remove when
    ``gpu_worker`` accounts for the post-KV sampler burst before sizing the KV
    cache (it mentions ``sampler_headroom``, the name the withdrawn patch 0003 used;
    docs/upstream/rfc-0003-xpu-kv-cache-after-warm-up.md proposes the lasting fix).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.causes import SAMPLER_BURST
from vllm_xpu_memfix.core.config import Mode, Settings
from vllm_xpu_memfix.core.log import get_logger, see
from vllm_xpu_memfix.core.patching import Patch, Patcher, RemoveWhen
from vllm_xpu_memfix.core.units import GiB, MiB
from vllm_xpu_memfix.vllm_code.overrides import with_platform_overrides

if TYPE_CHECKING:  # imported where used: registration must stay cheap
    from vllm_xpu_memfix.memory.estimate import BurstEstimate, BurstShape, TopKTopP

logger = get_logger("kv_headroom")

FIX = config.KV_HEADROOM
REMOVE_WHEN = RemoveWhen(
    "the worker keeps the sampler burst out of the KV cache itself (upstream RFC 0003)",
    "vllm.v1.worker.gpu_worker",
    ("sampler_headroom",),
)
_SIZING = "_xpu_memfix_sizing_kv"


class KVHeadroomError(RuntimeError):
    """The reserve does not fit in the memory vLLM found for the KV cache."""


class Reserve:
    """The burst estimate and the slack; the reserve is its gathered logits plus the slack."""

    def __init__(self, estimate: BurstEstimate, slack: int) -> None:
        self.estimate = estimate
        self.slack = slack

    @property
    def gathered_logits(self) -> int:
        return self.estimate.gathered_logits

    @property
    def total(self) -> int:
        from vllm_xpu_memfix.startup.reserve import kv_reserve

        return kv_reserve(self.estimate, self.slack)

    def describe(self) -> str:
        s = self.estimate.shape
        return (
            f"reserve {self.total / MiB:,.1f} MiB = gathered logits "
            f"{self.gathered_logits / MiB:,.1f} (B={s.num_reqs} x vocab {s.padded_vocab:,}"
            f" x {s.logits_dtype_bytes} B) + slack {self.slack / MiB:,.0f} MiB"
        )


def topk_topp_path() -> TopKTopP:
    """Which top-k/top-p implementation the installed vLLM runs."""
    from vllm.v1.sample.ops import topk_topp_sampler

    triton = getattr(topk_topp_sampler, "HAS_TRITON", False)
    return "triton" if triton and hasattr(topk_topp_sampler, "apply_top_k_top_p_triton") else "sort"


def burst_shape(vllm_config: Any) -> BurstShape:
    """The burst's shape from a ``VllmConfig`` (the worker's or a test's)."""
    from vllm_xpu_memfix.memory.estimate import BurstShape, dtype_bytes

    model = vllm_config.model_config
    scheduler = vllm_config.scheduler_config
    return BurstShape(
        num_reqs=min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens),
        vocab_size=model.get_vocab_size(),
        logits_dtype_bytes=dtype_bytes(getattr(model, "head_dtype", model.dtype)),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        hidden_size=model.get_hidden_size(),
        topk_topp=topk_topp_path(),
    )


def reserve_for(vllm_config: Any, settings: Settings) -> Reserve:
    from vllm_xpu_memfix.memory.estimate import estimate_sampler_burst

    return Reserve(
        estimate_sampler_burst(burst_shape(vllm_config)),
        slack=settings.kv_headroom_slack_mib * MiB,
    )


def reserve_applies(settings: Settings, vllm_config: Any) -> tuple[bool, str]:
    if getattr(vllm_config.model_config, "runner_type", "generate") == "pooling":
        return False, "pooling model: no sampler warm-up"
    if settings.mode(FIX) is Mode.ON:
        return True, f"{FIX.env}=on"
    from vllm.platforms import current_platform

    if current_platform.is_xpu():
        return True, "XPU platform"
    return False, f"platform {type(current_platform).__name__} is not XPU ({FIX.env}=on forces it)"


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks, over vLLM's CPU world group; ``value`` alone."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return value
    from vllm.distributed.parallel_state import get_world_group

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=get_world_group().cpu_group)
    return int(tensor.item())


def _too_big(reserve: Reserve, lowest: int) -> KVHeadroomError:
    shape = reserve.estimate.shape
    return KVHeadroomError(
        f"vllm-xpu-memfix: the device headroom for the post-KV sampler warm-up "
        f"({reserve.total / MiB:,.0f} MiB: gathered logits of {shape.num_reqs} requests x "
        f"{shape.padded_vocab:,} tokens {reserve.gathered_logits / MiB:,.0f} MiB + slack "
        f"{reserve.slack / MiB:,.0f} MiB) does not fit in the {lowest / MiB:,.0f} MiB left for "
        f"the KV cache. Lower --max-num-seqs, raise --gpu-memory-utilization, or set "
        f"--kv-cache-memory-bytes; {FIX.env}=off skips the reserve."
    )


def _check_user_kv_size(instance: Any, reserve: Reserve, kv_bytes: int) -> None:
    """With a user-set KV size nothing reserves the burst; warn if it will not fit."""
    free_at_start = getattr(getattr(instance, "init_snapshot", None), "free_memory", None)
    weights = getattr(getattr(instance, "model_runner", None), "model_memory_usage", None)
    if free_at_start is None or weights is None:
        return
    left = int(free_at_start) - int(weights) - kv_bytes
    need = reserve.estimate.peak + reserve.slack
    if left < need:
        logger.warning(
            "vllm-xpu-memfix: --kv-cache-memory-bytes=%d leaves %.0f MiB of device memory; the "
            "post-KV sampler warm-up needs about %.0f MiB. Lower --kv-cache-memory-bytes to %d "
            "or below. See %s",
            kv_bytes,
            left / MiB,
            need / MiB,
            max(kv_bytes - (need - left), 0),
            see(SAMPLER_BURST),
        )
        logger.debug(
            "vllm-xpu-memfix: KV headroom: %.0f MiB free at start - %.0f weights - KV; the "
            "warm-up's %s, slack %.0f MiB",
            free_at_start / MiB,
            weights / MiB,
            reserve.estimate.breakdown(),
            reserve.slack / MiB,
        )


def reserve_headroom(
    settings: Settings, wrapped: Any, instance: Any, args: Any, kwargs: Any
) -> Any:
    """``determine_available_memory`` with the reserve taken out of its result."""
    if getattr(instance, _SIZING, False):
        return wrapped(*args, **kwargs)
    # Read before the call: vLLM's start-up plan (VLLM_ENABLE_STARTUP_PLAN, 0.26+) sets
    # kv_cache_memory_bytes inside determine_available_memory on a second boot, which is
    # vLLM's own figure, not the user's.
    user_kv = getattr(getattr(instance, "cache_config", None), "kv_cache_memory_bytes", None)
    setattr(instance, _SIZING, True)  # a subclass calling super() must not reserve twice
    try:
        available = wrapped(*args, **kwargs)
    finally:
        setattr(instance, _SIZING, False)
    try:
        applies, why = reserve_applies(settings, instance.vllm_config)
        if not applies:
            logger.debug("vllm-xpu-memfix: KV headroom not reserved: %s", why)
            return available
        reserve = reserve_for(instance.vllm_config, settings)
    except Exception as exc:
        logger.warning("vllm-xpu-memfix: KV headroom skipped: %s: %s", type(exc).__name__, exc)
        return available

    if user_kv:
        _check_user_kv_size(instance, reserve, int(user_kv))
        return available
    lowest = min_over_ranks(int(available))
    if reserve.total >= lowest:
        raise _too_big(reserve, lowest)
    if hasattr(instance, "available_kv_cache_memory_bytes"):
        instance.available_kv_cache_memory_bytes -= reserve.total
    after = int(available) - reserve.total
    rank = getattr(instance, "rank", "?")
    logger.info(
        "vllm-xpu-memfix: rank %s KV headroom (%s): KV cache %.2f -> %.2f GiB (%.2f%% given "
        "up) for the sampler warm-up: %s. See %s",
        rank,
        why,
        available / GiB,
        after / GiB,
        100 * reserve.total / available,
        reserve.describe(),
        see(SAMPLER_BURST),
    )
    logger.debug(
        "vllm-xpu-memfix: rank %s KV headroom: whole burst %s", rank, reserve.estimate.breakdown()
    )
    return after


_TRIED = re.compile(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024 * GiB}
_OOM_MARKERS = ("out of memory", "OUT_OF_DEVICE_MEMORY", "OUT_OF_HOST_MEMORY")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def device_oom(exc: BaseException) -> tuple[bool, int | None]:
    """Whether ``exc`` (or what it wraps) is a device OOM, and the failed allocation's size.

    Matches ``torch.OutOfMemoryError``, vLLM's wrapped "CUDA out of memory occurred when
    warming up sampler" and the Level Zero / UR out-of-memory results.
    """
    is_oom, tried = False, None
    for link in _chain(exc):
        text = str(link)
        if type(link).__name__ == "OutOfMemoryError" or any(m in text for m in _OOM_MARKERS):
            is_oom = True
        if tried is None and (match := _TRIED.search(text)):
            tried = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    return is_oom, tried


def oom_hint(instance: Any, reserve: Reserve, tried: int | None) -> str:
    kv_now = instance.cache_config.kv_cache_memory_bytes or getattr(
        instance, "available_kv_cache_memory_bytes", 0
    )
    shortfall = tried if tried is not None else reserve.gathered_logits
    source = "the failed allocation" if tried is not None else "the gathered logits (estimated)"
    suggested = max(int(kv_now) - shortfall - reserve.total, 0)
    return (
        f"vllm-xpu-memfix: device OOM in the post-KV warm-up. Restart with "
        f"--kv-cache-memory-bytes={suggested} ({suggested / GiB:.2f} GiB = KV cache "
        f"{kv_now / GiB:.2f} GiB - {source} {shortfall / MiB:,.0f} MiB - reserve "
        f"{reserve.total / MiB:,.1f} MiB), or lower --max-num-seqs "
        f"({reserve.estimate.shape.num_reqs} requests are warmed up). See {see(SAMPLER_BURST)}"
    )


def hint_on_oom(settings: Settings, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``compile_or_warm_up_model`` that logs the KV size that would fit on a device OOM."""
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        is_oom, tried = device_oom(exc)
        if is_oom:
            try:
                reserve = reserve_for(instance.vllm_config, settings)
                logger.error("%s", oom_hint(instance, reserve, tried))
                logger.debug("vllm-xpu-memfix: the reserve: %s", reserve.describe())
            except Exception as hint_exc:
                logger.warning("vllm-xpu-memfix: no OOM hint: %r", hint_exc)
        raise


_GPU = "vllm.v1.worker.gpu_worker:Worker"


def patches(settings: Settings) -> tuple[Patch, ...]:
    reserve = functools.partial(reserve_headroom, settings)
    hint = functools.partial(hint_on_oom, settings)
    return (
        Patch(FIX.key, f"{_GPU}.determine_available_memory", reserve),
        Patch(FIX.key, f"{_GPU}.compile_or_warm_up_model", hint),
        Patch(FIX.key, "vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory", reserve),
    )


def install(patcher: Patcher, settings: Settings) -> None:
    patcher.install_all(with_platform_overrides(patches(settings)))
