"""The 0.21 ``sym_int4`` layouts' per-layer steps, with the Q4_0 words made on the device
by :mod:`vllm_xpu_memfix.kernels`.

Each function leaves a layer in exactly the state the module's own step leaves it
(llm-scaler ``vllm/patches/vllm_for_multi_arc.patch``: ``_quantize_linear_int4_inplace``
and ``_quantize_moe_int4_side_inplace`` at tag ``vllm-0.21.0-b2``, the host-round-trip
layout, and at tag ``vllm-0.21.0-b1``, the inline-registration layout), handing the words
to the module's helpers where it has them, and never touches the host: no ``.cpu()``, no
fp32 copy, no C library. Both raise ``ValueError`` (inf or NaN in a weight, from the
kernel) before they change the layer, so the caller can fall back to the module's host
path.
"""

from __future__ import annotations

from typing import Any

SIDES = ("w13", "w2")


def _transpose_onednn_woq_format(module: Any) -> Any:
    """The module's own name for vllm-xpu-kernels' layout step, where it binds one."""
    found = getattr(module, "transpose_onednn_woq_format", None)
    if found is not None:
        return found
    from vllm_xpu_kernels.quantization._quantize_convert import transpose_onednn_woq_format

    return transpose_onednn_woq_format


def register_inline_layouts(layer: Any, qweight: Any, scale: Any) -> None:
    """What the b1 module's ``_quantize_linear_int4_inplace`` registers itself (it has no
    ``_register_linear_int4_layouts``): always the ESIMD views (``weight_esimd``, a uint8
    view of the words; ``scale_esimd``, the scales), and ``qweight``/``scales`` as
    contiguous copies of the transposes, so ``qweight`` does not share the words' storage."""
    import torch

    layer.weight_esimd = torch.nn.Parameter(qweight.view(torch.uint8), requires_grad=False)
    layer.scale_esimd = torch.nn.Parameter(scale, requires_grad=False)
    layer.qweight = torch.nn.Parameter(qweight.t().contiguous(), requires_grad=False)
    layer.scales = torch.nn.Parameter(scale.t().contiguous(), requires_grad=False)


def quantize_linear(module: Any, layer: Any, *, device: Any, register: Any = None) -> None:
    """``_quantize_linear_int4_inplace(layer)``: K zero-padded to the group, the original
    and padded widths recorded, the layouts registered (``register``, by default the
    module's ``_register_linear_int4_layouts``), a ``qzeros`` placeholder, no ``weight``,
    ``transpose_onednn_woq_format(layer, "gptq", True)``, and the processed flag. A
    legacy-load layer's BF16 is moved to ``device`` first."""
    import torch

    from vllm_xpu_memfix.kernels import quantize_q4_0

    register = register or module._register_linear_int4_layouts

    group = int(module.QK4_GROUP_SIZE)
    weight = layer.weight.data.to(device)
    n, k = weight.shape
    qweight, scale = quantize_q4_0(weight, group)
    padded = scale.shape[1] * group
    del weight
    layer._int4_in_features_orig, layer._int4_in_features_padded = k, padded
    register(layer, qweight, scale)
    zeros = torch.zeros((padded // group, n // 8), dtype=torch.int32, device=device)
    layer.qzeros = torch.nn.Parameter(zeros, requires_grad=False)
    layer.weight = None
    _transpose_onednn_woq_format(module)(layer, "gptq", True)
    layer._already_called_process_weights_after_loading = True


def _padded_expert(source: Any, expert: int, which: str, group: int) -> Any:
    """One expert's BF16 with the intermediate size zero-padded to the group, as the
    module pads the whole side: ``w2`` ``[H, I]`` on I; ``w13`` ``[2I, H]`` on each
    gate/up half's I. Padding is exact for act-and-mul MoE (zeros in, zeros out)."""
    import torch

    weight = source[expert]
    if which == "w2":
        return torch.nn.functional.pad(weight, (0, -weight.shape[1] % group))
    half = weight.shape[0] // 2
    pad = (0, 0, 0, -half % group)
    return torch.cat(
        [torch.nn.functional.pad(weight[i * half : (i + 1) * half], pad) for i in (0, 1)]
    )


def quantize_moe_side(
    module: Any, layer: Any, which: str, *, device: Any, as_bytes: bool = True
) -> None:
    """``_quantize_moe_int4_side_inplace(layer, which)``: the local experts
    (``layer.local_num_experts``, else all) quantized one at a time into zeroed
    ``[E, out, in/8]`` int32 words and ``[E, out, in/G]`` fp16 scales on ``device``,
    then ``<which>_weight`` cleared and the words stored under ``<which>_qweight`` (a
    uint8 view as b2 stores them, or the int32 words as b1 does: ``as_bytes=False``)
    with ``<which>_qscales``. A legacy-load side is moved to the device one expert at a
    time."""
    import torch

    from vllm_xpu_memfix.kernels import quantize_q4_0

    if which not in SIDES:
        raise ValueError(f"unknown MoE side {which!r}; expected one of {SIDES}")
    group = int(module.QK4_GROUP_SIZE)
    source = getattr(layer, f"{which}_weight").data
    if source.dim() != 3:
        raise ValueError(f"expected a 3-D {which}_weight, got {tuple(source.shape)}")
    experts = source.shape[0]
    first = _padded_expert(source, 0, which, group)
    out, k = first.shape
    qweight = torch.zeros(
        (experts, out, -(-k // group) * group // 8), dtype=torch.int32, device=device
    )
    scales = torch.zeros(
        (experts, out, qweight.shape[2] * 8 // group), dtype=torch.float16, device=device
    )
    for expert in range(int(getattr(layer, "local_num_experts", experts))):
        weight = first if expert == 0 else _padded_expert(source, expert, which, group)
        qweight[expert], scales[expert] = quantize_q4_0(weight.to(device), group)
    del first, source
    setattr(layer, f"{which}_weight", None)
    words = qweight.view(torch.uint8) if as_bytes else qweight
    setattr(layer, f"{which}_qweight", torch.nn.Parameter(words, requires_grad=False))
    setattr(layer, f"{which}_qscales", torch.nn.Parameter(scales, requires_grad=False))
