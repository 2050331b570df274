"""The start-up model (vllm_xpu_memfix.startup) on its own, without a server or a host read:
verdicts only as sure as their evidence, the device judged before the host, remedies that
help kept apart from those that do not, and each rule and table in one place."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.fixes import driver_env
from vllm_xpu_memfix.intel import catalog, driver
from vllm_xpu_memfix.memory.checkpoint import checkpoint_from_params
from vllm_xpu_memfix.startup import codes, phases, remedies, sizing
from vllm_xpu_memfix.startup.known import Source, exact

GiB = 1024**3
PACKAGE = Path(__file__).resolve().parent.parent / "vllm_xpu_memfix"
B60 = 24 * GiB
B70 = 32 * GiB


def machine(gpus: int, device: float, room_gib: float | None = 120, **kw) -> sizing.Machine:
    """``gpus`` Battlemage GPUs on kernel 7.1 (#916 ruled out), driver guard applied."""
    return sizing.Machine(
        gpus_visible=gpus,
        battlemage_visible=gpus,
        device_bytes=device,
        runtime=driver.runtime_from_version("26.14.37833.4", "test"),
        kernel=driver.kernel_from_release("7.1.0"),
        environ={"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"},
        room=None if room_gib is None else room_gib * GiB,
        **kw,
    )


def judge(m: sizing.Machine, params: float, name: str | None = None, **args):
    """A BF16 checkpoint of ``params`` whose config.json was read (no quantization_config:
    its format is known) and whose weights were not."""
    ckpt = replace(checkpoint_from_params(int(params), "BF16"), config={"torch_dtype": "bfloat16"})
    serve = sizing.ServeArgs(model=name, **args)
    return phases.run(sizing.inputs_for(m, serve, ckpt))


def test_weights_the_device_cannot_hold_fail_on_the_device_at_load_not_the_host():
    """32B in BF16 at TP 2 on two 24 GB B60s, ``-q`` forgotten, with the host copy on:
    64 GB of weights cannot sit on 48 GB of devices, and the host copy is never larger than
    the device memory it copies."""
    m = replace(machine(2, B60), environ={})
    out = judge(m, 32e9, tensor_parallel_size=2)
    assert out.inputs.host_copy
    assert out.fails_at == {"phase": "load", "where": "device"}
    assert out.verdict == codes.RUNS_OUT and out.main_cause == codes.DEVICE_OVERCOMMIT
    assert out.why.startswith("device at load: ") and "of the device's memory" in out.why
    for phase in out.phases.values():
        assert phase.pinned <= 2 * B60
    judged = remedies.remedies(out)
    helping = {r.code: r for r in judged.remedies}
    assert helping[codes.QUANTIZE].what == "-q fp8"
    assert helping[codes.QUANTIZE].after.verdict != codes.RUNS_OUT
    assert helping[codes.MORE_GPUS].what == "--tensor-parallel-size 4 on 4 GPUs"


def test_a_model_larger_than_one_device_gets_more_gpus():
    out = judge(machine(1, B70), 122e9, quantization="fp8")
    assert out.verdict == codes.RUNS_OUT and out.fails_at == {"phase": "load", "where": "device"}
    (more,) = [r for r in remedies.remedies(out).remedies if r.code == codes.MORE_GPUS]
    # 122 GB of fp8 weights: 28.4 GiB a rank at TP 4, within 0.92 x 32 GiB only if the
    # profile run's activations (no hidden_size read: a range from none) are small enough,
    # so at risk there, naming the value where it flips; TP 8 fits whatever they are.
    four = judge(machine(4, B70), 122e9, quantization="fp8", tensor_parallel_size=4)
    assert four.verdict == codes.AT_RISK and "fits if the activations are at most" in four.why
    assert "no hidden_size read: go online" in four.why
    assert more.what == "--tensor-parallel-size 8 on 8 GPUs" and more.after.verdict == codes.FITS


def test_tp_above_the_visible_gpus_will_fail_whatever_the_memory():
    out = judge(machine(2, B70), 1e9, tensor_parallel_size=4)
    assert out.verdict == codes.WILL_FAIL and out.main_cause == codes.TP_EXCEEDS_GPUS
    assert out.why == "TP 4 with 2 GPU(s) visible: vLLM refuses to start"
    assert judge(machine(4, B70), 1e9, tensor_parallel_size=4).verdict == codes.FITS


def test_a_name_says_nothing_of_the_format_the_checkpoints_own_config_does():
    """vllm #41663's shape (an FP8 checkpoint pasted without ``-q``): "-FP8" in a name is
    not read as FP8, nor as anything else; the checkpoint's quantization_config is."""
    named = judge(machine(2, B70), 27e9, "Qwen/Qwen3.6-27B-FP8", tensor_parallel_size=2)
    plain = judge(machine(2, B70), 27e9, "Qwen/Qwen3.6-27B", tensor_parallel_size=2)
    assert named.inputs.weights == plain.inputs.weights
    ckpt = checkpoint_from_params(27 * 10**9)
    args = sizing.ServeArgs(model="Qwen/Qwen3.6-27B-FP8")
    assert sizing.quantization(ckpt, args) == "none (weights as stored)"
    configured = replace(ckpt, config={"quantization_config": {"quant_method": "fp8"}})
    assert sizing.quantization(configured, sizing.ServeArgs(model="x")) == "fp8"
    assert sizing.weight_format(configured, args).bytes_per_weight == 1.0
    given = sizing.ServeArgs(model="x", quantization="fp8")
    assert sizing.quantization(ckpt, given) == "fp8 (-q, converted while loading)"


@pytest.mark.parametrize(
    ("share", "verdict"),
    [(0.5, codes.NOT_JUDGED), (0.9, codes.AT_RISK), (1.2, codes.RUNS_OUT)],
)
def test_the_host_verdict_names_its_phase_and_share_of_the_room(share, verdict):
    """No device memory given: a host that fits leaves the verdict "not judged", never
    "fits"; what fails on the host still fails."""
    inputs = phases.Inputs(tp=1, utilization=0.9, device_bytes=None, room=4 * GiB)
    room = phases.BASELINE_PER_RANK / share
    out = phases.run(replace(inputs, room=room))
    assert out.verdict == verdict
    assert out.not_judged == (codes.DEVICE,)
    if verdict != codes.NOT_JUDGED:
        assert out.why == f"host at load: {share:.0%} of the host's room"
        assert out.main_cause == codes.PROCESS_BASELINE


def test_a_host_without_ram_figures_is_not_judged_on_the_host():
    out = judge(machine(1, B70, room_gib=None), 1e9)
    assert out.verdict == codes.NOT_JUDGED and out.not_judged == (codes.HOST,)


def two_layouts_on_one_b60(linear_params: float) -> phases.Inputs:
    """0.21.0-b1's two sym_int4 layouts, one B60, a 200 GiB room."""
    return phases.Inputs(
        tp=1,
        utilization=0.9,
        device_bytes=B60,
        linear_params=linear_params,
        linear_bytes_per_weight=exact(catalog.TWO_LAYOUTS, "0.21.0-b1", Source.GIVEN),
        int4_layouts=2,
        gpus_in_context=1,
        battlemage_in_context=1,
        room=200 * GiB,
    )


def test_the_image_remedy_never_proposes_an_older_line():
    out = phases.run(two_layouts_on_one_b60(40e9))
    assert out.verdict == codes.RUNS_OUT

    def image_remedy(tag: str | None) -> str:
        image = catalog.image_named(tag) if tag else None
        judged = remedies.remedies(out, remedies.Context(image=image))
        return next(r.what for r in judged.remedies + judged.not_helping if r.code == "newer_image")

    assert image_remedy("0.21.0-b1").startswith(catalog.ONE_LAYOUT_IMAGE)
    assert image_remedy("0.26.0-b2").startswith("an llm-scaler image newer than 0.26.0-b2")


def test_the_master_switch_is_reported_as_itself_and_ray_env_still_says_what_a_node_needs(
    tmp_path, capsys, monkeypatch
):
    from hosts import B70 as B70_ID
    from hosts import build_host

    from vllm_xpu_memfix.cli import ray_env

    host = build_host(tmp_path / "host", [B70_ID] * 2, kernel="7.1.0")
    settings = config.load({"VLLM_XPU_MEMFIX": "0", "VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    decision = driver_env.decide(settings, {})
    assert decision.reason == "VLLM_XPU_MEMFIX=0 (the plugin is off)"
    monkeypatch.setenv("VLLM_XPU_MEMFIX", "0")
    monkeypatch.setenv("VLLM_XPU_MEMFIX_SYSROOT", str(host))
    assert ray_env.main(type("A", (), {"json": False})()) == 0
    out = capsys.readouterr().out
    assert "export EnableDeferBacking=0" in out
    assert "the plugin's driver guard is off here: these are yours to set" in out


def test_a_battlemage_id_missing_from_the_product_table_is_battlemage_everywhere():
    unnamed = 0xE20D  # in compute-runtime's BMG list, no product row
    assert catalog.model_of(unnamed) is None
    gpu = driver.Gpu("card0", unnamed, "0000:03:00.0", None)
    assert gpu.is_battlemage and catalog.family(unnamed) == "Battlemage G21"
    assert catalog.product(unnamed) == "Battlemage G21"


def _python_sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_pci_ids_are_listed_only_in_the_catalog():
    """As numbers: a message may show an id as an example ('0xe223'), a table may not."""
    pci_id = re.compile(r"(?<!['\"])0x(?:E2|56)[0-9A-F]{2}\b", re.IGNORECASE)
    found = {str(p.relative_to(PACKAGE)) for p in _python_sources() if pci_id.search(p.read_text())}
    assert found == {"intel/catalog.py"}


def _defined_functions(name: str) -> list[str]:
    return [
        str(p.relative_to(PACKAGE))
        for p in _python_sources()
        for node in ast.parse(p.read_text()).body  # module-level functions
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]


@pytest.mark.parametrize(
    ("rule", "home"),
    [
        ("why_no_host_copy", "intel/driver.py"),
        ("xe_peer_oom", "intel/driver.py"),
        ("slots_for_room", "startup/staging.py"),
        ("kv_reserve", "startup/reserve.py"),
    ],
)
def test_each_rule_is_defined_once(rule, home):
    assert _defined_functions(rule) == [home]


def test_the_fixes_and_the_model_take_their_figures_from_startup():
    """The load lock stages by startup.staging.per_rank, kv_headroom reserves by
    startup.reserve.kv_reserve, and the driver guard asks intel's host-copy rule."""
    uses = {
        "fixes/load_lock.py": "staging.per_rank(",
        "fixes/kv_headroom.py": "kv_reserve(",
        "fixes/driver_env.py": "driver.why_no_host_copy(",
        "startup/inputs.py": "driver.why_no_host_copy(",
    }
    for module, call in uses.items():
        assert call in (PACKAGE / module).read_text(), module
    assert "1.5" not in (PACKAGE / "fixes/load_lock.py").read_text()
    assert "256 * MiB" not in (PACKAGE / "startup/phases.py").read_text()


@pytest.mark.parametrize(
    ("params", "verdict"),
    [(8e9, codes.FITS), (27e9, codes.AT_RISK), (80e9, codes.RUNS_OUT)],
)
def test_with_params_and_no_format_only_the_smallest_format_running_out_runs_out(params, verdict):
    """Issue 57, class 1: a bare --params (no config.json, no headers) says nothing of the
    format. On one B70, 8B fits even at 16 bits; 27B fits at 8 bits and runs out at 16, so
    it is at risk naming where it flips and what settles it; 80B runs out even at 4 bits.
    -q narrows the range: 27B with -q fp8 is certain."""
    ckpt = checkpoint_from_params(int(params))
    args = sizing.ServeArgs(model="Qwen/Qwen3.6-27B-FP8")  # a name never narrows it
    out = phases.run(sizing.inputs_for(machine(1, B70), args, ckpt))
    assert out.verdict == verdict
    if verdict == codes.AT_RISK:
        assert "fits if the weights are at most 8-bit; runs out at 16-bit" in out.why
        assert "pass --quantization, or go online" in out.why
    if verdict == codes.RUNS_OUT:
        assert "even with the weights at 4-bit" in out.why
        assert "bytes per token" not in out.why  # a range that changes nothing is not named
    given = replace(args, quantization="fp8")
    per_weight = sizing.inputs_for(machine(1, B70), given, ckpt).linear_bytes_per_weight
    assert per_weight.certain and per_weight.low == 1.0
