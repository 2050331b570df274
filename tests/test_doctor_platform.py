"""The user's vLLM and platform, not this machine's (issue 57, class 3 and 4; items 4's).

- A refusal is vLLM's own only where the vLLM here is the release judged for and resolves
  the platform judged for: an XPU host (a host file with Intel GPUs, or ``--image``) judged
  on this CPU test bed is read by doctor's own parser, and vLLM is not imported; a CPU host
  (``gpu = []``) is read by the real vLLM, whose CPU platform's answers then count.
- A failure of vLLM here (its import, an inspection that fails in its subprocess for a
  package missing here: torchvision is not installed on the test bed) is "not built".
- ``--image TAG`` and ``[image] name`` are one input: the image's variables
  (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``) count either way.

Real vLLM (the test bed's CPU build) on real config.json files (tests/data/configs:
Qwen/Qwen3-32B and its AWQ checkpoint); no weights, no network.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.config_models import config_models
from test_doctor_host import B70_HOST

from vllm_xpu_memfix.cli import main
from vllm_xpu_memfix.cli.doctor import vllmline
from vllm_xpu_memfix.startup import codes

CPU_HOST = "gpu = []\n" + B70_HOST.split("[[gpu]]")[0]
# Qwen3-32B's own context is 40,960 tokens; vLLM refuses a longer one unless
# VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which every llm-scaler image's Dockerfile sets.
LONG = ("--max-model-len", "65536")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return config_models(tmp_path_factory, ("qwen3-32b", "qwen3-32b-awq"))


@pytest.fixture
def hosts(tmp_path: Path) -> dict[str, str]:
    found = {}
    for name, text in {
        "xpu": B70_HOST,
        "cpu": CPU_HOST,
        "xpu-image": B70_HOST + '\n[image]\nname = "0.21.0-b2"\n',
    }.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        found[name] = str(path)
    return found


def doctor(*argv: str, line: tuple[str, ...] = ()) -> dict[str, Any]:
    out = io.StringIO()
    flags = ["--json", "--device-memory-gib", "32", "--params", "32B", *argv]
    with contextlib.redirect_stdout(out):
        assert main(["doctor", *flags, "--", "vllm", "serve", *line]) == 0
    return json.loads(out.getvalue())


def test_an_xpu_host_is_not_refused_for_what_only_the_cpu_platform_refuses(models, hosts):
    """vLLM 0.32's CPU platform declines ``-q awq_marlin`` on an AWQ checkpoint (AutoAWQ's
    override_quantization_method returns None on CPU, auto_awq.py) where XPU takes it."""
    pytest.importorskip("vllm")
    line = (str(models["qwen3-32b-awq"]), "-q", "awq_marlin")
    cpu = doctor("--host", hosts["cpu"], line=line)
    assert cpu["main_cause"] == codes.VLLM_REFUSES and "does not match" in cpu["why"]
    assert cpu["serve_line"]["parser"] == f"vLLM {vllmline.installed()}'s parser"
    xpu = doctor("--host", hosts["xpu"], line=line)
    assert xpu["main_cause"] != codes.VLLM_REFUSES
    assert "on xpu" in xpu["serve_line"]["parser"]
    assert "not imported" in xpu["serve_line"]["parser"]


def test_an_xpu_host_judged_here_never_imports_vllm(models, hosts):
    code = (
        "import sys, contextlib, io; from vllm_xpu_memfix.cli import main; "
        "out = io.StringIO(); ctx = contextlib.redirect_stdout(out); ctx.__enter__(); "
        f"main(['doctor', '--host', {hosts['xpu']!r}, '--params', '32B', '--', 'vllm', "
        f"'serve', {str(models['qwen3-32b'])!r}, '-tp', '4']); "
        "ctx.__exit__(None, None, None); print('vllm' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"


def test_vllm_failing_to_import_here_is_not_a_refusal(models, monkeypatch):
    pytest.importorskip("vllm")

    def broken(serve: bool) -> Any:
        import torchvision  # noqa: F401  # not installed on the test bed

    monkeypatch.setattr(vllmline, "_parser", broken)
    report = doctor(line=(str(models["qwen3-32b"]), "-tp", "5"))
    assert report["serve_line"]["parser"].startswith("doctor's own parser (vLLM")
    assert "failed to import" in report["serve_line"]["parser"]
    assert "torchvision" in report["serve_line"]["parser"]


def test_an_inspection_failing_in_vllms_subprocess_is_not_a_refusal(models, tmp_path):
    """vLLM inspects the model class in a subprocess (registry.py:_run_in_subprocess); here
    that subprocess fails as it does where the class needs torchvision, and vLLM's registry
    then raises its ValueError "failed to be inspected" (_raise_for_unsupported)."""
    pytest.importorskip("vllm")
    code = (
        "import sys; from vllm.model_executor.models import registry; "
        "registry._SUBPROCESS_COMMAND = [sys.executable, '-c', 'import torchvision']; "
        "from vllm_xpu_memfix.cli.doctor import vllmline; "
        f"r = vllmline.read(['vllm', 'serve', {str(models['qwen3-32b'])!r}], {{}}, '0.32.0'); "
        "print(r.configuration); print(r.args.refused)"
    )
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}  # no model info cached
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    configuration, refused = result.stdout.strip().splitlines()[-2:]
    assert configuration.startswith("not built by vLLM"), result.stderr[-2000:]
    assert "failed to be inspected" in configuration and refused == "None"  # not built


def test_the_image_is_one_input_whichever_way_it_is_named(models, hosts):
    line = (str(models["qwen3-32b"]), *LONG)
    bare = doctor("--host", hosts["xpu"], line=line)
    assert bare["main_cause"] == codes.VLLM_REFUSES and "40960" in bare["why"]
    named = doctor("--host", hosts["xpu-image"], line=line)
    flagged = doctor("--host", hosts["xpu"], "--image", "0.21.0-b2", line=line)
    here = doctor("--image", "0.21.0-b2", line=line)
    for report in (named, flagged, here):
        assert report["main_cause"] != codes.VLLM_REFUSES
        assert report["verdict"] == named["verdict"]
        assert report["serve_line"]["parser"] == named["serve_line"]["parser"]


def test_two_different_images_are_one_line(models, hosts, capsys):
    argv = ["doctor", "--host", hosts["xpu-image"], "--image", "0.26.0-b2", "--params", "32B"]
    assert main([*argv, "--", "vllm", "serve", str(models["qwen3-32b"])]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "give it in one place" in line and "0.26.0-b2" in line


ELSEWHERE = "/srv/models/Qwen3-8B"  # a path on the user's machine, not on this one


def test_the_fallback_checks_q_against_the_releases_methods(monkeypatch, capsys):
    """vLLM cannot build the configuration of a model not on this machine; ``-q`` is still
    checked against the installed release's QuantizationMethods, as before issue 51."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["doctor", "--params", "8B", "--", "vllm", "serve", ELSEWHERE]
    assert main([*argv, "-q", "no_such_method"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "'no_such_method' is not valid" in line and "awq_marlin" in line
    report = doctor(line=(ELSEWHERE, "-q", "awq_marlin"))
    assert report["serve_line"]["configuration"].startswith("not built by vLLM")


def test_the_fallback_lists_the_draft_model_of_speculative_decoding(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    draft = '{"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 3}'
    report = doctor(line=(ELSEWHERE, "--speculative-config", draft))
    assert report["serve_line"]["configuration"].startswith("not built by vLLM")
    (listed,) = report["not_modelled"]
    assert listed.startswith("--speculative-config") and "Qwen3-0.6B" in listed
