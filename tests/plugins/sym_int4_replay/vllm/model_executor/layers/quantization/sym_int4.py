"""Test-only replay of Intel llm-scaler's on-the-fly ``sym_int4`` for vLLM's CPU build.

Written for this project from what Intel's published patches do (names, signatures,
order of operations, the state each layer is left in), not copied from them. Sources
read: ``vllm/patches/vllm_for_multi_arc.patch`` in github.com/intel/llm-scaler at tags
``vllm-0.14.0-b8.3.2`` (the 0.14 layout), ``vllm-0.21.0-b2`` (the 0.21 layout) and
``vllm-0.21.0-b1`` (the 0.21-b1 layout; the same patch file is on branch
``codex/vllm-0.26-dev-image``).
The 0.26 images' module is not public; the 0.26 layout here is the 0.21 module driven
by vLLM's own layerwise processing, as llm-scaler #697's traceback shows
(``base_loader.load_model`` -> ``finalize_layerwise_processing``).

``SYM_INT4_REPLAY_LAYOUT`` (read at import) picks the layout:

``0.14``
    the device seam (``_HAS_XPU_Q4_0``, ``_use_xpu_quant``, ``_xpu_q4_0_quantize``; the
    ESIMD package is never installed here); no K padding; the layer keeps
    ``weight_esimd``/``scale_esimd`` and transposed ``weight``/``weight_scale`` views.
``0.21``
    no seam; K zero-padded to a group multiple; ``_register_linear_int4_layouts`` and
    ``transpose_onednn_woq_format`` leave ``qweight``/``scales``/``qzeros``.
``0.21-b1``
    as 0.21, but without ``_register_linear_int4_layouts``: the layer function registers
    the ESIMD views always and ``qweight``/``scales`` as copies of the transposes (so
    ``qweight`` has storage of its own), and an MoE side keeps its words as int32.
``0.26`` (default)
    the 0.21 functions, with weights created on meta and quantized layer by layer by
    vLLM's layerwise processing (``uses_meta_device``).

In the 0.14 and 0.21(-b1) layouts ``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT=1`` (which Intel's
Dockerfiles set) selects the legacy load: every quantized layer's BF16 weight is
allocated on the CPU, all weights are loaded, and only then ``process_weights_after_loading``
quantizes layer by layer. Otherwise the weight starts on meta and a wrapping loader
quantizes each layer as soon as all its elements arrived (streaming).

Every layer is quantized through the host: an fp32 copy (K zero-padded in 0.21/0.26),
then ``ggml_quantize_tensor``, whose "C library" here is vllm_xpu_memfix's Q4_0 torch
reference (held to Intel's real library by tests/data/q4_0_golden).
``SYM_INT4_REPLAY_ROUNDING=product-first`` makes that stand-in round the other way
(``x * id`` rounded before adding 8.5, as GGML's C reads without contraction), to
show what device_quant does with a library it does not match; ``fused`` (default)
rounds as Intel's build does. XPU-only calls are stood in by name:
``_xpu_q4_0_quantize`` (the ESIMD op) raises, ``transpose_onednn_woq_format``
(vllm-xpu-kernels) is a local function with the same effect on the layer, and
``apply`` dequantizes instead of calling the int4 GEMM.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter

from vllm_xpu_memfix.kernels import q4_0_reference

LAYOUTS = ("0.14", "0.21", "0.21-b1", "0.26")
LAYOUT = os.environ.get("SYM_INT4_REPLAY_LAYOUT", "0.26")
if LAYOUT not in LAYOUTS:
    raise ValueError(f"SYM_INT4_REPLAY_LAYOUT={LAYOUT!r}; accepted values: {', '.join(LAYOUTS)}")

ROUNDINGS = ("fused", "product-first")
ROUNDING = os.environ.get("SYM_INT4_REPLAY_ROUNDING", "fused")
if ROUNDING not in ROUNDINGS:
    raise ValueError(
        f"SYM_INT4_REPLAY_ROUNDING={ROUNDING!r}; accepted values: {', '.join(ROUNDINGS)}"
    )

QK4_PACK_FACTOR = 8
QK4_GROUP_SIZE = 128 if LAYOUT == "0.14" else int(os.environ.get("VLLM_INT4_GROUP_SIZE", "128"))


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def _legacy_load() -> bool:
    return LAYOUT != "0.26" and os.environ.get("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT", "0") == "1"


def ggml_quantize_tensor(
    weight: torch.Tensor,
    out_qweight: torch.Tensor,
    out_scale: torch.Tensor,
    out_features: int,
    in_features: int,
    block_size: int = QK4_GROUP_SIZE,
    transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C library's entry point: fp32 [N, K] into int32 [N, K/8] and fp16 [N, K/block]."""
    assert weight.dtype == torch.float32 and tuple(weight.shape) == (out_features, in_features)
    assert in_features % block_size == 0, "the library writes ceil(K/block) groups"
    if ROUNDING == "fused":
        qweight, scale = q4_0_reference.quantize(weight, block_size)
    else:
        x, d = q4_0_reference.groups(weight, block_size)
        qweight = q4_0_reference.pack(x * q4_0_reference.inverse_of(d) + 8.5)
        scale = d.squeeze(-1).to(torch.float16)
    out_qweight.copy_(qweight)
    out_scale.copy_(scale)
    if transpose:
        return out_qweight.t().contiguous(), out_scale.t().contiguous()
    return out_qweight, out_scale


if LAYOUT == "0.14":
    _HAS_XPU_Q4_0 = False  # custom_esimd_kernels_vllm.q4_0_quant_ops is never installed here

    def _use_xpu_quant() -> bool:
        return _HAS_XPU_Q4_0 and os.environ.get("VLLM_INT4_DISABLE_XPU_QUANT", "0") != "1"

    def _xpu_q4_0_quantize(bf16_xpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("custom_esimd_kernels_vllm (the ESIMD Q4_0 op) is not installed")

    def _quantize_linear_int4_inplace(layer: torch.nn.Module) -> None:
        weight = layer.weight.data
        device = weight.device
        if device.type == "xpu" and _use_xpu_quant():
            qweight, scale = _xpu_q4_0_quantize(weight)
        else:  # the host round trip: fp32 copy, zeroed outputs, the library
            staging = weight.to("cpu").float()
            n, k = staging.shape
            qweight = torch.zeros((n, k // QK4_PACK_FACTOR), dtype=torch.int32)
            scale = torch.zeros((n, k // QK4_GROUP_SIZE), dtype=torch.float16)
            ggml_quantize_tensor(staging, qweight, scale, n, k, QK4_GROUP_SIZE, transpose=False)
            del staging
        del weight
        layer.weight = None
        qweight, scale = qweight.to(device), scale.to(device)
        layer.weight_esimd = _frozen(qweight.view(torch.uint8))
        layer.scale_esimd = _frozen(scale)
        layer.weight = _frozen(qweight.t())
        layer.weight_scale = _frozen(scale.t())
        layer._already_called_process_weights_after_loading = True

    def _dequantized(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return q4_0_reference.dequantize(
            layer.weight.t(), layer.weight_scale.t(), QK4_GROUP_SIZE, dtype
        )

    def _quantize_moe_int4_side_inplace(layer: torch.nn.Module, which: str) -> None:
        """One side (``w13`` or ``w2``) of every local expert; experts in a thread pool."""
        source = getattr(layer, f"{which}_weight").data
        device = source.device
        experts, out, k = source.shape
        host = source.cpu().contiguous() if device.type != "cpu" else source
        qweight = torch.zeros((experts, out, k // QK4_PACK_FACTOR), dtype=torch.int32)
        scales = torch.zeros((experts, out, k // QK4_GROUP_SIZE), dtype=torch.float16)

        def one(e: int) -> None:
            ggml_quantize_tensor(
                host[e].float(), qweight[e], scales[e], out, k, QK4_GROUP_SIZE, transpose=False
            )

        with ThreadPoolExecutor() as pool:
            list(pool.map(one, range(experts)))
        del host, source
        setattr(layer, f"{which}_weight", _frozen(qweight.to(device)))
        setattr(layer, f"{which}_scales", _frozen(scales.to(device)))

else:
    if LAYOUT != "0.21-b1":

        def _register_linear_int4_layouts(
            layer: torch.nn.Module, qweight: torch.Tensor, scale: torch.Tensor
        ) -> None:
            if os.environ.get("DISABLE_ESIMD_INT4", "0") != "1":
                layer.weight_esimd = _frozen(qweight.view(torch.uint8))
                layer.scale_esimd = _frozen(scale)
            layer.qweight = _frozen(qweight.t())
            layer.scales = _frozen(scale.t().contiguous())

    def transpose_onednn_woq_format(layer: torch.nn.Module, method: str, is_sym: bool) -> None:
        """Stand-in for vllm-xpu-kernels' function of this name: K-contiguous qweight,
        contiguous scales, and a one-element symmetric zero point."""
        assert method == "gptq" and is_sym
        layer.qweight.data = layer.qweight.data.t().contiguous().t()
        layer.scales.data = layer.scales.data.contiguous()
        layer.qzeros = _frozen(torch.tensor([8], dtype=torch.int8, device=layer.qweight.device))

    def _quantize_linear_int4_inplace(layer: torch.nn.Module) -> None:
        weight = layer.weight.data
        device = weight.device
        n, k = weight.shape
        padded = -(-k // QK4_GROUP_SIZE) * QK4_GROUP_SIZE
        if padded != k:
            weight = torch.nn.functional.pad(weight, (0, padded - k))
        layer._int4_in_features_orig, layer._int4_in_features_padded = k, padded
        staging = weight.to("cpu").float()  # the host round trip: fp32 copy, the library
        del weight
        qweight = torch.zeros((n, padded // QK4_PACK_FACTOR), dtype=torch.int32)
        scale = torch.zeros((n, padded // QK4_GROUP_SIZE), dtype=torch.float16)
        ggml_quantize_tensor(staging, qweight, scale, n, padded, QK4_GROUP_SIZE, transpose=False)
        del staging
        qweight, scale = qweight.to(device), scale.to(device)
        if LAYOUT == "0.21-b1":  # no helper: the layouts are registered here, all of them
            layer.weight_esimd = _frozen(qweight.view(torch.uint8))
            layer.scale_esimd = _frozen(scale)
            layer.qweight = _frozen(qweight.t().contiguous())
            layer.scales = _frozen(scale.t().contiguous())
        else:
            _register_linear_int4_layouts(layer, qweight, scale)
        zeros_shape = (padded // QK4_GROUP_SIZE, n // QK4_PACK_FACTOR)
        layer.qzeros = _frozen(torch.zeros(zeros_shape, dtype=torch.int32, device=device))
        layer.weight = None
        transpose_onednn_woq_format(layer, "gptq", True)
        layer._already_called_process_weights_after_loading = True

    def _dequantized(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        full = q4_0_reference.dequantize(layer.qweight.t(), layer.scales.t(), QK4_GROUP_SIZE, dtype)
        return full[:, : layer._int4_in_features_orig]

    # Two functions, as in Intel's two modules: device_quant tells them apart by whether
    # the side function refers to uint8 (llm-scaler tags vllm-0.21.0-b1 and -b2).
    if LAYOUT == "0.21-b1":

        def _quantize_moe_int4_side_inplace(layer: torch.nn.Module, which: str) -> None:
            """One side (``w13`` or ``w2``) of the local experts (``local_num_experts``;
            the other experts' words stay zero), one expert after another, with the
            intermediate size zero-padded to a group multiple. The int32 words are stored
            as they are (b1)."""
            source = getattr(layer, f"{which}_weight").data
            device = source.device
            group = QK4_GROUP_SIZE
            if which == "w2":
                source = torch.nn.functional.pad(source, (0, -source.shape[-1] % group))
            else:
                gate, up = source.chunk(2, dim=1)
                pad = (0, 0, 0, -gate.shape[1] % group)
                halves = [torch.nn.functional.pad(h, pad) for h in (gate, up)]
                source = torch.cat(halves, dim=1)
            host = source.cpu()
            del source
            experts, out, k = host.shape
            qweight = torch.zeros((experts, out, k // QK4_PACK_FACTOR), dtype=torch.int32)
            scales = torch.zeros((experts, out, k // group), dtype=torch.float16)
            for e in range(getattr(layer, "local_num_experts", experts)):
                ggml_quantize_tensor(
                    host[e].float(), qweight[e], scales[e], out, k, group, transpose=False
                )
            del host
            setattr(layer, f"{which}_weight", None)
            setattr(layer, f"{which}_qweight", _frozen(qweight.to(device)))
            setattr(layer, f"{which}_qscales", _frozen(scales.to(device)))

    else:

        def _quantize_moe_int4_side_inplace(layer: torch.nn.Module, which: str) -> None:
            """One side (``w13`` or ``w2``) of the local experts (``local_num_experts``;
            the other experts' words stay zero), one expert after another, with the
            intermediate size zero-padded to a group multiple. The words are stored as a
            uint8 view (b2)."""
            source = getattr(layer, f"{which}_weight").data
            device = source.device
            group = QK4_GROUP_SIZE
            if which == "w2":
                source = torch.nn.functional.pad(source, (0, -source.shape[-1] % group))
            else:
                gate, up = source.chunk(2, dim=1)
                pad = (0, 0, 0, -gate.shape[1] % group)
                halves = [torch.nn.functional.pad(h, pad) for h in (gate, up)]
                source = torch.cat(halves, dim=1)
            host = source.cpu()
            del source
            experts, out, k = host.shape
            qweight = torch.zeros((experts, out, k // QK4_PACK_FACTOR), dtype=torch.int32)
            scales = torch.zeros((experts, out, k // group), dtype=torch.float16)
            for e in range(getattr(layer, "local_num_experts", experts)):
                ggml_quantize_tensor(
                    host[e].float(), qweight[e], scales[e], out, k, group, transpose=False
                )
            del host
            setattr(layer, f"{which}_weight", None)
            qbytes = qweight.to(device).view(torch.uint8)
            setattr(layer, f"{which}_qweight", _frozen(qbytes))
            setattr(layer, f"{which}_qscales", _frozen(scales.to(device)))


class _CopiedElements(TorchDispatchMode):
    """Counts the elements a weight loader copies, as the streaming loader does."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def _streaming_loader(layer: torch.nn.Module, original: Any) -> Any:
    """Materialise the weight on the first shard; quantize when every element arrived."""

    def weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any) -> None:
        if layer.weight.is_meta:
            materialised = ModelWeightParameter(
                data=torch.empty_like(layer.weight, device=layer._load_device),
                input_dim=1,
                output_dim=0,
                weight_loader=original,
            )
            layer.register_parameter("weight", materialised)
        counter = _CopiedElements()
        with counter:
            original(layer.weight, loaded_weight, *args)
        layer._int4_loaded_numel += counter.numel
        if layer._int4_loaded_numel >= layer.weight.numel():
            _quantize_linear_int4_inplace(layer)

    return weight_loader


class SymInt4LinearMethod(LinearMethodBase):
    """Linear layers: BF16 in, Q4_0 words and fp16 scales out, quantized on the host."""

    uses_meta_device = LAYOUT == "0.26"  # vLLM's layerwise processing drives the load

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        n = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        legacy = _legacy_load()
        device = "cpu" if legacy else "meta"
        loader = extra_weight_attrs.get("weight_loader")
        layer._load_device = torch.get_default_device()
        layer._int4_loaded_numel = 0
        weight = ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=params_dtype, device=device),
            input_dim=1,
            output_dim=0,
            weight_loader=loader if legacy or LAYOUT == "0.26" else None,
        )
        layer.register_parameter("weight", weight)
        if LAYOUT == "0.26":
            from vllm.model_executor.model_loader.reload.layerwise import (
                initialize_online_processing,
            )

            initialize_online_processing(layer)
        elif not legacy:
            weight.weight_loader = _streaming_loader(layer, loader)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        if layer.weight is None or layer.weight.is_meta:
            if LAYOUT == "0.26":
                raise RuntimeError(
                    "sym_int4 requires a complete checkpoint load before runtime quantization"
                )
            # A layer the checkpoint never filled (a tied head, say) gets zeros.
            layer.weight = _frozen(torch.zeros_like(layer.weight, device=layer._load_device))
        _quantize_linear_int4_inplace(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.nn.functional.linear(x, _dequantized(layer, x.dtype), bias)


class SymInt4Config(QuantizationConfig):
    """``--quantization sym_int4``: every linear layer on the fly, the rest unquantized."""

    @classmethod
    def get_name(cls) -> str:
        return "sym_int4"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SymInt4Config:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        return SymInt4LinearMethod() if isinstance(layer, LinearBase) else None
