"""device_quant on the layouts of Intel's sym_int4 that the replay reproduces
(tests/plugins/sym_int4_replay): recognition from structure, the unknown-layout fallback,
and, on the two 0.21 layouts (host round trip, b2; inline registration, b1), a device path
that leaves every layer exactly as the module's host path does.

The "device" is the CPU here (``check_device`` is pointed at it, where the plugin's kernel
API runs the Q4_0 torch reference); the Triton kernel itself is checked bit for bit against
the reference on the H200 (docs/design/device-quant.md). The one XPU-only call of the 0.21 wiring,
vllm-xpu-kernels' ``transpose_onednn_woq_format``, is the replay's stand-in of that name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.core.patching import Patcher
from vllm_xpu_memfix.intel import int4_layouts

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

MODULE = "vllm.model_executor.layers.quantization.sym_int4"
SELF_CHECK_CALLS = 2  # int4_self_check.probes: a random tensor and the near-tie probe


@pytest.fixture
def replay(request, monkeypatch):
    """The replay as imported here: SYM_INT4_REPLAY_LAYOUT unset gives 0.26, whose
    functions are the 0.21 module's (the host-round-trip layout). Parametrised with a
    layout, a second copy of the replay's file executed with that layout stands in for
    the module in ``sys.modules`` for the test."""
    module = importlib.import_module(MODULE)
    assert module.LAYOUT in ("0.21", "0.26"), "the tests below need the 0.21 functions"
    layout = getattr(request, "param", None)
    if layout is None:
        return module
    monkeypatch.setenv("SYM_INT4_REPLAY_LAYOUT", layout)
    spec = importlib.util.spec_from_file_location(MODULE, module.__file__)
    assert spec is not None and spec.loader is not None
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    monkeypatch.setitem(sys.modules, MODULE, variant)
    return variant


# Each 0.21 layout the device path takes over: None is the replay as imported (b2).
LAYOUTS_21 = pytest.mark.parametrize("replay", [None, "0.21-b1"], indirect=True)


def test_the_host_round_trip_layout_is_recognised_from_the_module(replay):
    found = int4_layouts.recognise(int4_layouts.shape_of_module(replay))
    assert found.layout is int4_layouts.HOST_ROUND_TRIP
    assert "_register_linear_int4_layouts" in found.summary


@pytest.mark.parametrize("replay", ["0.21-b1"], indirect=True)
def test_the_inline_registration_layout_is_recognised_from_the_module(replay):
    found = int4_layouts.recognise(int4_layouts.shape_of_module(replay))
    assert found.layout is int4_layouts.INLINE_REGISTRATION
    assert "registered inline" in found.summary and "<side>_qweight as int32" in found.summary
    assert found.layout.moe_side_mismatch(found.shape) is None


INLINE_SOURCE = textwrap.dedent(
    """
    def ggml_quantize_tensor(weight, out_qweight, out_scale, out_features, in_features):
        pass
    def _quantize_linear_int4_inplace(layer):
        ggml_quantize_tensor(layer.weight, None, None, 1, 1)
        layer._int4_in_features_padded = 1
        if not GATE():
            layer.weight_esimd, layer.scale_esimd = None, None
        layer.qweight, layer.scales, layer.qzeros = None, None, None
        transpose_onednn_woq_format(layer, "gptq", True)
    def _quantize_moe_int4_side_inplace(layer, which):
        ggml_quantize_tensor(torch.nn.functional.pad(layer), None, None, 1, 1).view(WORDS)
    """
)


@pytest.mark.parametrize(
    ("gate", "words", "layout_key", "moe_why"),
    [
        ("False", "torch.int32", "inline-registration", None),
        (
            "False",
            "torch.uint8",
            "inline-registration",
            "_quantize_moe_int4_side_inplace uses uint8",
        ),
        ("disable_esimd_int4", "torch.int32", None, None),
    ],
)
def test_the_inline_layout_is_told_by_its_esimd_gate_and_its_moe_words(
    tmp_path, gate, words, layout_key, moe_why
):
    from vllm_xpu_memfix.cli.check import sym_int4_layout

    source = INLINE_SOURCE.replace("GATE", gate).replace("WORDS", words)
    found = int4_layouts.recognise(int4_layouts.shape_of_source(source))
    # check reads the installed module's source the same way and prints the summary.
    path = tmp_path.joinpath(*MODULE.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert sym_int4_layout(tmp_path) == found.summary
    if layout_key is None:
        assert found.layout is None
        assert "not inline-registration: _quantize_linear_int4_inplace uses disable_esimd_int4" in (
            found.why
        )
        assert found.summary.endswith("device_quant keeps the host path")
        return
    assert found.layout is int4_layouts.INLINE_REGISTRATION
    assert found.layout.moe_side_mismatch(found.shape) == moe_why


def test_the_seam_layout_is_recognised_in_the_014_replay():
    code = textwrap.dedent(
        """
        import importlib, json
        from vllm_xpu_memfix.intel import int4_layouts
        module = importlib.import_module("vllm.model_executor.layers.quantization.sym_int4")
        found = int4_layouts.recognise(int4_layouts.shape_of_module(module))
        print(json.dumps([found.layout.key if found.layout else None, found.why]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "SYM_INT4_REPLAY_LAYOUT": "0.14"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])[0] == "seam"


def test_an_unknown_layout_says_what_it_lacks():
    source = textwrap.dedent(
        """
        def ggml_quantize_tensor(weight, out_qweight, out_scale, out_features, in_features):
            pass
        def _quantize_linear_int4_inplace(layer, group):
            ggml_quantize_tensor(layer.weight, None, None, 1, 1)
        """
    )
    found = int4_layouts.recognise(int4_layouts.shape_of_source(source))
    assert found.layout is None
    assert "not seam: no _use_xpu_quant" in found.why
    assert "not host-round-trip: no _register_linear_int4_layouts" in found.why
    assert found.summary.endswith("device_quant keeps the host path")


def test_source_and_module_readings_agree_on_the_replay(replay):
    import inspect

    from_module = int4_layouts.shape_of_module(replay)
    from_source = int4_layouts.shape_of_source(inspect.getsource(replay))
    # The source holds both layouts' definitions; the 0.21 ones come second, so compare
    # the names the two readings share outside the layout-specific branches.
    for name in ("ggml_quantize_tensor", "_legacy_load"):
        assert from_module[name][0] == from_source[name][0], name


def layer_like(n: int = 64, k: int = 200, seed: int = 0) -> torch.nn.Module:
    layer = torch.nn.Module()
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def parameters(layer: torch.nn.Module) -> dict:
    """Every parameter the step left: dtype, shape, strides, bytes, and the first parameter
    (by name) whose storage it shares, so a copy and an alias differ."""
    named = sorted(layer.named_parameters())
    first = {}
    for name, t in named:
        first.setdefault(t.untyped_storage().data_ptr(), name)
    return {
        name: (
            t.dtype,
            tuple(t.shape),
            t.stride(),
            first[t.untyped_storage().data_ptr()],
            as_bytes(t),
        )
        for name, t in named
    }


def state(layer: torch.nn.Module) -> dict:
    """Every parameter and plain attribute the step left."""
    tensors = parameters(layer)
    plain = {k: v for k, v in vars(layer).items() if k.startswith("_int4")}
    plain["processed"] = getattr(layer, "_already_called_process_weights_after_loading", None)
    plain["weight"] = layer.weight
    return {"tensors": tensors, "plain": plain}


@pytest.fixture
def device_path(monkeypatch, replay, tmp_path):
    """Installs device_quant on the replay when asked; counts the module's library calls.
    The self-check's record goes to ``tmp_path``."""
    from vllm_xpu_memfix.fixes import device_quant

    monkeypatch.setattr(device_quant, "check_device", lambda: torch.device("cpu"))
    calls: list[tuple] = []
    original = replay.ggml_quantize_tensor

    @functools.wraps(original)  # keeps the signature the layout is recognised by
    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(replay, "ggml_quantize_tensor", counted)
    patcher = Patcher()
    settings = config.load({"VLLM_XPU_MEMFIX_LOCK_DIR": str(tmp_path)})
    yield types.SimpleNamespace(
        calls=calls, install=lambda: device_quant.install(patcher, settings), records=tmp_path
    )
    patcher.revert_all()


@LAYOUTS_21
@pytest.mark.parametrize("k", [256, 200])  # a whole number of groups, and one padded
def test_the_device_path_leaves_the_layer_exactly_as_the_host_path(replay, device_path, caplog, k):
    host_layer, device_layer = layer_like(k=k), layer_like(k=k)
    replay._quantize_linear_int4_inplace(host_layer)
    assert len(device_path.calls) == 1
    expected = state(host_layer)

    device_path.install()
    with caplog.at_level(logging.INFO):
        replay._quantize_linear_int4_inplace(device_layer)
    assert "quantizes on the device" in caplog.text, "the device path ran"
    assert len(device_path.calls) == 1 + SELF_CHECK_CALLS, "the self-check only, not the layer"
    got = state(device_layer)
    assert got["plain"] == expected["plain"]
    assert got["tensors"].keys() == expected["tensors"].keys()
    for name, (*layout, data) in expected["tensors"].items():
        assert got["tensors"][name][:4] == tuple(layout), name
        assert torch.equal(got["tensors"][name][4], data), name


def streamed(module, weight: torch.Tensor) -> torch.nn.Module:
    """A layer made by the module's Linear method on the streaming load
    (``VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT`` unset: BF16 on meta) and loaded in two row
    shards; the module's loader quantizes it when the last element arrives."""

    def copy_rows(param, loaded, rows):
        param.data[rows].copy_(loaded)

    layer = torch.nn.Module()
    n, k = weight.shape
    module.SymInt4LinearMethod().create_weights(
        layer, k, [n], k, n, torch.bfloat16, weight_loader=copy_rows
    )
    meta = layer.weight  # vLLM's load_weights looks the parameter up once, before loading
    assert meta.is_meta
    for rows in (slice(0, n // 2), slice(n // 2, n)):
        meta.weight_loader(meta, weight[rows], rows)
    return layer


@pytest.mark.parametrize("replay", ["0.21-b1"], indirect=True)
def test_the_streaming_load_reaches_the_device_path(replay, device_path, monkeypatch):
    """The streaming loader calls the module's layer function by its global name, which
    is the one device_quant wraps: the layer ends as the host path leaves it."""
    from vllm.model_executor import parameter as vllm_parameter

    monkeypatch.delenv("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT", raising=False)
    # vLLM's weight parameters record their tensor-parallel place; one rank of one here.
    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    weight = layer_like(k=200).weight.data
    expected = state(streamed(replay, weight))
    assert len(device_path.calls) == 1

    device_path.install()
    got = state(streamed(replay, weight))
    assert len(device_path.calls) == 1 + SELF_CHECK_CALLS, "the self-check only"
    assert got["plain"] == expected["plain"]
    assert got["tensors"].keys() == expected["tensors"].keys()
    for name, (*layout, data) in expected["tensors"].items():
        assert got["tensors"][name][:4] == tuple(layout), name
        assert torch.equal(got["tensors"][name][4], data), name


@pytest.mark.parametrize("rounding", ["fused", "product-first"])
def test_the_self_check_holds_the_kernel_to_the_installed_library(
    replay, device_path, monkeypatch, caplog, rounding
):
    """The replay's library rounds as Intel's (fused), or the other way: device_quant
    takes the device path only where the kernel matches the module's own quantizer,
    says which comparisons ran with counts, and records them for ``check``."""
    from vllm_xpu_memfix.intel.int4_self_check import describe

    monkeypatch.setattr(replay, "ROUNDING", rounding)
    layer = layer_like()
    device_path.install()
    with caplog.at_level(logging.INFO):
        replay._quantize_linear_int4_inplace(layer)
    decision = [r.getMessage() for r in caplog.records if "sym_int4 quantizes" in r.getMessage()]
    decision += [r.getMessage() for r in caplog.records if "keeps its host path" in r.getMessage()]
    assert len(decision) == 1
    line = decision[0]
    report = describe(device_path.records)
    if rounding == "fused":
        assert "quantizes on the device" in line and "960 words of a near-tie probe" in line
        assert len(device_path.calls) == SELF_CHECK_CALLS, "the layer went to the device"
        assert "last run" in report and "device path:" in report
    else:
        assert "keeps its host path" in line and "round x * id + 8.5 differently" in line
        ties = int(line.split(" words (near-tie probe")[0].rsplit("; ", 1)[1].split(" of ")[0])
        assert ties > 100, line  # the probe exposes the other rounding in many words
        assert len(device_path.calls) == SELF_CHECK_CALLS + 1, "the layer took the host path"
        assert "host path kept" in report and "near-tie probe" in report


def test_a_non_finite_weight_falls_back_to_the_host_path_with_one_line(replay, device_path, caplog):
    device_path.install()
    layer = layer_like()
    layer.weight.data[3, 5] = float("nan")
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="inf or NaN"):
        # The host path runs, and the replay's library refuses NaN as the kernel did.
        replay._quantize_linear_int4_inplace(layer)
    lines = [r.getMessage() for r in caplog.records if "takes the host path" in r.getMessage()]
    assert len(lines) == 1 and "inf or NaN" in lines[0]
    assert len(device_path.calls) == SELF_CHECK_CALLS + 1, "the self-check, then this layer"


def test_an_unknown_layout_keeps_the_host_path_and_says_so(monkeypatch, caplog):
    from vllm_xpu_memfix.fixes import device_quant

    module = types.ModuleType(MODULE)
    calls = []

    def _quantize_linear_int4_inplace(layer):
        calls.append(layer)

    module._quantize_linear_int4_inplace = _quantize_linear_int4_inplace
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(device_quant, "check_device", lambda: torch.device("cpu"))
    patcher = Patcher()
    device_quant.install(patcher, config.load({}))
    try:
        with caplog.at_level(logging.INFO):
            module._quantize_linear_int4_inplace("layer-1")
            module._quantize_linear_int4_inplace("layer-2")
    finally:
        patcher.revert_all()
    assert calls == ["layer-1", "layer-2"]
    lines = [r.getMessage() for r in caplog.records if "sym_int4 layout" in r.getMessage()]
    assert len(lines) == 1 and "unknown" in lines[0] and "keeps the host path" in lines[0]


def moe_like(experts: int = 3, hidden: int = 256, intermediate: int = 200, seed: int = 1):
    """An MoE layer's two sides as vLLM's FusedMoE holds them: w13 [E, 2I, H], w2 [E, H, I];
    I = 200 needs padding to 256. Only two of the three experts are local."""
    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    for name, shape in (("w13", (2 * intermediate, hidden)), ("w2", (hidden, intermediate))):
        weight = torch.randn(experts, *shape, generator=generator).to(torch.bfloat16)
        setattr(layer, f"{name}_weight", torch.nn.Parameter(weight, requires_grad=False))
    layer.local_num_experts = experts - 1
    return layer


def moe_state(layer: torch.nn.Module) -> dict:
    return {"tensors": parameters(layer), "cleared": [layer.w13_weight, layer.w2_weight]}


@LAYOUTS_21
def test_the_device_path_leaves_an_moe_layer_exactly_as_the_host_path(replay, device_path, caplog):
    host_layer, device_layer = moe_like(), moe_like()
    for which in ("w13", "w2"):
        replay._quantize_moe_int4_side_inplace(host_layer, which)
    assert len(device_path.calls) == 4, "two local experts per side on the host path"
    expected = moe_state(host_layer)
    assert not torch.any(host_layer.w2_qweight[2]), "the non-local expert's words stay zero"

    device_path.install()
    with caplog.at_level(logging.INFO):
        for which in ("w13", "w2"):
            replay._quantize_moe_int4_side_inplace(device_layer, which)
    assert len(device_path.calls) == 4 + SELF_CHECK_CALLS, "the self-check only"
    assert "MoE layers keep the host path" not in caplog.text
    got = moe_state(device_layer)
    assert got["cleared"] == expected["cleared"] == [None, None]
    assert (
        got["tensors"].keys()
        == expected["tensors"].keys()
        == {
            "w13_qweight",
            "w13_qscales",
            "w2_qweight",
            "w2_qscales",
        }
    )
    for name, (*layout, data) in expected["tensors"].items():
        assert got["tensors"][name][:4] == tuple(layout), name
        assert torch.equal(got["tensors"][name][4], data), name


def test_a_non_finite_expert_leaves_the_side_to_the_host_path(replay, device_path, caplog):
    device_path.install()
    layer = moe_like()
    layer.w2_weight.data[1, 0, 0] = float("inf")
    before = layer.w2_weight.data.clone()
    replay._quantize_moe_int4_side_inplace(layer, "w13")  # a finite side: on the device
    assert len(device_path.calls) == SELF_CHECK_CALLS
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="inf or NaN"):
        replay._quantize_moe_int4_side_inplace(layer, "w2")
    lines = [r.getMessage() for r in caplog.records if "takes the host path" in r.getMessage()]
    assert len(lines) == 1 and "inf or NaN" in lines[0]
    assert torch.equal(layer.w2_weight.data, before), "the refused side was left untouched"
    assert len(device_path.calls) == SELF_CHECK_CALLS + 2, "the host path ran expert 0, refused 1"


def test_an_moe_side_function_of_another_shape_is_left_to_the_module():
    source = textwrap.dedent(
        """
        def _quantize_moe_int4_side_inplace(layer, which):
            ggml_quantize_tensor(layer, None, None, 1, 1)
        """
    )
    why = int4_layouts.HOST_ROUND_TRIP.moe_side_mismatch(int4_layouts.shape_of_source(source))
    assert why == "_quantize_moe_int4_side_inplace does not use pad, uint8"
    assert int4_layouts.SEAM.moe_side_mismatch({}) is not None


@pytest.mark.parametrize("opt_out", [None, "1"])
def test_the_seam_of_the_014_replay_is_filled_unless_the_user_opted_out(opt_out, tmp_path):
    code = textwrap.dedent(
        """
        import importlib, json, logging, os, torch
        from vllm_xpu_memfix.core import config
        from vllm_xpu_memfix.fixes import device_quant
        from vllm_xpu_memfix.core.patching import Patcher
        module = importlib.import_module("vllm.model_executor.layers.quantization.sym_int4")
        device_quant.check_device = lambda: torch.device("cpu")
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("vllm_xpu_memfix").addHandler(handler)
        logging.getLogger("vllm_xpu_memfix").setLevel(logging.INFO)
        locks = {"VLLM_XPU_MEMFIX_LOCK_DIR": os.environ["LOCKS"]}
        device_quant.install(Patcher(), config.load(locks))
        used = [module._use_xpu_quant(), module._use_xpu_quant()]
        decided = [m for m in lines if "sym_int4 keeps" in m or "quantizes on" in m]
        print(json.dumps([used, decided]))
        """
    )
    env = {**os.environ, "SYM_INT4_REPLAY_LAYOUT": "0.14", "LOCKS": str(tmp_path)}
    env.pop("VLLM_INT4_DISABLE_XPU_QUANT", None)
    if opt_out:
        env["VLLM_INT4_DISABLE_XPU_QUANT"] = opt_out
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    used, lines = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(lines) == 1, lines
    if opt_out:
        assert used == [False, False] and "VLLM_INT4_DISABLE_XPU_QUANT is set" in lines[0]
    else:
        assert used == [True, True] and "bit for bit on 4,096 words" in lines[0]
