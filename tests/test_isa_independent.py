"""A line judged on an AVX2-only host and on an AVX-512-BF16 (or AMX) host gets the same
answer: doctor's whole JSON, verdict and figures, is the same with torch's CPU probes forced
each way (helpers/cpu_isa.py). vLLM's CPU platform answers differently on those CPUs (the
mamba state's dtype, MLA's block size: tests/test_kv_layout.py); an XPU host judged here
must not take either answer (issue 57, class 3).

The lines are the public record's (tests/data/public_record), run through doctor's real
command line as test_public_record.py runs them; the hybrid one is also judged on the
recorded Qwen3-Next config.json, whose linear-attention state is what the BF16 probe
changes."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import cpu_isa
from test_public_record import argv_for, doctor, load, write_host

CONFIGS = Path(__file__).parent / "data" / "configs"
CASES = (
    "llm-scaler-590-2xb60-35b-a3b-fp8-tp2",  # a hybrid MoE, sized from --params
    "llm-scaler-578-4xb60-lfm2-tp4",  # a hybrid with --mamba-ssm-cache-dtype
    "first-try-moe-30b-a3b-bf16-tp2-2xb60",  # config.json in the model's directory
)
FORCED = ("avx2", "avx512_bf16", "amx")
CONTEXT = "context_exceeds_kv_cache"


def _judged(argv: list[str], home: Path, isa: str) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        cpu_isa.force(env, isa)
        status, out, err = doctor(argv, home)
    assert status in (0, 1), err
    return json.loads(out)


@pytest.mark.parametrize("case", CASES)
def test_a_public_line_gets_the_same_answer_on_every_cpu(case, tmp_path):
    argv = argv_for(case, "reported", tmp_path)
    answers = {isa: _judged(argv, tmp_path, isa) for isa in FORCED}
    assert answers["avx2"]["verdict"] in {"fits", "at risk", "will run out of memory"}
    for isa in FORCED[1:]:
        assert answers[isa] == answers["avx2"], isa


def _hybrid_line(tmp_path: Path) -> list[str]:
    """llm-scaler #590's serve line on the recorded Qwen3-Next config (a hybrid)."""
    case = "llm-scaler-590-2xb60-35b-a3b-fp8-tp2"
    model = tmp_path / "model" / "Qwen3-Next-80B-A3B-Instruct"
    model.mkdir(parents=True)
    shutil.copy(CONFIGS / "qwen3-next-80b-a3b.json", model / "config.json")
    line = shlex.split(load(case, "case.toml")["serve"]["line"])
    line[2] = str(model)
    return line


def test_a_hybrid_on_an_xpu_host_gets_the_same_kv_cache_on_every_cpu(tmp_path):
    """At its own 262,144 context the KV cache cannot hold one sequence: the tokens it holds
    (the state's bytes decide them) are in the cause and the remedy, and must not move."""
    host = write_host(
        load("llm-scaler-590-2xb60-35b-a3b-fp8-tp2", "host.toml"), tmp_path / "h.toml"
    )
    line = [t for t in _hybrid_line(tmp_path) if t not in ("--max-model-len", "8192")]
    argv = ["doctor", "--host", str(host), "--json", "--params", "40B", "--", *line]
    answers = {isa: _judged(argv, tmp_path, isa) for isa in FORCED}
    assert CONTEXT in {c["code"] for c in answers["avx2"]["causes"]}
    for isa in FORCED[1:]:
        assert answers[isa] == answers["avx2"], isa


@pytest.mark.xfail(
    strict=True,
    reason="a described CPU host (gpu = []) is built by the vLLM here, whose CPU platform "
    "stores the mamba state as float32 where this CPU has AVX-512 BF16: the described "
    "host's CPU is not known, this one's answers (issue 57 class 3)",
)
def test_a_hybrid_on_a_described_cpu_host_gets_the_same_kv_cache_on_every_cpu(tmp_path):
    host = tmp_path / "cpu.toml"
    host.write_text("gpu = []\n[host]\nram_gib = 62\nswap_gib = 0\n")
    line = [t for t in _hybrid_line(tmp_path) if t not in ("--max-model-len", "8192")]
    argv = ["doctor", "--host", str(host), "--json", "--params", "40B"]
    argv += ["--device-memory-gib", "24", "--", *line]
    answers = {isa: _judged(argv, tmp_path, isa) for isa in ("avx2", "avx512_bf16")}
    assert CONTEXT in {c["code"] for c in answers["avx2"]["causes"]}
    assert answers["avx512_bf16"] == answers["avx2"]
