"""doctor reads a pasted serve line with the installed vLLM's own parser and builds its
configuration as ``vllm serve`` does (issue 51, items 1 and 2): vLLM's refusals with its
own message and the changes it accepts, the flags its parser does not know listed, the CPU
platform's defaults replaced by the model's XPU ones; doctor's own parser only without vLLM.

Real vLLM (the test bed's CPU build), in this process (imported once), on real config.json
files (tests/data/configs: Qwen/Qwen3-32B and its AWQ checkpoint), no weights, no network.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.config_models import config_models
from helpers.own_parser import COMMAND, own_parser

from vllm_xpu_memfix.cli import main
from vllm_xpu_memfix.cli.doctor import serveline, vllmline
from vllm_xpu_memfix.startup import codes
from vllm_xpu_memfix.startup.sizing import ServeArgs

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return config_models(tmp_path_factory, ("qwen3-32b", "qwen3-32b-awq"))


def doctor(*argv: str, text: bool = False) -> Any:
    """doctor in this process, on a 32 GiB device, the model sized by --params."""
    out = io.StringIO()
    flags = ["--device-memory-gib", "32", "--params", "32B"] + ([] if text else ["--json"])
    with contextlib.redirect_stdout(out):
        assert main(["doctor", *flags, "--", "vllm", "serve", *argv]) == 0
    return out.getvalue() if text else json.loads(out.getvalue())


def test_max_num_seqs_above_the_batched_tokens_is_vllms_refusal_with_what_it_accepts(models):
    report = doctor(str(models["qwen3-32b"]), "--max-num-seqs", "512",
                    "--max-num-batched-tokens", "256")  # fmt: skip
    assert report["verdict"] == codes.WILL_FAIL and report["main_cause"] == codes.VLLM_REFUSES
    said = "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)"
    assert said in report["why"] and said in report["serve_line"]["configuration"]
    assert "\n" not in report["why"] and "input_value" not in report["why"]
    fixes = {r["what"]: r for r in report["remedies"] if r["code"] == codes.VLLM_ACCEPTS}
    assert {"--max-num-batched-tokens 512", "--max-num-seqs 256"} <= set(fixes)
    assert all(r["verdict_after"] != codes.WILL_FAIL for r in fixes.values())


def test_a_q_contradicting_the_checkpoints_quantization_config_is_vllms_refusal(models):
    report = doctor(str(models["qwen3-32b-awq"]), "-q", "gptq")
    assert report["main_cause"] == codes.VLLM_REFUSES
    assert "model config (awq) does not match" in report["why"]
    (fix,) = [r for r in report["remedies"] if r["code"] == codes.VLLM_ACCEPTS]
    assert fix["what"].startswith("drop -q gptq") and fix["verdict_after"] != codes.WILL_FAIL


def test_expert_parallel_on_a_dense_model_is_vllms_refusal(models):
    """A check doctor's own rules never had: vLLM's configuration answers it."""
    report = doctor(str(models["qwen3-32b"]), "--enable-expert-parallel")
    assert report["main_cause"] == codes.VLLM_REFUSES and "Number of experts" in report["why"]


def test_tp_not_dividing_the_heads_is_vllms_refusal_and_its_remedies_are_vllms(models):
    report = doctor(str(models["qwen3-32b"]), "-tp", "5")
    assert report["main_cause"] == codes.VLLM_REFUSES and "(64)" in report["why"]
    # vLLM's message only: the model's own heads rule is for TPs vLLM did not check
    assert [c["code"] for c in report["causes"]].count(codes.VLLM_REFUSES) == 1
    tps = [r["what"].split(":")[0] for r in report["remedies"] + report["not_helping"]]
    assert "--tensor-parallel-size 4" in tps and "--tensor-parallel-size 8" in tps


def test_an_accepted_line_is_built_by_vllm_and_names_its_parser_and_what_it_ignored(models):
    report = doctor(str(models["qwen3-32b"]), "--enforce-eager", "--bogus-flag", "3",
                    "--max-model-len", "8192")  # fmt: skip
    line = report["serve_line"]
    assert line["parser"] == f"vLLM {vllmline.installed()}'s parser"
    assert line["configuration"].startswith("built by vLLM")
    assert line["unknown"] == ["--bogus-flag 3"]
    assert report["not_modelled"] == ["--enforce-eager"]
    assert report["main_cause"] != codes.VLLM_REFUSES
    text = doctor(str(models["qwen3-32b"]), "--bogus-flag", "3", text=True)
    assert "not read (unknown to the parser): --bogus-flag 3" in text
    assert f"read by vLLM {vllmline.installed()}'s parser" in text


def test_the_cpu_platforms_defaults_are_not_taken_for_an_intel_gpu(models, monkeypatch):
    """vLLM's CPU platform sets 128 sequences, 2048 tokens and a KV cache from
    VLLM_CPU_KVCACHE_SPACE; the model judges an Intel GPU, so it keeps its XPU defaults
    (None) unless the line gives them, and says so."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    line = ["vllm", "serve", str(models["qwen3-32b"])]
    reading = vllmline.read(line, {}, "0.32.0")
    args = reading.args
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (
        None, None, None)  # fmt: skip
    assert "cpu platform" in reading.defaults and "--max-num-seqs" in reading.defaults
    given = vllmline.read([*line, "--max-num-seqs", "64"], {}, "0.32.0").args
    assert given.max_num_seqs == 64 and given.refused == ()


def test_a_configuration_vllm_cannot_reach_is_not_a_refusal(tmp_path):
    report = doctor(str(tmp_path / "elsewhere" / "Qwen3-8B"), "-tp", "2")
    assert report["main_cause"] != codes.VLLM_REFUSES
    assert report["serve_line"]["configuration"].startswith("not built by vLLM")


COMMON = [
    ("-tp", "2", "--max-model-len", "8192"),
    ("--gpu-memory-utilization", "0.8", "--max-num-seqs", "64"),
    ("--kv-cache-dtype", "fp8", "--max-num-batched-tokens", "4096", "--enforce-eager"),
    ("--max-model-len", "32k", "--dtype", "float16"),
    ("--max-model-len=auto", "--port", "8000"),
]
FIELDS = ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
          "max_num_batched_tokens", "kv_cache_dtype", "max_model_len_fitted",
          "enable_expert_parallel", "pipeline_parallel_size")  # fmt: skip


@pytest.mark.parametrize("flags", COMMON, ids=" ".join)
def test_vllms_parser_and_doctors_own_read_common_lines_alike(flags, models):
    """Where the line gives a field, both give the same; where it leaves it, vLLM gives
    its resolution (the model's own context, for one) and doctor's own parser None."""
    line = ["vllm", "serve", str(models["qwen3-32b"]), *flags]
    own, _ = serveline.read(line, ServeArgs(None))
    reading = vllmline.read(line, {}, "0.32.0")
    assert reading.configuration.startswith("built by vLLM"), reading.configuration
    vllms = reading.args
    for name in FIELDS:
        if getattr(own, name) != getattr(ServeArgs(None), name):
            assert getattr(vllms, name) == getattr(own, name), name
    assert vllms.dtype == (own.dtype or "bfloat16")
    assert {f.split()[0] for f in vllms.not_modelled} == {f.split()[0] for f in own.not_modelled}


def test_doctors_own_flags_join_vllms_reading_of_the_line_and_must_agree(models):
    line = ["vllm", "serve", str(models["qwen3-32b"]), "--max-num-seqs", "64"]
    args = vllmline.read(line, {"tensor_parallel_size": 2}, "0.32.0").args
    assert (args.tensor_parallel_size, args.max_num_seqs) == (2, 64)
    with pytest.raises(serveline.ServeLineError, match="max_num_seqs is 8 in doctor's flags"):
        vllmline.read(line, {"max_num_seqs": 8}, "0.32.0")
    with pytest.raises(serveline.ServeLineError, match="names no model"):
        vllmline.read(["vllm", "serve", "-tp", "2"], {}, "0.32.0")
    with pytest.raises(serveline.ServeLineError, match="vLLM's parser: argument"):
        vllmline.read([*line, "-tp", "two"], {}, "0.32.0")


def test_without_vllm_doctor_says_it_used_its_own_parser(models):
    with own_parser():
        report = doctor(str(models["qwen3-32b"]), "--max-num-seqs", "512",
                        "--max-num-batched-tokens", "256", "--port", "8000")  # fmt: skip
    assert report["serve_line"]["parser"] == vllmline.OWN_PARSER
    assert report["serve_line"]["unknown"] == ["--port 8000"]
    assert report["main_cause"] != codes.VLLM_REFUSES  # doctor's own rules know no such check


def test_a_line_judged_for_another_vllm_is_read_by_doctors_own_parser(models):
    out = io.StringIO()
    flags = ["--device-memory-gib", "32", "--params", "32B", "--json", "--image", "0.26.0-b2"]
    with contextlib.redirect_stdout(out):
        assert main(["doctor", *flags, "--", "vllm", "serve", str(models["qwen3-32b"]),
                     "-tp", "5"]) == 0  # fmt: skip
    report = json.loads(out.getvalue())
    assert "judged for vLLM 0.26.0" in report["serve_line"]["parser"]
    assert report["main_cause"] == codes.VLLM_REFUSES  # doctor's own heads rule
    assert "vllm/config/model.py" in report["why"]


def test_doctors_own_parser_never_imports_vllm(models):
    code = (
        "import sys, contextlib, io; from vllm_xpu_memfix.cli.doctor import vllmline; "
        "vllmline.installed = lambda: None; from vllm_xpu_memfix.cli import main; "
        "out = io.StringIO(); ctx = contextlib.redirect_stdout(out); ctx.__enter__(); "
        f"main(['doctor', '--params', '8B', '--', 'vllm', 'serve', '{models['qwen3-32b']}']); "
        "ctx.__exit__(None, None, None); print('vllm' in sys.modules)"
    )
    result = subprocess.run(
        [COMMAND[0], "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"
