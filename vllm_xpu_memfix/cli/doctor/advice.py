"""The notes on what doctor could not see or had to assume (what to change is
``remedies``)."""

from __future__ import annotations

from typing import Any

from vllm_xpu_memfix.cli.doctor.facts import Measurement
from vllm_xpu_memfix.core.numbers import printable
from vllm_xpu_memfix.memory.checkpoint import Checkpoint, text_config
from vllm_xpu_memfix.startup.phases import Outcome, corner
from vllm_xpu_memfix.startup.sizing import ON_THE_FLY_QUANT, ServeArgs, largest_staged_params


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
        return [
            f"{section}: num_attention_heads {printable(repr(heads), 60)} is not a positive integer"
        ]
    notes = []
    if heads % tp:
        notes.append(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads "
            f"({section} num_attention_heads): vLLM refuses to start"
        )
    kv_heads = text.get("num_key_value_heads", heads)
    if type(kv_heads) is not int or kv_heads < 1:
        notes.append(
            f"{section}: num_key_value_heads {printable(repr(kv_heads), 60)} is not a positive "
            "integer"
        )
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


def notes_for(measured: Measurement, outcome: Outcome, args: ServeArgs) -> list[str]:
    notes = []
    if measured.room.problem and measured.described is None:
        notes.append(f"the host's room could not be read ({measured.room.problem}): not judged")
    ckpt = measured.ckpt
    if ckpt is not None:
        notes += _model_notes(ckpt, args)
    inputs = outcome.inputs
    if (
        ckpt is not None
        and inputs.device_bytes
        and corner(inputs, high=False).weights > inputs.utilization * inputs.device_bytes
    ):
        notes.append("the weights alone exceed the device memory at this utilisation")
    return notes
