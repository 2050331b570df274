"""issue 52 item 7: doctor refuses a config.json that is no model's, naming the field and
the file (exit 2), where it used to drop the bad size and judge the model without it."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from vllm_xpu_memfix import cli


def doctor(model: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["doctor", str(model), "--json"])
    return code, out.getvalue(), err.getvalue()


def edited(tiny_model: Path, tmp_path: Path, **changes: object) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        section = config
        *parents, leaf = key.split("__")
        for parent in parents:
            section = section.setdefault(parent, {})
        section[leaf] = value
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_the_clean_model_is_judged(tiny_model, tmp_path):
    code, out, err = doctor(edited(tiny_model, tmp_path))
    assert code == 0, err
    assert json.loads(out)["model"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hidden_layers", -64),
        ("num_hidden_layers", "64"),
        ("num_hidden_layers", 10**12),
        ("hidden_size", 64.0),
        ("max_position_embeddings", True),
        ("num_key_value_heads", 0),
    ],
)
def test_a_size_that_is_no_models_is_one_refusal_naming_field_and_file(
    tiny_model, tmp_path, field, value
):
    model = edited(tiny_model, tmp_path, **{field: value})
    code, out, err = doctor(model)
    assert (code, out) == (2, "")
    assert err == (
        f"doctor: {model / 'config.json'}: {field} {value!r} is not valid; "
        "accepted: an integer from 1 to 2,147,483,647\n"
    )


def test_text_config_sizes_are_checked_too(tiny_model, tmp_path):
    model = edited(tiny_model, tmp_path, text_config__num_hidden_layers=-1)
    code, _, err = doctor(model)
    assert code == 2 and "text_config.num_hidden_layers -1 is not valid" in err


@pytest.mark.parametrize(("method", "bits"), [("gptq", 3), ("gptq", "4"), ("awq", 8)])
def test_bits_vllm_builds_no_layer_for_are_refused(tiny_model, tmp_path, method, bits):
    model = edited(
        tiny_model,
        tmp_path,
        quantization_config__quant_method=method,
        quantization_config__bits=bits,
        quantization_config__group_size=128,
    )
    code, _, err = doctor(model)
    assert code == 2
    assert f"quantization_config.bits {bits!r} is not valid for {method}" in err
