"""Allocator detection on recorded maps, real release under glibc / jemalloc / tcmalloc,
and the attribute audit on a real torch model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_xpu_memfix.memory import allocator, audit

MAPS = Path(__file__).parent / "data" / "maps"
PRELOAD = {
    "glibc": None,
    "jemalloc": Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    "tcmalloc": Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
}
MiB = 1024**2


@pytest.mark.parametrize("name", ["glibc", "jemalloc", "tcmalloc"])
def test_detect_on_recorded_maps(name):
    assert allocator.detect((MAPS / f"{name}.maps").read_text()) == name


FRAGMENT = r"""
import gc, json
from vllm_xpu_memfix.memory import allocator
from vllm_xpu_memfix.memory.snapshot import take_self

def anon():
    return take_self(pss=False).rss_anon

blocks = [bytes(4096) + bytes([i % 256]) for i in range(60000)]  # ~250 MiB of small chunks
keep = blocks[::50]  # pins a few pages so nothing is returned by itself
del blocks
gc.collect()
freed_but_kept = anon()
result = allocator.release_free_memory()
print(json.dumps({"allocator": result.allocator, "released": result.released,
                  "before": freed_but_kept, "after": anon()}))
"""


@pytest.mark.parametrize("name", ["glibc", "jemalloc", "tcmalloc"])
def test_release_gives_freed_small_chunks_back(name):
    preload = PRELOAD[name]
    if preload is not None and not preload.exists():
        pytest.skip(f"{preload} is not installed (scripts/setup.sh installs it as root)")
    env = {**os.environ, **({"LD_PRELOAD": str(preload)} if preload else {})}
    result = subprocess.run(
        [sys.executable, "-c", FRAGMENT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["allocator"] == name and report["released"]
    assert report["before"] - report["after"] > 150 * MiB, report


torch = pytest.importorskip("torch")


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1024, 1024))  # 4 MiB, registered
        self.register_buffer("scale", torch.zeros(512, 1024))  # 2 MiB, registered
        self.staging_fp32 = torch.zeros(1024, 1024)  # 4 MiB leftover
        self.copies = [torch.zeros(512, 1024), torch.zeros(8)]  # 2 MiB in a list
        self.tiny = torch.zeros(16)


def model():
    outer = torch.nn.Module()
    outer.layers = torch.nn.ModuleList([Layer(), Layer()])
    return outer


def test_audit_reports_registered_and_attribute_tensors_above_the_threshold():
    found = {t.name: t for t in audit.find_host_tensors(model())}
    assert found["layers.0.weight"].registered and found["layers.0.scale"].registered
    assert not found["layers.0.staging_fp32"].registered
    assert found["layers.1.copies[0]"].nbytes == 2 * MiB
    assert "layers.0.tiny" not in found and "layers.0.copies[1]" not in found
    assert (
        str(found["layers.0.staging_fp32"])
        == "layers.0.staging_fp32 [1024, 1024] float32 4.0 MiB (attribute)"
    )


def test_release_matching_deletes_attributes_never_parameters():
    m = model()
    released = audit.release_matching(m, ["staging_*", "weight", "scale", "layers.1.copies"])
    assert sorted(t.name for t in released) == ["layers.0.staging_fp32", "layers.1.staging_fp32"]
    assert all(not hasattr(layer, "staging_fp32") for layer in m.layers)
    assert all(isinstance(layer.weight, torch.nn.Parameter) for layer in m.layers)
    assert all(layer.scale.shape == (512, 1024) for layer in m.layers)
    assert len(m.layers[1].copies) == 2, "containers are reported, not torn apart"


def test_sym_int4_layers_trigger_a_trim_every_n_mib_of_staging(monkeypatch):
    """Intel's sym_int4 is not on this test bed: a stand-in module with its per-layer function's
    name and call shape (a layer whose .weight is the bf16 weight) plays it."""
    import types

    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.core.patching import Patcher
    from vllm_xpu_memfix.fixes import host_release

    name = "vllm.model_executor.layers.quantization.sym_int4"
    stand_in = types.ModuleType(name)
    quantized = []

    def _quantize_linear_int4_inplace(layer):
        quantized.append(layer.weight.numel())
        layer.weight = None

    stand_in._quantize_linear_int4_inplace = _quantize_linear_int4_inplace
    monkeypatch.setitem(sys.modules, name, stand_in)
    trims = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(len(quantized)) or True)
    settings = config.load({"VLLM_XPU_MEMFIX_RELEASE_EVERY_MIB": "64"})
    patcher = Patcher()
    try:
        for patch in host_release.patches(settings):
            if patch.module == name:
                patcher.install(patch)
        # 4096 x 1024 params stage ~26 MiB each (6.5 bytes per parameter): a trim every 3rd layer.
        for _ in range(7):
            layer = types.SimpleNamespace(weight=torch.zeros(4096, 1024, dtype=torch.bfloat16))
            stand_in._quantize_linear_int4_inplace(layer)
            assert layer.weight is None
    finally:
        patcher.revert_all()
    assert len(quantized) == 7
    assert trims == [3, 6]


def test_sym_int4_moe_sides_count_their_experts_toward_the_trim(monkeypatch):
    """The sym_int4 replay's real MoE side function (tests/plugins/sym_int4_replay): an MoE
    layer has no .weight, so the staging is counted from the side's experts."""
    pytest.importorskip("vllm")
    import importlib

    from vllm_xpu_memfix.core import config
    from vllm_xpu_memfix.core.patching import Patcher
    from vllm_xpu_memfix.fixes import host_release

    name = "vllm.model_executor.layers.quantization.sym_int4"
    module = importlib.import_module(name)
    trims = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(True) or True)
    settings = config.load({"VLLM_XPU_MEMFIX_RELEASE_EVERY_MIB": "64"})
    patcher = Patcher()
    experts, inter, hidden = 8, 256, 1024
    try:
        for patch in host_release.patches(settings):
            if patch.module == name:
                patcher.install(patch)
        layer = torch.nn.Module()
        # w13 stages 8 x 512 x 1024 params, ~26 MiB at 6.5 bytes each; w2 half of that.
        layer.w13_weight = torch.nn.Parameter(
            torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16), requires_grad=False
        )
        layer.w2_weight = torch.nn.Parameter(
            torch.randn(experts, hidden, inter, dtype=torch.bfloat16), requires_grad=False
        )
        for which in ("w13", "w2", "w13"):
            if which == "w13" and getattr(layer, "w13_weight", None) is None:
                layer.w13_weight = torch.nn.Parameter(
                    torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16),
                    requires_grad=False,
                )
            module._quantize_moe_int4_side_inplace(layer, which)
    finally:
        patcher.revert_all()
    assert trims == [True], "26 + 13 + 26 MiB of staging: one trim, after the third side"
    assert hasattr(layer, "w13_qscales") or hasattr(layer, "w13_scales")
