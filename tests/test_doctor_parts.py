"""Each step of doctor alone: facts from a constructed host tree, the estimate and the
advice from hand-built facts (no host read), the text from a hand-built report."""

from __future__ import annotations

import json
from dataclasses import replace

from hosts import B70, build_host

from vllm_xpu_memfix.cli.doctor import advice, facts, outcome_for, render, sections
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.fixes.driver_env import GUARD_ENV, Decision
from vllm_xpu_memfix.intel.driver import Gpu, kernel_from_release
from vllm_xpu_memfix.memory.checkpoint import checkpoint_from_params
from vllm_xpu_memfix.memory.room import Room
from vllm_xpu_memfix.memory.snapshot import CgroupMemory, Snapshot
from vllm_xpu_memfix.startup import host, phases, remedies
from vllm_xpu_memfix.startup.sizing import ServeArgs

GiB = 1024**3
BASELINE = phases.BASELINE_PER_RANK
TP4 = ServeArgs(model=None, tensor_parallel_size=4, gpu_memory_utilization=0.9)


def four_b70(room_gib: float = 64, guard_applies: bool = False) -> facts.Measurement:
    """Four visible B70 (32 GiB each) on a runtime taken as affected, kernel 7.1, no model."""
    gpus = [Gpu(f"card{i}", 0xE223, f"0000:0{i}:00.0", 32 * GiB) for i in range(4)]
    return facts.Measurement(
        snap=Snapshot(ts=0.0, pid=1, mem_available=int(room_gib * GiB)),
        gpus=gpus,
        visible=gpus,
        runtime=None,
        level_zero_loader=None,
        guard=Decision(
            apply=guard_applies,
            reason="hand-built",
            env=dict(GUARD_ENV) if guard_applies else {},  # what an applying guard sets
        ),
        device_bytes=32 * GiB,
        device_source="hand-built",
        ckpt=None,
        model_label="",
        legacy=(False, f"{facts.OFFLOAD} unset: one layer in flight"),
        room=Room(int(room_gib * GiB), CgroupMemory()),
        load_slots=None,
        kernel=kernel_from_release("7.1.0"),  # compute-runtime #916 ruled out
    )


def test_facts_read_the_gpus_device_memory_and_room_from_a_host_tree(tmp_path):
    host = build_host(tmp_path / "host", [B70] * 2, mem_available_gib=100, vram_gib=24)
    settings = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(host)})
    measured = facts.measure(settings, replace(TP4, tensor_parallel_size=2), {})
    assert measured.visible_battlemage == 2
    assert (measured.device_bytes, measured.device_source) == (
        24 * GiB,
        "sysfs physical_vram_size_bytes",
    )
    assert measured.room.bytes == 100 * GiB
    assert measured.ckpt is None and measured.load_slots is None


def test_facts_take_a_bare_parameter_count_in_the_dtype_asked_for():
    ckpt, label = facts.read_model(ServeArgs(model=None, params=10**9, dtype="float16"))
    assert label == "--params" and ckpt is not None
    assert (ckpt.dtype, ckpt.total_bytes) == ("F16", 2 * 10**9)
    assert facts.read_model(ServeArgs(model=None)) == (None, "")


def test_facts_give_the_load_slots_the_switch_and_the_flag_ask_for():
    room = Room(64 * GiB, CgroupMemory())
    on = config.load({"VLLM_XPU_MEMFIX_LOAD_LOCK": "on"})
    off = config.load({"VLLM_XPU_MEMFIX_LOAD_LOCK": "off"})
    assert host.load_slots(on, TP4, False, room, None) == 1
    assert host.load_slots(off, TP4, True, room, None) is None
    flagged = replace(TP4, max_parallel_loading_workers=2)
    assert host.load_slots(on, flagged, False, room, None) == 2


def test_the_model_counts_the_host_copy_on_each_rank_until_the_guard_applies():
    out = outcome_for(four_b70(), TP4)
    copy = 32 * GiB * 0.9
    assert out.inputs.host_copy and sections.per_rank_section(out)["host_copy"] == copy
    assert out.phases["kv_cache"].host == 4 * (copy + BASELINE)
    # The copy is of device memory: never more than the 32 GiB the device holds.
    warmup = min(copy + phases.WARMUP_OUTSIDE_TORCH, 32 * GiB)  # no model: no sampler burst
    assert out.phases["warmup"].host == 4 * (warmup + BASELINE)
    assert (out.verdict, out.main_cause) == ("will run out of memory", "driver_host_copy")
    assert out.fails_at == {"phase": "kv_cache", "where": "host"}
    assert out.why.startswith("host at kv_cache: ") and "of the host's room" in out.why

    guarded = outcome_for(four_b70(guard_applies=True), TP4)
    assert not guarded.inputs.host_copy
    assert sections.per_rank_section(guarded)["host_copy"] == 0
    assert guarded.host_need == 4 * BASELINE
    assert (guarded.verdict, guarded.main_cause) == ("fits", "process_baseline")


def test_the_model_lets_only_the_ranks_with_a_load_slot_stage_a_legacy_shard():
    ckpt = checkpoint_from_params(8 * 10**9, "BF16")
    measured = replace(
        four_b70(guard_applies=True), ckpt=ckpt, legacy=(True, "legacy"), load_slots=1
    )
    args = replace(TP4, quantization="sym_int4")
    out = outcome_for(measured, args)
    shard = ckpt.total_bytes / 4
    unit = out.inputs.unit_params / 4 * 6.515625  # the unit's temporaries (startup.staging)
    assert out.inputs.staging == shard + unit
    staged = {c.code: c.gib for c in out.causes}["quant_staging"]
    assert staged * GiB == shard + unit  # one rank at a time, not four

    unlocked = outcome_for(replace(measured, load_slots=None), args)
    assert {c.code: c.gib for c in unlocked.causes}["quant_staging"] * GiB == 4 * (shard + unit)


def test_remedies_put_the_guard_first_and_find_the_utilisation_that_fits():
    measured = four_b70(room_gib=80)
    ranked = remedies.remedies(outcome_for(measured, TP4)).remedies
    assert [r.code for r in ranked] == [
        "driver_guard",
        "gpu_memory_utilization",
        "no_peer_access",
        "compute_runtime_26_05",
        "more_host_ram",
    ]
    assert {r.after.verdict for r in ranked} == {"fits"}
    assert ranked[0].what.startswith("VLLM_XPU_MEMFIX_DRIVER_ENV=auto (or on): the plugin's")
    assert ranked[0].after.host_need == 4 * BASELINE
    # 4 x (u x 32 GiB + warm-up outside torch) + 14 GiB within 0.85 x 80 GiB: u = 0.40.
    assert ranked[1].what == "--gpu-memory-utilization 0.40"
    assert ranked[1].after.host_need == 4 * (0.4 * 32 * GiB + 0.5 * GiB + 3.5 * GiB)

    context = remedies.Context(user_set={"NEOReadDebugKeys": "0"})
    first = remedies.remedies(outcome_for(measured, TP4), context).remedies[0]
    assert first.what.startswith("unset NEOReadDebugKeys: the plugin's driver guard then sets")

    without = remedies.remedies(outcome_for(replace(measured, plugin=False), TP4), context)
    assert "the plugin's driver guard then" not in without.remedies[0].what
    assert without.remedies[0].what.startswith("set NEOReadDebugKeys=1 EnableDeferBacking=0")


def test_an_unreadable_room_leaves_the_host_unjudged_and_says_so():
    """Unknown is unknown (issues 46, 57): the host side is not judged, never taken as no
    room, and the verdict is "not judged", never "fits"."""
    measured = replace(
        four_b70(guard_applies=True), room=Room(None, CgroupMemory(problem="denied"))
    )
    out = outcome_for(measured, TP4)
    assert out.verdict == "not judged" and out.not_judged == ("host",)
    assert advice.notes_for(measured, out, TP4) == [
        "the host's room could not be read (cgroup unreadable (denied)): not judged"
    ]


def hand_built_report() -> render.Report:
    return render.Report(
        host={
            "room": 3 * GiB,
            "room_detail": "room 3,072 MiB (hand-built)",
            "mem_total": 16 * GiB,
            "mem_available": 3 * GiB,
            "swap_total": 0,
            "swap_free": 0,
            "cgroup_current": None,
            "cgroup_max": None,
        },
        gpus={
            "intel_gpus": [],
            "visible": 0,
            "visible_battlemage": 0,
            "device_memory_bytes": None,
            "device_memory_source": "unknown",
            "compute_runtime": "not found",
            "level_zero_loader": "not found",
            "driver_guard": "does not apply: no GPU",
        },
        environment={},
        plugin={"enabled": "True", "sym_int4": "not installed", render.SELF_CHECK: "never run"},
        model=None,
        per_rank={
            "device_use": 0.0,
            "host_copy": 0.0,
            "quantization_staging": 512 * 2**20,
            "process_baseline": 3.5 * GiB,
        },
        total={"host_need": 4 * GiB, "page_cache": 0.0},
        verdict="will run out of memory",
        main_cause="process_baseline",
        why="host at load: 130% of the host's room",
        notes=["hand-built"],
    )


def test_render_writes_each_section_and_the_verdict_with_its_changes():
    text = render.render(hand_built_report(), ServeArgs(model=None))
    lines = text.splitlines()
    assert "  no Intel GPU found in sysfs" in lines
    assert "  (none of the relevant variables is set)" in lines
    assert "  enabled=True" in lines  # the long entries get lines of their own
    assert f"  {render.SELF_CHECK}: never run" in lines
    assert "  host: quant. staging   0.5 GiB" in lines  # host memory in one unit
    assert "  host: process baseline 3.5 GiB" in lines
    verdict = text[text.index("Verdict:") :].splitlines()  # wrapped at the text's width
    assert verdict[-1] == "  note: hand-built"
    assert " ".join(" ".join(verdict[:-1]).split()) == (
        "Verdict: WILL RUN OUT OF MEMORY (host at load: 130% of the host's room; main cause: "
        "process_baseline)"
    )
    assert "Model" not in lines


def test_render_json_holds_every_field():
    got = json.loads(hand_built_report().to_json())
    assert got["verdict"] == "will run out of memory" and got["model"] is None
    assert got["per_rank"]["quantization_staging"] == 512 * 2**20
