"""startup.domain: every field of vLLM's EngineArgs classified, and the not-modelled ones
named the same way by the preflight (from EngineArgs) and by doctor (from the serve line).
Runs the installed vLLM's own parser; 0.34.0's fields come from a recorded list."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from vllm_xpu_memfix.cli.doctor import serveline
from vllm_xpu_memfix.startup import domain
from vllm_xpu_memfix.startup.sizing import ServeArgs

arg_utils = pytest.importorskip("vllm.engine.arg_utils")
cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")

RECORDED_0_34 = Path(__file__).parent / "data" / "engine_args" / "vllm-0.34.0.txt"
INSTALLED = {spec.name for spec in dataclasses.fields(arg_utils.EngineArgs)}


def recorded_0_34() -> set[str]:
    lines = RECORDED_0_34.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def parser():
    return cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    """EngineArgs.__post_init__ loads vLLM's general plugins: with this one allowed, its
    register() would patch every fix for the rest of the pytest session."""
    monkeypatch.setenv("VLLM_PLUGINS", "none")


# An existing directory: a path that is not one is taken for a Hub id, and with
# HF_HUB_OFFLINE (the suite's default) huggingface_hub refuses "/m" as a repo id.
MODEL_DIR = tempfile.TemporaryDirectory(prefix="test-domain-model-")


def engine_args(*flags: str):
    model = ["--model", MODEL_DIR.name]
    return arg_utils.EngineArgs.from_cli_args(parser().parse_args([*model, *flags]))


def test_every_field_of_the_installed_engine_args_is_classified():
    missing = sorted(INSTALLED - set(domain.DOMAIN))
    assert not missing, f"classify these EngineArgs fields in startup/domain.py: {missing}"


def test_every_field_of_0_34_is_classified_and_the_0_34_only_ones_are_marked():
    fields = recorded_0_34()
    assert len(fields) > 200, "the recorded list is the whole EngineArgs"
    assert not sorted(fields - set(domain.DOMAIN))
    assert set(domain.ONLY_IN_0_34) == fields - INSTALLED


def test_the_table_holds_no_field_that_neither_vllm_has():
    known = INSTALLED | recorded_0_34() | set(domain.FRONTEND)
    assert not sorted(set(domain.DOMAIN) - known)


def test_the_aliases_are_the_installed_parsers_own():
    actions = parser()._option_string_actions
    for flag, name in domain.ALIASES.items():
        assert actions[flag].dest == name, flag
    short = {flag for flag in actions if not flag.startswith("--")} - {"-h"}
    assert short <= set(domain.ALIASES)


def test_engine_args_at_their_defaults_name_nothing():
    assert domain.not_modelled(engine_args()) == ()
    # Only modelled and no-memory fields set: still nothing.
    args = engine_args("-tp", "2", "--max-model-len", "4096", "--port", "9000", "--seed", "3")
    assert domain.not_modelled(args) == ()


def test_not_modelled_fields_are_named_as_their_serve_flags_with_the_value():
    args = engine_args(
        "--enforce-eager", "--hf-overrides", '{"num_hidden_layers": 2}', "--max-loras", "4",
        "--kv-offloading-size", "8", "--no-enable-prefix-caching",
    )  # fmt: skip
    named = domain.not_modelled(args)
    assert set(named) == {
        "--kv-offloading-size 8.0",
        '--hf-overrides {"num_hidden_layers":2}',
        "--enforce-eager",
        "--max-loras 4",
    }
    assert [domain.side_of(flag) for flag in sorted(named)] == [
        "device", "host and device", "host", "device",
    ]  # fmt: skip


def test_each_named_flag_reads_back_through_vllms_parser_to_the_same_value():
    given = ("--enforce-eager", "--max-loras", "4", "--cpu-offload-gb", "2", "-pp", "2")
    for flag in domain.not_modelled(engine_args(*given)):
        again = engine_args(*flag.split(" ", 1))
        assert domain.not_modelled(again) == (flag,)


@pytest.mark.parametrize(
    "line",
    [
        ("-pp", "2", "--enforce-eager", "--port", "8000", "--trust-remote-code"),
        ("--cpu-offload-gb=8", "-dp", "2", "--served-model-name", "q", "--max-loras", "2"),
        ("--no-enable-prefix-caching", "--enable-lora", "--api-key", "k", "-asc", "2"),
    ],
)
def test_doctor_and_the_preflight_name_the_same_fields(line):
    def fields(flags):
        return {domain.field_of(flag.split("=")[0].split(" ")[0]) for flag in flags}

    doctor = serveline.parse(["vllm", "serve", "/m", *line], ServeArgs(model=None))
    preflight = domain.not_modelled(engine_args(*line))
    # --api-server-count is the API server's, not an EngineArgs field: doctor alone sees it.
    assert fields(doctor.not_modelled) - {"api_server_count"} == fields(preflight)


def test_docs_list_the_modelled_flags_from_the_table():
    text = (Path(__file__).parents[1] / "docs" / "doctor.md").read_text()
    for flag in domain.covered(domain.MODELLED):
        assert f"`{flag}`" in text, flag
