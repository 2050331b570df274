"""The image's vLLM (issue 51, class 5; issue 57, "the user's vLLM and platform"): a host
file's image or ``--image`` names the vLLM release the start-up will run under
(intel.catalog, from llm-scaler's Dockerfiles); ``-q`` is checked against that release's
methods, and the format against the methods its XPU platform serves, both as recorded from
its wheel (vllm_code/releases.json); a release not recorded leaves the line judged, said,
never refused. ``bitsandbytes`` is in vLLM 0.26.0's QuantizationMethods and not in 0.32.0's;
``gptq_marlin_24`` in 0.14.0's, not in 0.21.0's. vLLM's XPU platform names the methods it
serves from 0.27.0 on; before, it serves every method its release has."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from test_doctor_host import B70_HOST, doctor, host_file, refused

from vllm_xpu_memfix.cli import compat
from vllm_xpu_memfix.cli.doctor import choices
from vllm_xpu_memfix.intel import catalog
from vllm_xpu_memfix.startup import formats
from vllm_xpu_memfix.vllm_code import releases

DATA = Path(__file__).parent / "data"
ONLY_IN_0_26 = "bitsandbytes"


@pytest.fixture
def model(tmp_path: Path) -> str:
    directory = tmp_path / "qwen3-32b"
    directory.mkdir()
    shutil.copy(DATA / "configs" / "qwen3-32b.json", directory / "config.json")
    return str(directory)


@pytest.fixture
def local_lacks_it() -> None:
    names = choices.quantization_names()
    if names is None or ONLY_IN_0_26 in names:
        pytest.skip(f"the installed vLLM does not refuse -q {ONLY_IN_0_26}")


def judged(*args: str) -> dict:
    result = doctor("--json", "--params", "32.8B", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_image_names_its_vllm_and_an_alias_names_its_images():
    assert set(catalog.IMAGE_VLLM) == {image.tag for image in catalog.IMAGES}
    assert catalog.image_vllm_version("intel/llm-scaler-vllm:1.4") == "0.14.0"
    assert catalog.image_vllm_version("vllm-0.26.0-b2") == "0.26.0"
    assert catalog.image_vllm_version("latest") is None


def test_the_recorded_releases_agree_with_the_other_records_of_vllm():
    """0.34.0's fields as tests/data/engine_args recorded them apart; the installed
    release's methods as its own source gives them."""
    own = (DATA / "engine_args" / "vllm-0.34.0.txt").read_text().splitlines()
    assert releases.engine_fields("0.34.0") == {n for n in own if n and not n.startswith("#")}
    installed, root = releases.installed_version(), compat.installed_vllm_root()
    if installed not in releases.recorded() or root is None:
        pytest.skip("the installed vLLM is not a recorded release")
    source = compat.literal_strings(root, *choices.QUANTIZATION_SOURCE)
    assert releases.quantization_methods(installed) == source
    assert ONLY_IN_0_26 in (releases.quantization_methods("0.26.0") or ())


def test_a_method_of_the_images_vllm_is_judged_not_refused(tmp_path, model, local_lacks_it):
    note = f"judged for the image's vLLM 0.26.0, not the installed {releases.installed_version()}"
    line = ("--", "vllm", "serve", model, "-q", ONLY_IN_0_26)
    assert ONLY_IN_0_26 in refused(doctor("--params", "32.8B", *line))
    by_option = judged("--image", "intel/llm-scaler-vllm:0.26.0-b2", *line)
    assert note in by_option["assumed"]
    text = B70_HOST + '[image]\nname = "0.26.0-b2"\n'
    by_file = judged("--host", host_file(tmp_path, text), *line)
    assert note in by_file["assumed"]
    # doctor's own -q flag, before --, is checked the same way.
    assert judged("--image", "0.26.0-b2", model, "-q", ONLY_IN_0_26)["verdict"]


def test_a_method_the_images_vllm_lacks_is_refused_as_that_vllm_would(model):
    line = ("--", "vllm", "serve", model, "-q", "nosuch")
    assert "'nosuch'" in refused(doctor("--image", "0.26.0-b2", "--params", "32.8B", *line))


def test_a_release_not_recorded_is_assumed_never_refused():
    """vLLM 0.18.0 (no image serves it) is not recorded: its methods are not checked, and
    whether its XPU platform serves a format is assumed, never a refusal; the recorded
    0.32.0 refuses GGUF on XPU, the recorded 0.21.0 serves it."""
    gguf = formats.Format("gguf", None, True)
    with releases.judged_for("0.18.0"):
        assert choices.quantization_names() is None and gguf.xpu_refusal == ""
        assert "is not one doctor has recorded" in choices.not_checked("nosuch")
        assert "flags and XPU methods are not recorded" in choices.other_vllm_notes(())[1]
    with releases.judged_for("0.32.0"):
        assert "gguf quantization is currently not supported in xpu (vLLM 0.32.0" in (
            gguf.xpu_refusal
        )
    with releases.judged_for("0.21.0"):
        assert gguf.xpu_refusal == ""


def test_the_recorded_xpu_methods_are_the_installed_vllms_own():
    """The installed release's XPUPlatform.supported_quantization, read here from its own
    vllm/platforms/xpu.py, is the one recorded; 0.21.0's platform sets none."""
    installed, root = releases.installed_version(), compat.installed_vllm_root()
    if installed not in releases.recorded() or root is None:
        pytest.skip("the installed vLLM is not a recorded release")
    tree = ast.parse((root / "vllm" / "platforms" / "xpu.py").read_text())
    (lists,) = [
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "supported_quantization"
    ]
    assert releases.xpu_quantization(installed) == frozenset(lists)
    assert releases.xpu_quantization("0.21.0") == set(releases.quantization_methods("0.21.0") or ())


@pytest.fixture
def autoround(tmp_path: Path) -> str:
    """A 4-bit AutoRound checkpoint's config (quant_method "auto-round", as Intel's
    Qwen3.6-35B-A3B-int4-AutoRound of llm-scaler #210 has it) on Qwen3-32B's shape."""
    directory = tmp_path / "qwen3-32b-autoround"
    directory.mkdir()
    config = json.loads((DATA / "configs" / "qwen3-32b.json").read_text())
    config["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_what_intels_021_image_serves_is_judged_for_its_vllm(tmp_path, model, autoround):
    """Intel's 0.21.0-b2 image runs vLLM 0.21.0, whose XPU platform lists no methods:
    -q gptq_marlin is served there and refused by 0.32.0's XPU list (this machine's
    vLLM, judged for an XPU host); an AutoRound checkpoint is INC's in either release (it is
    sized as its 4 bits, not left unsized)."""
    host = host_file(tmp_path, B70_HOST)
    upstream = judged("--host", host, model, "-q", "gptq_marlin")
    if releases.installed_version() == "0.32.0":
        assert "not supported in xpu (vLLM 0.32.0" in upstream["why"]
    image = judged("--host", host, "--image", "0.21.0-b2", model, "-q", "gptq_marlin")
    assert "not supported in xpu" not in image["why"] and image["verdict"] != "will fail"
    rounded = judged("--host", host, "--image", "0.21.0-b2", autoround)
    assert rounded["verdict"] == "fits" and "auto-round 4-bit, group 128" in str(rounded["model"])


def test_the_recorded_release_keeps_the_q_check_in_the_fallback(model):
    """Without vLLM's parser (another release), -q is still checked against the release's
    recorded methods: exit 2 naming them, where the release lacks the method."""
    line = ("--", "vllm", "serve", model, "-q", "gptq_marlin_24")
    assert "'gptq_marlin_24'" in refused(doctor("--image", "0.21.0-b2", "--params", "32.8B", *line))
    assert judged("--image", "0.14.0-b8.2", *line)["verdict"]


def test_an_image_not_in_the_table_is_one_line():
    assert "is not in doctor's table" in refused(doctor("--image", "9.9", "--params", "8B", "m"))


def test_a_flag_the_images_vllm_lacks_is_said(model):
    """--max-num-active-seqs is in 0.32.0's EngineArgs, not in 0.26.0's (as recorded)."""
    assert "max_num_active_seqs" not in (releases.engine_fields("0.26.0") or ())
    line = ("--", "vllm", "serve", model, "--max-num-active-seqs", "4")
    out = judged("--image", "0.26.0-b2", *line)
    assert "vLLM 0.26.0 has no --max-num-active-seqs: its parser refuses the line" in out["assumed"]
    assert not any("has no" in note for note in judged(*line)["assumed"])


def test_intels_ipex_gptq_moe_adds_its_first_forward_on_the_images_that_run_it(tmp_path):
    """llm-scaler #348: IPEX's GatedMLPMOE takes about 400 MB more in each GPTQ MoE layer's
    first forward; the 0.14 images run it (their patch's XPUGPTQMarlinMoEMethod), the 0.21
    ones do not. Qwen3-30B-A3B at GPTQ 4-bit on one B70 fits under 0.21.0-b2; under
    0.14.0-b8.2.1 it is at risk, naming the transient (one layer's to all 48 layers')."""
    assert catalog.image_named("0.14.0-b8.2.1").ipex_gptq_moe
    assert not catalog.image_named("0.21.0-b2").ipex_gptq_moe
    directory = tmp_path / "qwen3-30b-a3b-gptq"
    directory.mkdir()
    config = json.loads((DATA / "configs" / "qwen3-30b-a3b.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    host = host_file(tmp_path, B70_HOST)

    def on(image: str, model: Path) -> dict:
        return json.loads(
            doctor(
                "--json", "--params", "30.5B", "--host", host, "--image", image, str(model)
            ).stdout
        )

    newer, older = on("0.21.0-b2", directory), on("0.14.0-b8.2.1", directory)
    assert newer["verdict"] == "fits" and "llm-scaler #348" not in newer["why"]
    assert older["verdict"] == "at risk" and "IPEX GatedMLPMOE" in older["why"]
    assert older["phases"]["kv_cache"]["device_gib"] > newer["phases"]["kv_cache"]["device_gib"]
    config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    assert "IPEX GatedMLPMOE" not in on("0.14.0-b8.2.1", directory)["why"]  # 16-bit: not GPTQ
