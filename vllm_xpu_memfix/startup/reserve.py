"""The device memory kv_headroom keeps out of the KV cache: the gathered logits of the
post-KV sampler warm-up (new, contiguous memory: ``memory.estimate``) plus the slack of
``VLLM_XPU_MEMFIX_KV_HEADROOM_SLACK_MIB``. The fix reserves it and the start-up model
counts it, from this one definition."""

from __future__ import annotations

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.units import MiB
from vllm_xpu_memfix.memory.estimate import BurstEstimate

DEFAULT_SLACK = int(config.variable_for("kv_headroom_slack_mib").default) * MiB


def kv_reserve(burst: BurstEstimate, slack_bytes: float) -> int:
    """Bytes per rank kept out of the KV cache."""
    return int(burst.gathered_logits + slack_bytes)
