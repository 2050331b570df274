"""device_quant against a stand-in for Intel's sym_int4 module.

No Intel image is reachable here, so the module is built in the test from the
public names of llm-scaler's sym_int4 (``_use_xpu_quant``, ``_xpu_q4_0_quantize``,
``ggml_quantize_tensor``, ``_quantize_linear_int4_inplace``, ``QK4_GROUP_SIZE``,
``_HAS_XPU_Q4_0``). The torch reference plays the C library. There is no GPU, so
``check_device`` is pointed at the CPU, where ``vllm_xpu_memfix.kernels`` runs the
reference; the stand-in's layer function therefore asks ``_use_xpu_quant()``
without the real module's ``device.type == "xpu"`` test.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from vllm_xpu_memfix.core import config  # noqa: E402
from vllm_xpu_memfix.core.patching import Patcher  # noqa: E402
from vllm_xpu_memfix.fixes import device_quant  # noqa: E402
from vllm_xpu_memfix.intel.int4_self_check import probes  # noqa: E402
from vllm_xpu_memfix.kernels import q4_0_reference  # noqa: E402

SELF_CHECK_CALLS = len(probes(128))


def stand_in_module(library=None, esimd: bool = False) -> types.ModuleType:
    module = types.ModuleType(device_quant.MODULE)
    module.QK4_GROUP_SIZE = 128
    module._HAS_XPU_Q4_0 = esimd
    module.library_calls = 0
    module.esimd_calls = 0

    def ggml_quantize_tensor(
        weight, out_qweight, out_scale, out_features, in_features, block_size=128, transpose=True
    ):
        module.library_calls += 1
        q, s = (library or q4_0_reference.quantize)(weight, block_size)
        out_qweight.copy_(q)
        out_scale.copy_(s)
        return out_qweight, out_scale

    def _use_xpu_quant():
        return module._HAS_XPU_Q4_0

    def _xpu_q4_0_quantize(bf16_xpu):
        module.esimd_calls += 1
        return q4_0_reference.quantize(bf16_xpu, 128)

    def _quantize_linear_int4_inplace(layer):
        bf16 = layer.weight.data
        n, k = bf16.shape
        if module._use_xpu_quant():
            qweight, scale = module._xpu_q4_0_quantize(bf16)
        else:  # the host round trip: fp32 copy, library, back
            qweight = torch.zeros((n, k // 8), dtype=torch.int32)
            scale = torch.zeros((n, k // 128), dtype=torch.float16)
            qweight, scale = module.ggml_quantize_tensor(
                bf16.cpu().float().contiguous(), qweight, scale, n, k, 128, transpose=False
            )
        layer.weight = torch.nn.Parameter(qweight, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

    module.ggml_quantize_tensor = ggml_quantize_tensor
    module._use_xpu_quant = _use_xpu_quant
    module._xpu_q4_0_quantize = _xpu_q4_0_quantize
    module._quantize_linear_int4_inplace = _quantize_linear_int4_inplace
    return module


@pytest.fixture
def install(monkeypatch, tmp_path):
    patcher = Patcher()
    monkeypatch.setattr(device_quant, "check_device", lambda: torch.device("cpu"))

    def make(module: types.ModuleType) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, device_quant.MODULE, module)
        device_quant.install(patcher, config.load({"VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path)}))
        return module

    yield make
    patcher.revert_all()


def decision_lines(caplog) -> list[str]:
    """The decision lines, once each; the layout line comes before them."""
    messages = [r.getMessage() for r in caplog.records]
    assert sum("sym_int4 layout: 0.14-based" in m for m in messages) == 1
    return [m for m in messages if "quantizes on the device" in m or "keeps its host path" in m]


def layers(count: int = 3) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16) for _ in range(count)]


def host_results(module_layers: list[torch.nn.Linear]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [q4_0_reference.quantize(layer.weight.data.float(), 128) for layer in module_layers]


def test_matching_library_routes_every_layer_to_the_kernel(install, caplog):
    module = install(stand_in_module())
    model = layers()
    expected = host_results(model)
    with caplog.at_level(logging.INFO):
        for layer in model:
            module._quantize_linear_int4_inplace(layer)
    assert module.library_calls == SELF_CHECK_CALLS  # no layer took the host path
    for layer, (q, s) in zip(model, expected, strict=True):
        assert torch.equal(layer.weight.data, q)
        assert torch.equal(layer.weight_scale.data.view(torch.int16), s.view(torch.int16))
    lines = decision_lines(caplog)
    assert len(lines) == 1 and "quantizes on the device" in lines[0]


def test_a_library_that_rounds_differently_keeps_the_host_path(install, caplog):
    def rounds_half_down(weight, group):
        q, s = q4_0_reference.quantize(weight, group)
        return q ^ 1, s  # every low nibble off by one

    module = install(stand_in_module(library=rounds_half_down))
    model = layers(2)
    with caplog.at_level(logging.INFO):
        for layer in model:
            module._quantize_linear_int4_inplace(layer)
    assert module.library_calls == SELF_CHECK_CALLS + 2  # then the host path for each layer
    line = next(r.getMessage() for r in caplog.records if "keeps its host path" in r.getMessage())
    assert "differs from sym_int4.ggml_quantize_tensor" in line
    assert "4,096 of 4,096 words (random 64x512 bf16)" in line


def test_a_missing_library_keeps_the_host_path_with_the_reason(install, caplog):
    def missing(weight, group):
        raise RuntimeError("Failed to load required quantization lib at /opt/libq.so")

    module = install(stand_in_module(library=missing))
    with caplog.at_level(logging.INFO):
        assert module._use_xpu_quant() is False
    line = next(r.getMessage() for r in caplog.records if "keeps its host path" in r.getMessage())
    assert "ggml_quantize_tensor (its library's path not named) failed" in line
    assert "libq.so" in line


def test_intels_own_device_kernel_is_left_in_charge(install):
    module = install(stand_in_module(esimd=True))
    layer = layers(1)[0]
    module._quantize_linear_int4_inplace(layer)
    assert module.esimd_calls == 1 and module.library_calls == 0


def test_no_device_keeps_the_host_path(install, monkeypatch, caplog):
    module = install(stand_in_module())
    monkeypatch.setattr(device_quant, "check_device", lambda: None)
    with caplog.at_level(logging.INFO):
        assert module._use_xpu_quant() is False
    assert any("no XPU or CUDA device" in r.getMessage() for r in caplog.records)


def test_switch_off_installs_nothing():
    from vllm_xpu_memfix import fixes

    patcher = Patcher()
    fixes.install_requested(patcher, config.load({"VLLM_XPU_MEMFIX_DEVICE_QUANT": "off"}))
    try:
        assert not [key for key in patcher.states() if key[0] == "device_quant"]
        assert [key for key in patcher.states() if key[0] == "host_release"]
    finally:
        patcher.revert_all()


def test_the_users_opt_out_keeps_the_host_path(install, monkeypatch, caplog):
    """VLLM_INT4_DISABLE_XPU_QUANT=1 is the 0.14 module's own switch: the plugin must not
    turn the device path back on behind it."""
    monkeypatch.setenv("VLLM_INT4_DISABLE_XPU_QUANT", "1")
    module = install(stand_in_module())
    model = layers(2)
    with caplog.at_level(logging.INFO):
        for layer in model:
            module._quantize_linear_int4_inplace(layer)
    assert module.library_calls == 2  # the host path for each layer, and no self-check
    lines = decision_lines(caplog)
    assert len(lines) == 1 and "VLLM_INT4_DISABLE_XPU_QUANT is set" in lines[0]
