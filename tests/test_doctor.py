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
    host = build_host(base / "host", [B70] * 4, mem_total_gib=128, mem_available_gib=120)
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


def test_703_without_the_guard_predicts_exhaustion_by_the_driver_mirror(issue_703):
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
    assert report["main_cause"] == "driver mirror"
    # 0.92 x 32 GiB per rank pinned on the host, four ranks: the ">120 GB spike".
    assert report["per_rank"]["driver_mirror"] == pytest.approx(0.92 * 32 * GiB)
    assert report["total"]["host_need"] > 117 * GiB
    assert any("EnableDeferBacking=0" in change for change in report["changes"])
    assert report["gpus"]["visible_battlemage"] == 4


def test_703_with_the_guard_the_verdict_changes(issue_703):
    host, model = issue_703
    result = doctor(str(model), *ISSUE_703, "--json", VLLM_XPU_MEMFIX_SYSROOT=str(host))
    report = json.loads(result.stdout)
    assert report["gpus"]["driver_guard"].startswith("applies")
    assert report["per_rank"]["driver_mirror"] == 0
    assert report["verdict"] == "fits"
    assert report["per_rank"]["quantization_staging"] > 0, (
        "sym_int4 on a bf16 checkpoint stages on the host"
    )


def test_703_human_report(issue_703):
    host, model = issue_703
    result = doctor(
        str(model),
        *ISSUE_703,
        "--enable-auto-tool-choice",
        "--port",
        "8020",
        VLLM_XPU_MEMFIX_SYSROOT=str(host),
        VLLM_XPU_MEMFIX_DRIVER_ENV="off",
    )
    out = result.stdout
    assert "card1 0000:03:00.0 0xe223 Arc Pro B70" in out
    assert "compute-runtime 26.14.37833.4-1~24.04 (dpkg: intel-opencl-icd)" in out
    assert "Verdict: WILL RUN OUT OF MEMORY (largest part: driver mirror)" in out
    assert "host: driver mirror    29.4 GiB" in out
    assert "ignoring --enable-auto-tool-choice --port 8020" in result.stderr


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
    assert any("VLLM_OFFLOAD_WEIGHTS_BEFORE_QUANT" in c for c in held["changes"])


def test_test_bed_model_on_this_machine_gives_a_sane_report(tiny_model):
    result = doctor(str(tiny_model))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Verdict: FITS" in out
    assert "driver guard does not apply" in out
    assert "Host\n  RAM " in out


def test_bad_model_directory_is_a_clear_error(tmp_path):
    result = doctor(str(tmp_path))
    assert result.returncode == 2
    assert f"doctor: {tmp_path} holds no *.safetensors files" in result.stderr
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4)
    result = doctor(str(tmp_path))
    assert result.returncode == 2 and "too short to be a safetensors file" in result.stderr


def test_bad_utilisation_is_refused():
    result = doctor("--gpu-memory-utilization", "1.5")
    assert result.returncode == 2 and "must be in (0, 1]" in result.stderr
