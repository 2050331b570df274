"""What to do about the estimate: the changes that would make the serve command fit, best
first, and the notes on what doctor could not see or had to assume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_xpu_memfix.cli.doctor.facts import OFFLOAD, Measurement, ServeArgs
from vllm_xpu_memfix.cli.doctor.predict import (
    AT_RISK_SHARE,
    ON_THE_FLY_QUANT,
    Estimate,
    device_weight_bytes,
    largest_staged_params,
)
from vllm_xpu_memfix.cli.doctor.render import gib
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config


def _mirror_changes(measured: Measurement, estimate: Estimate, args: ServeArgs) -> list[str]:
    """How to be rid of the driver mirror, or to make room for it."""
    mirror = estimate.causes["driver mirror"]
    saved = f"removes the driver mirror (-{gib(mirror)})"
    if measured.guard.user_set:
        changes = [
            f"unset {' '.join(measured.guard.user_set)}: the plugin then sets "
            f"NEOReadDebugKeys=1 EnableDeferBacking=0, which {saved}"
        ]
    else:
        changes = [
            "let the plugin set NEOReadDebugKeys=1 EnableDeferBacking=0 "
            f"({driver_env.FIX.env}=auto or on), which {saved}"
        ]
    others = estimate.need - mirror
    device_bytes, room = measured.device_bytes, estimate.room
    if device_bytes and room > others:
        fit_util = (AT_RISK_SHARE * room - others) / (args.tensor_parallel_size * device_bytes)
        if 0 < fit_util < args.gpu_memory_utilization:
            changes.append(
                f"or keep the mirror and lower --gpu-memory-utilization to {fit_util:.2f}"
            )
    return changes


def advise(
    measured: Measurement, estimate: Estimate, args: ServeArgs, environ: Mapping[str, str]
) -> list[str]:
    """The changes to the serve command or the host that would make it fit, best first."""
    changes = _mirror_changes(measured, estimate, args) if estimate.mirror_active else []
    staging = estimate.per_rank["quantization_staging"]
    fits = estimate.verdict == "fits"
    tp = args.tensor_parallel_size
    if measured.legacy[0] and staging:
        changes.append(f"unset {OFFLOAD}: it keeps each rank's 16-bit shard on the host")
    if staging and not fits and tp > 1 and not measured.load_slots:
        saved = (tp - 1) * staging
        changes.append(
            f"pass --max-parallel-loading-workers 1 (the plugin's load lock makes vLLM honour "
            f"it): one rank stages at a time (-{gib(saved)})"
        )
    if staging and not fits:
        changes.append(
            "serve a checkpoint quantized ahead of time: no weights are converted on the host"
        )
    if "cgroup_room" in estimate.total and not fits:
        changes.append(
            "raise the container's memory limit (docker run --memory): the room is what it leaves"
        )
    if not fits and not changes:
        changes.append("add host RAM, or serve on fewer GPUs per host")
    return changes


def head_notes(config: dict[str, Any], tp: int) -> list[str]:
    """Where the tensor-parallel size does not divide the attention heads, vLLM refuses
    to start (ModelConfig.verify_with_parallel_config; QKVParallelLinear for KV heads,
    which may instead be replicated when TP is a multiple of them)."""
    text = text_config(config)
    section = "text_config" if text is not config else "config.json"
    heads = text.get("num_attention_heads")
    if heads is None:
        return []
    if type(heads) is not int or heads < 1:
        return [f"{section}: num_attention_heads {heads!r} is not a positive integer"]
    notes = []
    if heads % tp:
        notes.append(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads "
            f"({section} num_attention_heads): vLLM refuses to start"
        )
    kv_heads = text.get("num_key_value_heads", heads)
    if type(kv_heads) is not int or kv_heads < 1:
        notes.append(f"{section}: num_key_value_heads {kv_heads!r} is not a positive integer")
    elif kv_heads % tp and tp % kv_heads:
        notes.append(
            f"--tensor-parallel-size {tp} and the {kv_heads} KV heads ({section} "
            "num_key_value_heads) divide neither way: vLLM refuses to start"
        )
    return notes


def _model_notes(ckpt: Checkpoint, args: ServeArgs) -> list[str]:
    """What doctor could not see or refused in the model, and what it assumed instead."""
    notes = [f"could not see {what}" for what in ckpt.unseen]
    notes += [f"refused {what}" for what in ckpt.refused]
    if not ckpt.complete:
        notes.append(f"the checkpoint's size comes from {ckpt.declared_from}, not its headers")
    elif args.params is not None:
        notes.append(f"--params {args.params:,} ignored: the safetensors headers give the size")
    if not ckpt.tensors and (args.quantization or "").lower() in ON_THE_FLY_QUANT:
        notes.append(
            f"no tensor header read: the staged unit is {largest_staged_params(ckpt)[1]}, and "
            "every 16-bit weight is taken for a linear layer"
        )
    return notes + head_notes(ckpt.config, args.tensor_parallel_size)


def notes_for(measured: Measurement, estimate: Estimate, args: ServeArgs) -> list[str]:
    tp = args.tensor_parallel_size
    notes = []
    if measured.room.problem:
        notes.append(f"the host's room could not be read ({measured.room.problem}): taken as 0")
    if len(measured.visible) < tp and measured.gpus:
        notes.append(
            f"--tensor-parallel-size {tp} but only {len(measured.visible)} Intel GPU(s) are visible"
        )
    ckpt = measured.ckpt
    if ckpt is not None:
        notes += _model_notes(ckpt, args)
    if (
        ckpt is not None
        and measured.device_bytes
        and device_weight_bytes(ckpt, args) / tp > estimate.per_rank["device_use"]
    ):
        notes.append("the weights alone exceed the device memory at this utilisation")
    return notes
