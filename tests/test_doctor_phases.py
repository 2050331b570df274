"""doctor's phase model on hand-built machines (host files), its causes and remedies, and
the JSON it prints. The machines are the mechanisms of the public record, not its cases:
tests/data/public_record holds those."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers.own_parser import own_parser
from hosts import qwen_27b_like

from vllm_xpu_memfix import cli
from vllm_xpu_memfix.startup import codes
from vllm_xpu_memfix.startup import phases as model

GiB = 1024**3
# Qwen 27B's text config (model_type qwen3_5_text in llm-scaler #703): sizes as in
# tests/hosts.qwen_27b_like, vocab 248,320.
CONFIG = {
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    directory = qwen_27b_like(tmp_path_factory.mktemp("model") / "Qwen-27B")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def machine(
    tmp_path: Path,
    gpu: str,
    count: int,
    *,
    ram: int = 128,
    kernel: str | None = "7.1.8",
    runtime: str | None = None,
    image: str | None = None,
    env: dict[str, str] | None = None,
    plugin: bool = False,
    p2p: bool | None = None,
) -> str:
    lines = ["[host]", f"ram_gib = {ram}", f"available_gib = {ram - 8}", "swap_gib = 0"]
    if kernel:
        lines.append(f'kernel = "{kernel}"')
    if p2p is not None:
        lines.append(f"p2p = {str(p2p).lower()}")
    lines += ["[[gpu]]", f'model = "{gpu}"', f"count = {count}"]
    if runtime:
        lines += ["[driver]", f'compute_runtime = "{runtime}"']
    if image:
        lines += ["[image]", f'name = "intel/llm-scaler-vllm:{image}"']
    if env:
        lines += ["[env]", *(f'{k} = "{v}"' for k, v in env.items())]
    if plugin:
        lines += ["[plugin]", "installed = true"]
    path = tmp_path / "host.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def judge(host: str, *serve: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), own_parser():
        code = cli.main(["doctor", "--host", host, "--json", "--", "vllm", "serve", *serve])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def cause(report: dict[str, Any], code: str) -> dict[str, Any]:
    (found,) = [c for c in report["causes"] if c["code"] == code]
    return found


def remedy(report: dict[str, Any], code: str) -> dict[str, Any]:
    (found,) = [r for r in report["remedies"] if r["code"] == code]
    return found


TP4_INT4 = ("-tp", "4", "--quantization", "sym_int4", "--dtype", "float16")


def test_four_b70_without_the_plugin_run_out_of_host_at_kv_cache_by_the_host_copy(tmp_path, qwen):
    report = judge(machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2"), str(qwen), *TP4_INT4)
    assert report["verdict"] == codes.RUNS_OUT
    assert report["fails_at"] == {"phase": "kv_cache", "where": "host"}
    kv = report["phases"]["kv_cache"]
    assert kv["device_gib"] == pytest.approx(0.92 * 32, abs=0.01)
    assert kv["host_gib"] == pytest.approx(4 * (0.92 * 32 + 3.5), abs=0.01)
    assert report["phases"]["load"]["host_gib"] < 120, "the load itself fits"
    copy = cause(report, codes.DRIVER_HOST_COPY)
    assert copy["gib"] == pytest.approx(4 * report["phases"]["warmup"]["device_gib"], abs=0.05)
    assert copy["gib"] == max(c["gib"] for c in report["causes"])
    # 0.26 images no longer read the variable their Dockerfile sets: one layer in flight.
    assert cause(report, codes.QUANT_STAGING)["why"].startswith("per layer:")
    assert report["remedies"][0]["code"] == codes.DRIVER_GUARD


def test_the_guard_variables_make_it_fit(tmp_path, qwen):
    guard = {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
    host = machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2", env=guard)
    report = judge(host, str(qwen), *TP4_INT4)
    assert report["verdict"] == codes.FITS and report["fails_at"] is None
    assert not [c for c in report["causes"] if c["code"] == codes.DRIVER_HOST_COPY]
    assert report["phases"]["kv_cache"]["host_gib"] == pytest.approx(14.0, abs=0.01)


def test_two_a770_on_an_old_kernel_will_fail_whatever_the_memory(tmp_path, qwen):
    host = machine(tmp_path, "Arc A770", 2, kernel="6.14.0", runtime="26.14.37833.4", p2p=True)
    report = judge(host, str(qwen), "-tp", "2", "-q", "sym_int4")
    assert report["verdict"] == codes.WILL_FAIL
    assert report["fails_at"] == {"phase": "load", "where": "device"}
    assert cause(report, codes.XE_PEER_CONTEXT_OOM)["gib"] == 0.0
    assert not [c for c in report["causes"] if c["code"] == codes.DRIVER_HOST_COPY], "Alchemist"
    fixes = {r["code"]: r["verdict_after"] for r in report["remedies"]}
    assert {codes.NO_PEER_ACCESS, codes.KERNEL_7_1, codes.COMPUTE_RUNTIME_26_27} <= set(fixes)
    assert codes.DRIVER_GUARD not in fixes, "EnableDeferBacking=0 does not help with #916"
    assert fixes[codes.KERNEL_7_1] != codes.WILL_FAIL

    on_7_1 = judge(machine(tmp_path, "Arc A770", 2, kernel="7.1.0", runtime="26.14"), str(qwen))
    assert on_7_1["verdict"] != codes.WILL_FAIL
    fixed = machine(tmp_path, "Arc A770", 2, kernel="6.14.0", runtime="26.22.38646.4")
    assert judge(fixed, str(qwen))["verdict"] != codes.WILL_FAIL
    unknown = judge(
        machine(tmp_path, "Arc A770", 2, kernel=None, runtime="26.14", p2p=True), str(qwen)
    )
    assert unknown["verdict"] != codes.WILL_FAIL, "an unknown kernel: #916 only possible"
    assert (
        "(possible: the kernel release not known"
        in cause(unknown, codes.XE_PEER_CONTEXT_OOM)["why"]
    )


def test_916_without_known_peer_access_is_possible_and_says_how_to_check(tmp_path, qwen):
    """Two GPUs, a runtime in #916's range, an old kernel, but whether the GPUs reach each
    other is not known: the failure is named as possible, with how to check; a possible
    fatal failure makes the verdict "at risk" (never will fail), with its remedies marked
    as helping if it holds (issue 45)."""
    host = machine(tmp_path, "Arc A770", 2, kernel="6.14.0", runtime="26.14.37833.4")
    report = judge(host, str(qwen), "-tp", "2", "-q", "sym_int4")
    assert report["verdict"] == codes.AT_RISK and report["fails_at"] is None
    assert report["main_cause"] == codes.XE_PEER_CONTEXT_OOM
    assert report["why"] == "compute-runtime #916 possible: peer access between the GPUs unknown"
    assert "can_device_access_peer" in cause(report, codes.XE_PEER_CONTEXT_OOM)["why"]
    fixes = {r["code"]: r for r in report["remedies"]}
    assert fixes[codes.NO_PEER_ACCESS]["what"].endswith("(if compute-runtime #916 holds)")
    assert fixes[codes.NO_PEER_ACCESS]["verdict_after"] == codes.FITS
    assert fixes[codes.NO_PEER_ACCESS]["removes"] == [codes.XE_PEER_CONTEXT_OOM]
    no_p2p = machine(tmp_path, "Arc A770", 2, kernel="6.14.0", runtime="26.14.37833.4", p2p=False)
    report = judge(no_p2p, str(qwen), "-tp", "2", "-q", "sym_int4")
    assert report["verdict"] == codes.FITS and report["why"] == ""
    assert not [c for c in report["causes"] if c["code"] == codes.XE_PEER_CONTEXT_OOM]


def test_916_on_a_distribution_kernel_before_7_1_is_only_possible(tmp_path, qwen):
    """compute-runtime #968 (2026-08-16): 2x B70 with P2P verified by ze_peer, Ubuntu's
    7.0.0-29, image 0.21.0-b3.1 (compute-runtime 26.14.37833.4) served TP 2. A distribution
    build may carry the 7.1 fix, so its kernel is not known to lack it."""
    host = machine(
        tmp_path, "Arc Pro B70", 2, kernel="7.0.0-29-generic", runtime="26.14.37833.4", p2p=True
    )
    report = judge(host, str(qwen), "-tp", "2", "-q", "sym_int4")
    assert report["verdict"] != codes.WILL_FAIL
    assert "whether distribution kernel 7.0.0-29-generic carries the xe fix" in report["why"]
    plain = machine(tmp_path, "Arc Pro B70", 2, kernel="7.0.0", runtime="26.14.37833.4", p2p=True)
    assert judge(plain, str(qwen), "-tp", "2", "-q", "sym_int4")["verdict"] == codes.WILL_FAIL


def test_0_21_b1_overcommits_the_device_with_its_second_int4_layout(tmp_path, qwen):
    host = machine(tmp_path, "Arc Pro B60", 1, image="0.21.0-b1", runtime="26.14")
    report = judge(host, str(qwen), "-q", "sym_int4")
    assert report["verdict"] == codes.RUNS_OUT
    assert report["fails_at"] == {"phase": "load", "where": "device"}
    duplicate = cause(report, codes.DUPLICATE_INT4_LAYOUT)
    assert cause(report, codes.DEVICE_OVERCOMMIT)["gib"] > 0
    newer = remedy(report, codes.NEWER_IMAGE)
    assert "0.21.0-b2" in newer["what"] and newer["verdict_after"] == codes.FITS
    assert report["remedies"][0]["code"] == codes.NEWER_IMAGE

    b2_host = machine(tmp_path, "Arc Pro B60", 1, image="0.21.0-b2", runtime="26.14")
    b2 = judge(b2_host, str(qwen), "-q", "sym_int4")
    assert b2["verdict"] == codes.FITS
    second = (
        report["model"]["device_weight_bytes_per_rank"]
        - b2["model"]["device_weight_bytes_per_rank"]
    )
    assert duplicate["gib"] == pytest.approx(second / GiB, abs=0.01) and duplicate["gib"] > 10


def test_the_legacy_load_stages_whole_shards_and_load_slots_bring_it_under(tmp_path, qwen):
    guard = {"NEOReadDebugKeys": "1", "EnableDeferBacking": "0"}
    host = machine(tmp_path, "Arc Pro B70", 4, ram=56, image="0.21.0-b2", env=guard)
    report = judge(host, str(qwen), *TP4_INT4)
    assert report["fails_at"] == {"phase": "load", "where": "host"}
    staging = cause(report, codes.QUANT_STAGING)
    assert staging["why"].startswith("whole 16-bit shard (legacy load)")
    shard = report["model"]["checkpoint_bytes"] / 4 / GiB
    assert staging["gib"] > 4 * shard
    slots = remedy(report, codes.LOAD_SLOTS)
    assert slots["verdict_after"] == codes.FITS
    n = int(slots["what"].split()[1])
    assert 1 <= n < 4 and "with vllm-xpu-memfix installed" in slots["what"]
    assert remedy(report, codes.PREQUANTIZED_CHECKPOINT)["host_need_after_gib"] < 20


def test_the_sampler_burst_runs_the_device_out_at_warmup(tmp_path, qwen):
    host = machine(tmp_path, "Arc Pro B70", 1, plugin=True)
    kv = str(15 * GiB)  # fits beside the weights, not beside them and the burst
    fixed = judge(host, str(qwen), "-q", "sym_int4", "--kv-cache-memory-bytes", kv)
    assert fixed["fails_at"] == {"phase": "warmup", "where": "device"}
    burst = cause(fixed, codes.SAMPLER_BURST)
    assert burst["why"].startswith("B=256 x vocab 248,320") and burst["gib"] > 1
    fewer = judge(host, str(qwen), "-q", "sym_int4", "--kv-cache-memory-bytes", kv,
                  "--max-num-seqs", "16")  # fmt: skip
    assert cause(fewer, codes.SAMPLER_BURST)["gib"] < burst["gib"] / 8

    off = machine(tmp_path, "Arc Pro B70", 1, plugin=True,
                  env={"VLLM_XPU_MEMFIX_KV_HEADROOM": "off"})  # fmt: skip
    high = judge(off, str(qwen), "-q", "sym_int4", "--gpu-memory-utilization", "0.99")
    assert high["fails_at"] == {"phase": "warmup", "where": "device"}
    assert remedy(high, codes.KV_HEADROOM)["what"].startswith("VLLM_XPU_MEMFIX_KV_HEADROOM=auto")
    utilization = remedy(high, codes.GPU_MEMORY_UTILIZATION)
    assert utilization["verdict_after"] == codes.FITS


def test_the_utilisation_remedy_is_the_largest_that_fits(tmp_path, qwen):
    report = judge(machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2"), str(qwen), *TP4_INT4)
    value = float(remedy(report, codes.GPU_MEMORY_UTILIZATION)["what"].split()[1])
    at = judge(
        machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2"),
        str(qwen),
        *TP4_INT4,
        "--gpu-memory-utilization",
        f"{value:.2f}",
    )
    above = judge(
        machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2"),
        str(qwen),
        *TP4_INT4,
        "--gpu-memory-utilization",
        f"{value + 0.01:.2f}",
    )
    assert at["verdict"] == codes.FITS and above["verdict"] != codes.FITS
    assert remedy(report, codes.GPU_MEMORY_UTILIZATION)["host_need_after_gib"] == pytest.approx(
        at["total"]["host_need"] / GiB, abs=0.01
    ), "the remedy's figure is the model run with the remedy"


def test_remedies_rank_those_that_fit_first_then_by_cost():
    from vllm_xpu_memfix.intel import driver
    from vllm_xpu_memfix.startup import remedies

    inputs = model.Inputs(
        tp=2,
        utilization=0.9,
        device_bytes=32 * GiB,
        gpus_in_context=2,
        battlemage_in_context=2,
        kernel=driver.kernel_from_release("6.14.0"),
        p2p=True,
        room=40 * GiB,
    )
    runtime = driver.runtime_from_version("26.14.37833.4", "test")
    out = model.run(replace(inputs, runtime=runtime))
    assert out.verdict == codes.WILL_FAIL

    judged = remedies.remedies(out)
    ranked = judged.remedies
    verdicts = [remedies._RANK[r.after.verdict] for r in ranked]
    assert verdicts == sorted(verdicts)
    fitting = [r.code for r in ranked if r.after.verdict == codes.FITS]
    assert fitting == sorted(fitting, key=remedies.COST_ORDER.index)
    assert fitting[0] == codes.NO_PEER_ACCESS  # removes both #916 and the host copy
    # 26.05 is inside #916's range: on 6.14 it still fails, but it removes the host copy
    # doctor lists, so it is listed with what it removes, after those that fit (issue 45).
    (partial,) = [r for r in ranked if r.code == codes.COMPUTE_RUNTIME_26_05]
    assert partial.after.verdict == codes.WILL_FAIL
    assert partial.removes == (codes.DRIVER_HOST_COPY,)
    assert ranked.index(partial) > len(fitting) - 1


def test_the_json_keeps_todays_keys_and_adds_the_phase_model(tmp_path, qwen):
    report = judge(machine(tmp_path, "Arc Pro B70", 4, image="0.26.0-b2"), str(qwen), *TP4_INT4)
    old = {"host", "gpus", "environment", "plugin", "model", "per_rank", "total", "verdict",
           "main_cause", "notes"}  # fmt: skip
    new = {"fails_at", "phases", "causes", "remedies", "assumed", "not_modelled", "machine",
           "why", "not_judged", "not_helping", "serve_line"}  # fmt: skip
    assert set(report) == old | new
    assert report["verdict"] in codes.VERDICTS
    assert list(report["phases"]) == list(codes.PHASES)
    for phase in report["phases"].values():
        assert set(phase) == {"host_gib", "device_gib"}
        assert all(isinstance(v, float) for v in phase.values())
    for item in report["causes"]:
        assert set(item) == {"code", "gib", "why"} and item["code"] in codes.CAUSES
    for item in report["remedies"]:
        assert {"code", "what", "cost", "host_need_after_gib"} <= set(item)
        assert item["code"] in codes.REMEDIES and item["verdict_after"] in codes.VERDICTS


def test_docs_name_every_code():
    docs = (Path(__file__).parent.parent / "docs" / "doctor.md").read_text()
    for code in (*codes.CAUSES, *codes.REMEDIES):
        assert f"`{code}`" in docs, code
    troubleshooting = (Path(__file__).parent.parent / "docs" / "troubleshooting.md").read_text()
    for code in (*codes.CAUSES, *codes.REMEDIES):
        if code not in (codes.PROCESS_BASELINE, codes.CONTAINER_LIMIT):
            assert f"`{code}`" in troubleshooting, code


def test_docs_give_every_image_row_with_its_load_layouts_and_runtime():
    """docs/doctor.md's image table says what catalog.IMAGES holds, row for row."""
    from vllm_xpu_memfix.intel import catalog

    text = (Path(__file__).parent.parent / "docs" / "doctor.md").read_text()
    rows = {}
    section = text.split("### llm-scaler images doctor knows", 1)[1].splitlines()
    table = next(i for i, line in enumerate(section) if line.startswith("| image tag"))
    for line in section[table + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for tag in cells[0].split(","):
            rows[tag.split()[0]] = cells
    assert set(rows) == {image.tag for image in catalog.IMAGES}
    for image in catalog.IMAGES:
        _tag, load, layouts, runtime, _source = rows[image.tag]
        assert load.startswith("legacy" if image.load == "legacy" else "per layer"), image.tag
        assert layouts.startswith("2" if image.duplicate_layout else "1"), image.tag
        assert runtime.startswith(image.compute_runtime or "unknown"), image.tag


def test_the_plugins_no_peer_access_counts_as_what_it_sets(tmp_path, qwen):
    """With the plugin installed and VLLM_XPU_MEMFIX_DRIVER_ENV=no_peer_access, doctor
    judges the environment the guard leaves (ForceZe...=0, not EnableDeferBacking=0):
    neither #916 nor the host copy."""
    host = machine(
        tmp_path,
        "Arc Pro B70",
        2,
        kernel="6.14.0-37-generic",
        runtime="26.14.37833.4",
        env={"VLLM_XPU_MEMFIX_DRIVER_ENV": "no_peer_access"},
        plugin=True,
    )
    report = judge(host, str(qwen), "-tp", "2", "-q", "sym_int4")
    assert report["verdict"] != codes.WILL_FAIL
    assert not [c for c in report["causes"] if c["code"] == codes.XE_PEER_CONTEXT_OOM]
    assert not [c for c in report["causes"] if c["code"] == codes.DRIVER_HOST_COPY]
