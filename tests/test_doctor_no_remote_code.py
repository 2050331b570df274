"""doctor runs no code of the checkpoint (issue 59, item 1): ``--trust-remote-code`` in a
pasted line, on a checkpoint whose config.json names its own ``configuration_*.py`` and
``modeling_*.py`` (``auto_map``), on disk and on the stand-in Hub. Each file would write a
marker when run; vLLM's path (real vLLM, the test bed's CPU build) builds the configuration
with trust_remote_code off, says why it was not built, and the line is judged on the
config's values read as data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.hub_standin import File, Server
from test_bad_input_doctor import doctor, report, safetensors_bytes

from vllm_xpu_memfix.cli.doctor import vllmline

pytest.importorskip("vllm")

CONFIG = {
    "model_type": "markermodel",
    "architectures": ["MarkerForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_marker.MarkerConfig",
        "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM",
    },
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


def code_files(marker: Path) -> dict[str, bytes]:
    """The checkpoint's own Python: each file writes ``marker`` with its name when run."""
    write = f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__name__)\n"
    config_class = (
        "from transformers import PretrainedConfig\n"
        "class MarkerConfig(PretrainedConfig):\n    model_type = 'markermodel'\n"
    )
    return {
        "configuration_marker.py": (write + config_class).encode(),
        "modeling_marker.py": write.encode(),
    }


LINE = ("--device-memory-gib", "16", "--json", "--", "vllm", "serve")


def assert_not_run(got: dict, marker: Path) -> None:
    assert not marker.exists(), f"the checkpoint's code ran: {marker.read_text()}"
    assert got["serve_line"]["configuration"] == vllmline.REMOTE_CODE
    # Judged on config.json's values, as data: its 35 bytes of weights, its own layers.
    assert got["model"]["checkpoint_bytes"] == 35
    assert got["verdict"] == "fits", got["why"]


def test_a_checkpoint_on_disk_never_runs_its_code(tmp_path):
    marker = tmp_path / "ran"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "model.safetensors").write_bytes(safetensors_bytes())
    for name, text in code_files(marker).items():
        (model / name).write_bytes(text)
    got = report(doctor(*LINE, str(model), "--trust-remote-code"))
    assert_not_run(got, marker)


def test_a_checkpoint_on_the_hub_never_has_its_code_fetched_or_run(tmp_path):
    marker = tmp_path / "ran"
    weights = safetensors_bytes()
    config = json.dumps(CONFIG).encode()
    repo = {
        "config.json": File(config, len(config), False),
        "model.safetensors": File(weights, len(weights), True),
        **{name: File(text, len(text), False) for name, text in code_files(marker).items()},
    }
    with Server({"org/marker-model": repo}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "c"), "HF_HUB_OFFLINE": "0"}
        got = report(doctor(*LINE, "org/marker-model", "--trust-remote-code", **env))
    assert_not_run(got, marker)
    assert not [path for _, path, _ in hub.requests if path.endswith(".py")]
