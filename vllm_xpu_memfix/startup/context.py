"""The model's own context length, as vLLM 0.32.0 derives it, and its refusal of a longer
``--max-model-len``.

``vllm/transformers_utils/model_arch_config_convertor.py:derive_max_model_len_and_key``
takes the smallest of the config's length keys (``model_max_length`` wins where set);
``vllm/config/model.py:_get_and_verify_max_len`` multiplies it by the RoPE scaling factor
(not for su, longrope, llama3 and the YaRN types, whose length is already scaled, nor for
gemma3), uses it where ``--max-model-len`` is not given (or is -1), and refuses a longer
one unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is 1 or true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_xpu_memfix.memory.checkpoint import text_config

_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_SCALED = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def _length(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) and value > 0 else None


def model_max_len(config: dict[str, Any]) -> tuple[int, str] | None:
    """(the model's context, the key it comes from); None where the config gives none."""
    text = text_config(config)
    found = [(length, key) for key in _KEYS if (length := _length(text.get(key)))]
    if not found:
        return None
    length, key = min(found)
    if _length(text.get("model_max_length")):
        length, key = float(text["model_max_length"]), "model_max_length"
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(text.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        factor = _length(rope.get("factor"))
        if kind not in _SCALED and factor:
            length *= factor
    return int(length), key


def allows_long(environ: Mapping[str, str]) -> bool:
    return environ.get(ALLOW_LONG, "0").strip().lower() in ("1", "true")


def refusal(asked: int | None, config: dict[str, Any], environ: Mapping[str, str]) -> str:
    """vLLM's reason to refuse ``--max-model-len asked``; "" where it accepts it."""
    own = model_max_len(config)
    if asked is None or own is None or asked <= own[0] or allows_long(environ):
        return ""
    return (
        f"--max-model-len {asked} is above the model's {own[1]} {own[0]} and "
        f"{ALLOW_LONG} is not set (vllm/config/model.py:_get_and_verify_max_len)"
    )
