"""The test-only replay of Intel's sym_int4 (tests/plugins/sym_int4_replay), installed into
the test bed's vLLM by `make test`: each layout has the structure and leaves each layer in
the state the facts in its docstring describe, and its numbers are the Q4_0 reference's.

Each layout is chosen when the module is imported, so each runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")
MODULE = "vllm.model_executor.layers.quantization.sym_int4"

PROBE = textwrap.dedent(
    """
    import json, torch
    import vllm.model_executor.layers.quantization.sym_int4 as m
    from vllm_xpu_memfix.kernels import q4_0_reference

    names = sorted(n for n in ("_HAS_XPU_Q4_0", "_use_xpu_quant", "_xpu_q4_0_quantize",
                               "_register_linear_int4_layouts", "transpose_onednn_woq_format",
                               "ggml_quantize_tensor", "_quantize_linear_int4_inplace")
                   if hasattr(m, n))
    torch.manual_seed(0)
    n, k = 64, 200  # K not a multiple of the group
    if m.LAYOUT == "0.14":
        k = 256  # the 0.14 library needs whole groups and never pads
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k).to(torch.bfloat16), requires_grad=False)
    expected = q4_0_reference.quantize(layer.weight.data.float(), m.QK4_GROUP_SIZE)
    m._quantize_linear_int4_inplace(layer)
    state = {name: [str(t.dtype), list(t.shape), t.is_contiguous()]
             for name, t in layer.named_parameters()}
    if m.LAYOUT == "0.14":
        words, scales = layer.weight.t(), layer.weight_scale.t()
    else:
        words, scales = layer.qweight.t(), layer.scales.t()
    same = torch.equal(words, expected[0]) and torch.equal(
        scales.view(torch.int16), expected[1].view(torch.int16))
    x = torch.randn(3, k).to(torch.bfloat16)
    out = m.SymInt4LinearMethod().apply(layer, x)
    reference = x.float() @ q4_0_reference.dequantize(*expected, m.QK4_GROUP_SIZE)[:, :k].t()
    # bf16 output: within 1 % of the largest logit of the fp32 product
    close = bool((out.float() - reference).abs().max() <= 0.01 * reference.abs().max())
    storage = {name: t.untyped_storage().data_ptr() for name, t in layer.named_parameters()}
    aliased = "qweight" in storage and storage["qweight"] == storage.get("weight_esimd")
    print(json.dumps({"names": names, "state": state, "same": same, "close": close,
                      "qweight_aliases_weight_esimd": aliased,
                      "weight_is_none": layer.weight is None if m.LAYOUT != "0.14" else None,
                      "flag": getattr(layer, "_already_called_process_weights_after_loading", 0),
                      "uses_meta_device": m.SymInt4LinearMethod.uses_meta_device}))
    """
)


def probe(layout: str, **env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "SYM_INT4_REPLAY_LAYOUT": layout, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_014_layout_has_the_device_seam_and_keeps_esimd_and_transposed_views():
    found = probe("0.14")
    assert found["names"] == sorted(
        [
            "_HAS_XPU_Q4_0",
            "_use_xpu_quant",
            "_xpu_q4_0_quantize",
            "ggml_quantize_tensor",
            "_quantize_linear_int4_inplace",
        ]
    )
    state = found["state"]
    assert state["weight_esimd"] == ["torch.uint8", [64, 128], True]
    assert state["scale_esimd"] == ["torch.float16", [64, 2], True]
    assert state["weight"] == ["torch.int32", [32, 64], False]  # a transposed view
    assert state["weight_scale"] == ["torch.float16", [2, 64], False]
    assert found["same"] and found["close"] and found["flag"]
    assert found["uses_meta_device"] is False


@pytest.mark.parametrize("layout", ["0.21", "0.26"])
def test_the_021_layout_pads_k_and_leaves_qweight_scales_and_a_symmetric_zero(layout):
    found = probe(layout)
    assert found["names"] == sorted(
        [
            "_register_linear_int4_layouts",
            "transpose_onednn_woq_format",
            "ggml_quantize_tensor",
            "_quantize_linear_int4_inplace",
        ]
    )
    state = found["state"]
    # K 200 is padded to 256: two groups of 128.
    assert state["qweight"] == ["torch.int32", [32, 64], False]  # K-contiguous [Kp/8, N]
    assert state["scales"] == ["torch.float16", [2, 64], True]
    assert state["qzeros"] == ["torch.int8", [1], True]
    assert state["weight_esimd"] == ["torch.uint8", [64, 128], True]
    assert "weight" not in state and found["weight_is_none"]
    assert found["same"] and found["close"] and found["flag"]
    assert found["qweight_aliases_weight_esimd"] is True, "b2 keeps one copy of the words"
    assert found["uses_meta_device"] is (layout == "0.26")


def test_the_021_b1_layout_registers_inline_with_a_qweight_of_its_own():
    # DISABLE_ESIMD_INT4 set: b1 has no gate, so the ESIMD views stay all the same.
    found = probe("0.21-b1", DISABLE_ESIMD_INT4="1")
    assert found["names"] == sorted(
        ["transpose_onednn_woq_format", "ggml_quantize_tensor", "_quantize_linear_int4_inplace"]
    )
    state = found["state"]
    assert state["qweight"] == ["torch.int32", [32, 64], False]  # K-contiguous [Kp/8, N]
    assert state["scales"] == ["torch.float16", [2, 64], True]
    assert state["qzeros"] == ["torch.int8", [1], True]
    assert state["weight_esimd"] == ["torch.uint8", [64, 128], True]
    assert state["scale_esimd"] == ["torch.float16", [64, 2], True]
    assert found["qweight_aliases_weight_esimd"] is False, "a copy, as b1 made it"
    assert "weight" not in state and found["weight_is_none"]
    assert found["same"] and found["close"] and found["flag"]


def test_disable_esimd_int4_drops_the_esimd_views():
    found = probe("0.21", DISABLE_ESIMD_INT4="1")
    assert "weight_esimd" not in found["state"] and "qweight" in found["state"]


def test_an_unknown_layout_is_refused_with_the_accepted_values():
    result = subprocess.run(
        [sys.executable, "-c", f"import {MODULE}"],
        env={**os.environ, "SYM_INT4_REPLAY_LAYOUT": "0.99"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert (
        "SYM_INT4_REPLAY_LAYOUT='0.99'; accepted values: 0.14, 0.21, 0.21-b1, 0.26" in result.stderr
    )
