"""config.json's sizes and ``quantization_config.bits``, refused where they are no model's.

A size that is negative, not an integer (``"64"``, ``64.0``, ``true``) or beyond any real
model was dropped silently, and doctor sized the model without it (FITS where the clean
file ran out of memory). vLLM refuses such a file when it builds the model; doctor now
refuses it too, naming the field. ``bits``: vLLM 0.32 builds a GPTQ layer only for 4 or 8
bits (``model_executor/layers/quantization/auto_gptq.py``, ``TYPE_MAP``) and an AWQ layer
only for 4 (``auto_awq.py``, ``TYPE_MAP``), and raises ``ValueError`` for any other.
"""

from __future__ import annotations

from typing import Any

# Sizes a model needs at least one of; the expert counts and MoE widths may be 0 (dense).
POSITIVE = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
NON_NEGATIVE = ("num_experts", "num_local_experts", "moe_intermediate_size", "n_routed_experts")
# Beyond int32, where vLLM and torch keep sizes and indices: no model is that large.
LARGEST = 2**31 - 1
BITS = {
    **dict.fromkeys(("gptq", "auto_gptq", "gptq_marlin"), (4, 8)),
    **dict.fromkeys(("awq", "auto_awq", "awq_marlin"), (4,)),
}


def _size_problem(where: str, key: str, value: Any, least: int) -> str | None:
    if value is None:
        return None
    if type(value) is not int or not least <= value <= LARGEST:
        return (
            f"{where}{key} {value!r} is not valid; accepted: an integer from {least} to {LARGEST:,}"
        )
    return None


def problem(config: dict[str, Any]) -> str | None:
    """Why ``config`` (config.json as read) is no model's, in one line naming the field;
    None where its sizes and bits are valid."""
    sections = [("", config)]
    text = config.get("text_config")
    if isinstance(text, dict):
        sections.append(("text_config.", text))
    for where, section in sections:
        for keys, least in ((POSITIVE, 1), (NON_NEGATIVE, 0)):
            for key in keys:
                if key in section:
                    found = _size_problem(where, key, section[key], least)
                    if found:
                        return found
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict):
        method = str(quantization.get("quant_method", "")).lower()
        bits = quantization.get("bits", quantization.get("w_bit"))
        if (
            method in BITS
            and bits is not None
            and (type(bits) is not int or bits not in BITS[method])
        ):
            accepted = " or ".join(map(str, BITS[method]))
            return (
                f"quantization_config.bits {bits!r} is not valid for {method}; "
                f"vLLM builds {accepted}-bit layers only"
            )
    return None
