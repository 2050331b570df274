"""doctor on the #703 settings (sparse 27B-like checkpoint, constructed 4x B70 host) and on
the test-bed model on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hosts import B70, build_host, qwen_27b_like

GiB = 1024**3
# A kernel with the xe fix (7.1), so that compute-runtime #916 does not decide these cases.
KERNEL = "7.1.8-generic"
ISSUE_703 = [
    "--tensor-parallel-size",
    "4",
    "--gpu-memory-utilization",
    "0.92",
    "--quantization",
    "sym_int4",
    "--dtype",
    "float16",
]


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_XPU_MEMFIX")
        and k not in ("NEOReadDebugKeys", "EnableDeferBacking")
    }
    return subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", "doctor", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def issue_703(tmp_path_factory):
    base = tmp_path_factory.mktemp("703")
    host = build_host(
        base / "host", [B70] * 4, mem_total_gib=128, mem_available_gib=120, kernel=KERNEL
    )
    model = qwen_27b_like(base / "Qwen-27B")
    return host, model


def test_sparse_checkpoint_costs_no_disk_but_reads_as_27b(issue_703):
    from vllm_xpu_memfix.memory.checkpoint import read_checkpoint

    _, model = issue_703
    ckpt = read_checkpoint(model)
    assert len(ckpt.shards) == 18 and ckpt.dtype == "BF16"
    assert 45 * GiB < ckpt.total_bytes < 55 * GiB
    on_disk = sum(os.stat(p).st_blocks * 512 for p in ckpt.shards)
    assert on_disk < 10 * 1024**2


def test_703_without_the_guard_predicts_exhaustion_by_the_driver_host_copy(issue_703):
    host, model = issue_703
    started = time.monotonic()
    result = doctor(
        str(model),
        *ISSUE_703,
        "--json",
        VLLM_XPU_MEMFIX_SYSROOT=str(host),
        VLLM_XPU_MEMFIX_DRIVER_ENV="off",
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 10
    report = json.loads(result.stdout)
    assert report["verdict"] == "will run out of memory"
    assert report["main_cause"] == "driver_host_copy"
    # 0.92 x 32 GiB per rank pinned on the host, four ranks: the ">120 GB spike".
    assert report["per_rank"]["host_copy"] == pytest.approx(0.92 * 32 * GiB)
    assert report["total"]["host_need"] > 117 * GiB
    assert any("EnableDeferBacking=0" in r["what"] for r in report["remedies"])
    assert report["gpus"]["visible_battlemage"] == 4


def test_703_with_the_guard_the_verdict_changes(issue_703):
    host, model = issue_703
    result = doctor(str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_SYSROOT=str(host))
    report = json.loads(result.stdout)
    assert report["gpus"]["driver_guard"].startswith(
        "sets NEOReadDebugKeys=1 EnableDeferBacking=0: 4 Battlemage GPUs visible"
    )
    assert report["per_rank"]["host_copy"] == 0
    assert report["verdict"] == "fits"
    assert report["per_rank"]["quantization_staging"] > 0, (
        "sym_int4 on a bf16 checkpoint stages on the host"
    )


def test_a_container_limit_is_the_room_the_verdict_checks(issue_703, tmp_path):
    """The 703 command fits the host's 120 GiB with the guard on; in a container with 8 GiB
    left under its cgroup v2 limit it does not, and doctor reports the room the load lock and
    the ledger read (memory.room), container limit included."""
    from vllm_xpu_memfix.memory.room import host_room

    _, model = issue_703
    host = build_host(
        tmp_path / "host", [B70] * 4, mem_total_gib=128, mem_available_gib=120, kernel=KERNEL
    )
    cgroup = host / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text(f"{64 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{56 * GiB}\n")
    report = json.loads(
        doctor(str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_SYSROOT=str(host)).stdout
    )
    room = host_room(host)
    assert report["host"]["room"] == room.bytes == 8 * GiB
    assert report["host"]["room_detail"] == room.describe(GiB)  # doctor's unit for host memory
    assert report["total"]["mem_available"] == 120 * GiB
    assert report["verdict"] == "will run out of memory"
    assert any("raise the container's memory limit" in r["what"] for r in report["remedies"])
    text = doctor(str(model), *ISSUE_703, VLLM_XPU_MEMFIX_SYSROOT=str(host)).stdout
    assert f"against the {room.describe(GiB)}" in " ".join(text.split())  # wrapped or not


def test_703_human_report(issue_703):
    host, model = issue_703
    result = doctor(
        str(model),
        *ISSUE_703,
        VLLM_XPU_MEMFIX_SYSROOT=str(host),
        VLLM_XPU_MEMFIX_DRIVER_ENV="off",
    )
    out = result.stdout
    assert "card1 0000:03:00.0 0xe223 Arc Pro B70" in out
    assert "compute-runtime 26.14.37833.4-1~24.04 (dpkg: intel-opencl-icd)" in out
    assert (  # the verdict wraps at the text's width; no range it rests on bears on it (the
        # host copy is of the device filled to the utilisation, whatever the activations)
        "Verdict: WILL RUN OUT OF MEMORY (host at kv_cache: 110% of the host's room; main "
        "cause: driver_host_copy)" in " ".join(out.split())
    )
    assert "  kv_cache  host   131.8 GiB   device   29.4 GiB  <- runs out on the host" in out
    assert "not modelled" not in out, "doctor's own flags are all modelled"
    assert "host: driver copy      29.4 GiB" in out
    verdict = out.index("Verdict:")
    assert "  - " not in out[verdict:], "the remedies are listed once, with their outcome"


def test_offload_before_quant_adds_the_whole_shard(issue_703):
    host, model = issue_703
    plain = json.loads(
        doctor(str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_SYSROOT=str(host)).stdout
    )
    held = json.loads(
        doctor(
            str(model),
            *ISSUE_703,
            "--json",
            VLLM_XPU_MEMFIX_SYSROOT=str(host),
            VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT="1",
        ).stdout
    )
    shard = plain["model"]["checkpoint_bytes"] / 4
    extra = held["per_rank"]["quantization_staging"] - plain["per_rank"]["quantization_staging"]
    assert extra == pytest.approx(shard)
    (staging,) = [c for c in held["causes"] if c["code"] == "quant_staging"]
    assert staging["why"].startswith("whole 16-bit shard (legacy load)")


def test_test_bed_model_on_this_machine_gives_a_sane_report(tiny_model):
    result = doctor(str(tiny_model))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # No Intel GPU here: the device is not judged, so never "fits" (issue 57, class 2).
    assert "Verdict: NOT JUDGED" in out and "Verdict: FITS" not in out
    assert "driver guard sets nothing: no Intel GPU visible under" in out
    assert "Host (this machine)\n  RAM " in out


def test_bad_model_directory_is_a_clear_error(tmp_path):
    result = doctor(str(tmp_path))
    assert result.returncode == 2
    assert f"doctor: {tmp_path} holds no *.safetensors files" in result.stderr
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4)
    result = doctor(str(tmp_path))
    assert result.returncode == 2 and "too short to be a safetensors file" in result.stderr


def test_bad_utilisation_is_refused():
    result = doctor("--gpu-memory-utilization", "1.5")
    assert result.returncode == 2
    assert "'1.5' is not valid; accepted values: a number above 0 and at most 1" in result.stderr


def fake_vllm(root, sym_int4_source: str | None):
    """A vLLM tree for doctor to scan (through PYTHONPATH), with or without a sym_int4."""
    package = root / "vllm"
    (package / "model_executor/layers/quantization").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if sym_int4_source is not None:
        (package / "model_executor/layers/quantization/sym_int4.py").write_text(sym_int4_source)
    return str(root)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("def create_weights(layer): ...\n", "is stale: this sym_int4 never reads it"),
        (None, "no sym_int4 is installed here to read it"),
    ],
)
def test_the_offload_variable_adds_nothing_where_no_sym_int4_reads_it(
    issue_703, tmp_path, source, reason
):
    """The 0.26 images still set the variable but no longer read it (llm-scaler #672)."""
    host, model = issue_703
    path = fake_vllm(tmp_path, source)
    plain = json.loads(
        doctor(
            str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_SYSROOT=str(host), PYTHONPATH=path
        ).stdout
    )
    stale = json.loads(
        doctor(
            str(model),
            *ISSUE_703,
            "--json",
            VLLM_XPU_MEMFIX_SYSROOT=str(host),
            PYTHONPATH=path,
            VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT="1",
        ).stdout
    )
    assert stale["per_rank"]["quantization_staging"] == plain["per_rank"]["quantization_staging"]
    assert reason in stale["model"]["staging"]
    assert not any("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT" in r["what"] for r in stale["remedies"])


def test_the_load_lock_changes_the_verdict_of_a_legacy_load_and_is_recommended_when_off(
    tmp_path,
):
    """TP 4 on a host with 40 GiB available: four ~12 GiB shards at once do not fit; the
    lock sizes its slots from that room (0.8 x 40 GiB holds two ranks' staging, from
    startup.staging), and two at a time do. With the lock off, doctor recommends vLLM's own
    flag."""
    host = build_host(
        tmp_path / "host", [B70] * 4, mem_total_gib=56, mem_available_gib=40, kernel=KERNEL
    )
    model = qwen_27b_like(tmp_path / "Qwen-27B")
    reads = "import os\nLEGACY = os.environ.get('VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT') == '1'\n"
    env = {
        "VLLM_XPU_MEMFIX_SYSROOT": str(host),
        "PYTHONPATH": fake_vllm(tmp_path / "tree", reads),
        "VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT": "1",
    }
    locked = json.loads(doctor(str(model), *ISSUE_703, "--json", **env).stdout)
    unlocked = json.loads(
        doctor(str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_LOAD_LOCK="off", **env).stdout
    )
    staging = locked["per_rank"]["quantization_staging"]
    assert staging > locked["model"]["checkpoint_bytes"] / 4
    assert unlocked["total"]["host_need"] - locked["total"]["host_need"] == pytest.approx(
        2 * staging
    )
    assert "the load lock lets 2 of 4 ranks stage at once" in locked["model"]["staging"]
    assert (
        unlocked["verdict"] == "will run out of memory" and locked["verdict"] != unlocked["verdict"]
    )
    (slots,) = [r for r in unlocked["remedies"] if r["code"] == "load_slots"]
    # Two at once leave the host at risk; the remedy is the most slots with which it fits.
    assert locked["verdict"] == "at risk"
    assert slots["what"].startswith("--max-parallel-loading-workers 1: 1 rank(s) stage at once")
    assert slots["verdict_after"] == "fits"
    assert slots["host_need_after_gib"] * GiB == pytest.approx(
        locked["total"]["host_need"] - staging, 1e-3
    )
    (fewer,) = [r for r in locked["remedies"] if r["code"] == "load_slots"]
    assert fewer["what"] == slots["what"]
    with_flag = json.loads(
        doctor(
            str(model),
            *ISSUE_703,
            "--max-parallel-loading-workers",
            "2",
            "--json",
            VLLM_XPU_MEMFIX_LOAD_LOCK="auto",
            **env,
        ).stdout
    )
    assert "lets 2 of 4 ranks" in with_flag["model"]["staging"]


def test_an_moe_side_is_the_unit_staged_when_it_is_larger_than_any_linear_layer(tmp_path):
    from vllm_xpu_memfix.memory.checkpoint import read_checkpoint, write_sparse_checkpoint
    from vllm_xpu_memfix.startup.sizing import largest_staged_params

    hidden, inter, experts = 1024, 512, 16
    tensors = {"model.embed_tokens.weight": ("BF16", (4096, hidden))}
    for e in range(experts):
        p = f"model.layers.0.mlp.experts.{e}."
        tensors.update(
            {
                p + "gate_proj.weight": ("BF16", (inter, hidden)),
                p + "up_proj.weight": ("BF16", (inter, hidden)),
                p + "down_proj.weight": ("BF16", (hidden, inter)),
            }
        )
    tensors["model.layers.0.self_attn.q_proj.weight"] = ("BF16", (2048, hidden))
    write_sparse_checkpoint(tmp_path / "moe", tensors, shards=1)
    params, unit = largest_staged_params(read_checkpoint(tmp_path / "moe"))
    assert unit == "an MoE side" and params == experts * 2 * inter * hidden
