"""A checkpoint's weight format, from its own ``quantization_config`` (or a GGUF header,
or ``-q``): the device bytes per linear weight element, whether the weights are converted
while loading, and whether the XPU platform of the vLLM release judged for serves the format
at all (as recorded per release: ``vllm_code.releases``).

The methods are those of vLLM 0.32.0's quantization registry
(``vllm/model_executor/layers/quantization/__init__.py``, ``QuantizationMethods``), plus
``bitsandbytes`` and ``gguf`` (older vLLM), and Intel's ``sym_int4`` family (llm-scaler
images). A method this table cannot size is not sized: the device is then not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.vllm_code import releases

INTEL_INT4 = frozenset({"sym_int4", "int4", "woq_int4"})
# The method vLLM resolves a checkpoint's to where the release has no method of that name:
# "auto-round" is INC's from 0.21.0 on (INCConfig.override_quantization_method in
# vllm/model_executor/layers/quantization/inc.py, 0.21.0; inc/inc.py, 0.32.0).
RESOLVED = {"auto-round": "inc"}
XPU_SOURCE = "vllm/platforms/xpu.py XPUPlatform.supported_quantization"

# Methods that quantize 16-bit weights while loading (given with -q on a 16-bit checkpoint):
# device bytes per weight element.
ON_THE_FLY = {
    "fp8": 1.0,
    "fp8_per_tensor": 1.0,
    "fp8_per_block": 1.0,
    "fp8_per_channel": 1.0,
    "int8_per_channel_weight_only": 1.0,
    "mxfp8": 1.0 + 1 / 32,  # 8-bit values and one 8-bit scale per 32
    "nvfp4_per_token": 0.5 + 1 / 16,  # 4-bit values and one FP8 scale per 16
    **dict.fromkeys(INTEL_INT4, catalog.ONE_LAYOUT),
}
# Fixed-width formats of a checkpoint quantized ahead of time, by method.
_FIXED = {
    "fp8": 1.0,
    "fbgemm_fp8": 1.0,
    "deepseek_v4_fp8": 1.0,
    "experts_int8": 1.0,
    "mxfp4": 0.5 + 1 / 32,  # 4.25 bits: 4-bit values, one E8M0 scale per 32
    "gpt_oss_mxfp4": 0.5 + 1 / 32,
    "mxfp8": 1.0 + 1 / 32,
    "modelopt_fp4": 0.5 + 1 / 16,
    "modelopt_mxfp8": 1.0 + 1 / 32,
    "w8a8": 1.0,
    "int8": 1.0,
}
_INT_GROUPED = {"awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin", "inc"}
_INT_GROUPED |= {"moe_wna16", "int4", "w4a16", "auto-round"}
_MODELOPT = {"FP8": 1.0, "NVFP4": 0.5 + 1 / 16, "MXFP8": 1.0 + 1 / 32}


@dataclass(frozen=True)
class Format:
    """``method`` "" for 16-bit weights; ``bytes_per_weight`` None: not sized."""

    method: str
    bytes_per_weight: float | None
    prequantized: bool
    source: str = ""

    @property
    def on_the_fly(self) -> bool:
        return bool(self.method) and not self.prequantized

    @property
    def xpu_refusal(self) -> str:
        """The XPU platform's reason to refuse the format in the vLLM release judged for
        (``releases.judged``); "" where it serves it, or where the release is not recorded
        (then whether it serves it is assumed, never a refusal)."""
        release = releases.judged()
        served = releases.xpu_quantization(release)
        if not self.method or served is None or self.method in served | INTEL_INT4:
            return ""
        if RESOLVED.get(self.method) in served:
            return ""
        return (
            f"{self.method} quantization is currently not supported in xpu (vLLM "
            f"{release} {XPU_SOURCE}; Platform.verify_quantization)"
        )


def _number(section: Any, *keys: str) -> int | None:
    if not isinstance(section, dict):
        return None
    for key in keys:
        value = section.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _grouped(bits: int, group: int | None) -> float:
    """Packed integer weights with a 16-bit scale (and a packed zero) per group."""
    per_group = (2 + bits / 8) / group if group else 0.0
    return bits / 8 + per_group


NARROWEST = _grouped(4, 128)
GPTQ_WIDTHS = (NARROWEST, _grouped(8, 128))


def _compressed_tensors(config: dict[str, Any]) -> float | None:
    """The widest weight scheme of ``config_groups`` (num_bits, group_size)."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    widths = []
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        bits = _number(weights, "num_bits")
        if bits is None:
            return None
        widths.append(_grouped(bits, _number(weights, "group_size")) if bits < 8 else bits / 8)
    return max(widths)


def _quark(config: dict[str, Any]) -> float | None:
    glob = config.get("global_quant_config")
    weight = glob.get("weight") if isinstance(glob, dict) else None
    dtype = str(weight.get("dtype", "")) if isinstance(weight, dict) else ""
    if dtype.startswith("fp8"):
        return 1.0
    if dtype in ("int4", "uint4"):
        return _grouped(4, _number(weight, "group_size"))
    if dtype.startswith("fp4"):
        return 0.5 + 1 / 32
    return None


def _bitsandbytes(config: dict[str, Any]) -> float:
    if config.get("load_in_8bit"):
        return 1.0
    return 0.5 + 4 / 64  # 4-bit NF4/FP4 with an fp32 absmax per block of 64


# The narrowest weights vLLM loads for a line whose format is not known (4-bit, grouped at
# 128: AWQ/GPTQ/int4) and the widest (16-bit). GPTQ's widths are 4 and 8 bits
# (vllm/model_executor/layers/quantization/auto_gptq.py, 0.32.0: TYPE_MAP).
WIDEST = 2.0


def prequantized_bytes(method: str, config: dict[str, Any]) -> float | None:
    """Device bytes per linear weight element of a checkpoint quantized with ``method``,
    from its ``quantization_config``; None where the table cannot size it."""
    if method in _FIXED:
        return _FIXED[method]
    if method in _INT_GROUPED:
        bits = _number(config, "bits", "w_bit", "weight_bits") or 4
        return _grouped(bits, _number(config, "group_size", "q_group_size") or 128)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method in ("modelopt", "modelopt_mixed"):
        nested = config.get("quantization")
        algo = config.get("quant_algo") or (
            nested.get("quant_algo") if isinstance(nested, dict) else None
        )
        return _MODELOPT.get(str(algo).upper())
    if method == "quark":
        return _quark(config)
    if method == "bitsandbytes":
        return _bitsandbytes(config)
    return None


GPTQ = frozenset({"gptq", "auto_gptq", "gptq_marlin"})


def widths(method: str) -> tuple[float, float]:
    """The bytes per weight a checkpoint of ``method`` can have where its config was not
    read: GPTQ's 4 or 8 bits, AWQ's 4 (auto_awq.py TYPE_MAP, 0.32.0), in groups of 32 to
    128; any other method from 4-bit to 16-bit."""
    if method in GPTQ:
        return _grouped(4, 128), _grouped(8, 32)
    if method in _INT_GROUPED:
        return _grouped(4, 128), _grouped(4, 32)
    return NARROWEST, WIDEST


def from_config(config: dict[str, Any] | None) -> Format | None:
    """The checkpoint's own format, where its config names one."""
    if not isinstance(config, dict) or not isinstance(config.get("quant_method"), str):
        return None
    method = config["quant_method"].lower()
    if method == "gguf":
        return Format(method, None, True, "the GGUF file's header")
    return Format(method, prequantized_bytes(method, config), True, "config.json")


def given(method: str) -> Format:
    """A method given with ``-q`` on a 16-bit checkpoint: converted while loading."""
    return Format(method, ON_THE_FLY.get(method), False, "-q")


def label(fmt: Format, quant: dict[str, Any] | None) -> str:
    """The format as doctor names it: the method, with what its config says of the weights
    (``gguf Q4_K_M``, ``awq 4-bit, group 128``, ``compressed-tensors float 8-bit``)."""
    if not fmt.method:
        return "none (weights as stored)"
    if not fmt.prequantized:
        return f"{fmt.method} (-q, converted while loading)"
    quant = quant or {}
    if fmt.method == "gguf":
        kind = quant.get("file_type")
        return f"gguf {kind}" if isinstance(kind, str) else "gguf"
    if fmt.method in _INT_GROUPED:
        bits = _number(quant, "bits", "w_bit", "weight_bits")
        group = _number(quant, "group_size", "q_group_size")
        parts = [f"{bits}-bit" if bits else "", f"group {group}" if group else ""]
        detail = ", ".join(p for p in parts if p)
        return f"{fmt.method} {detail}".strip()
    if fmt.method == "compressed-tensors":
        groups = quant.get("config_groups")
        schemes = sorted(
            {
                f"{w.get('type', '')} {w.get('num_bits')}-bit".strip()
                for g in (groups.values() if isinstance(groups, dict) else ())
                if isinstance(g, dict) and isinstance(w := g.get("weights"), dict)
            }
        )
        return " ".join([fmt.method, ", ".join(schemes)]).strip()
    return fmt.method
