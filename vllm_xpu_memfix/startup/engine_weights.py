"""The weights of an engine's checkpoint, as the preflight sizes them before any is read.

From the checkpoint's headers where they can be had: its directory, else the Hugging Face
cache where the weights are already downloaded, else the Hub by range request within the
caller's deadline. ``vllm serve ORG/MODEL`` fetches config.json into the cache before the
preflight runs and the weights only after, so a cached config.json without weights is no
reason to stop at hf_config. Where no header can be had, the parameters are estimated
from hf_config, and a quantized config's width is a range (:func:`widen_unread`), never
16-bit taken for certain. The config is always the engine's own ``hf_config``.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_xpu_memfix.core.log import get_logger
from vllm_xpu_memfix.memory.checkpoint import Checkpoint
from vllm_xpu_memfix.startup import formats, phases, sizing
from vllm_xpu_memfix.startup.known import Known, Source

logger = get_logger("preflight")
FROM_HF_CONFIG = "hf_config"
UNREAD = "its headers not read (sized from hf_config)"
SETTLE = "let the preflight reach the Hub (HF_ENDPOINT, HF_HUB_OFFLINE), or download first"


def checkpoint(vllm_config: Any, hub_deadline: float) -> tuple[Checkpoint | None, str]:
    """The checkpoint's metadata and where it came from: its directory or the cache's
    snapshot where it holds safetensors, else the Hub's headers, else hf_config."""
    from vllm_xpu_memfix.memory import hub, hub_cache
    from vllm_xpu_memfix.memory.checkpoint import CheckpointError, read_checkpoint

    name = str(vllm_config.model_config.model)
    hf = vllm_config.model_config.hf_config.to_dict()
    local = Path(name).is_dir()
    directory = Path(name)
    if not local and hub_cache.looks_like_repo_id(name):
        with contextlib.suppress(hub_cache.HubCacheError):
            directory = hub_cache.find_cached(name).snapshot
    if directory.is_dir() and any(directory.glob("*.safetensors")):
        return replace(read_checkpoint(directory, None, name=name), config=hf), str(directory)
    if not local:
        try:
            found = hub.read(name, hub_deadline)
            return replace(found, config={**found.config, **hf}), "the Hub's headers"
        except (hub.HubUnavailable, CheckpointError) as exc:
            logger.debug("vllm-xpu-memfix preflight: the Hub's metadata not read: %s", exc)
    params = sizing.params_from_config(hf)
    if params is None:
        return None, f"{FROM_HF_CONFIG} (weights not sized)"
    sized = f"{params:,} parameters from hf_config"
    return Checkpoint(None, (), (), hf, params * 2, sized), FROM_HF_CONFIG


def widen_unread(inputs: phases.Inputs, ckpt: Checkpoint | None, source: str) -> phases.Inputs:
    """Where the weights were sized from hf_config and it names a quantization, the bytes
    per weight run from the method's own width (every weight quantized) to 16-bit (none):
    which modules stay 16-bit is in the headers, not in hf_config."""
    fmt = formats.from_config(sizing.quantization_config(ckpt))
    if source != FROM_HF_CONFIG or fmt is None:
        return inputs
    low = fmt.bytes_per_weight or formats.NARROWEST
    width = Known.between(low, formats.WIDEST, Source.ASSUMED, f"{fmt.method}, {UNREAD}", SETTLE)
    return replace(inputs, linear_bytes_per_weight=width)
