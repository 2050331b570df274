"""Every input error is one line (issue 59, item 6): ``--config`` in a pasted line, ``-tp``
of 0, negative or NaN, image references with a digest or of another repository, a host file
with a UTF-8 byte-order mark, a GPU's ``memory_gib`` bounded.

The pasted lines are read by the installed vLLM (the test bed's CPU build, imported once in
this process) on a real config.json (tests/data/configs: Qwen/Qwen3-32B); each case failed
with a traceback, or was taken, before.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from helpers.odd_files import fifo
from test_doctor_host import B70_HOST, doctor, host_file, refused

from vllm_xpu_memfix import cli
from vllm_xpu_memfix.cli.doctor import vllmline
from vllm_xpu_memfix.intel import catalog

CONFIGS = Path(__file__).parent / "data" / "configs"
DIGEST = "@sha256:" + "0123456789abcdef" * 4


def in_process(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["doctor", "--params", "32B", "--device-memory-gib", "32", *argv])
    return code, out.getvalue(), err.getvalue()


def one_line(*argv: str) -> str:
    code, out, err = in_process(*argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert len(err.splitlines()) == 1, err
    return err.strip()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("qwen3-32b")
    shutil.copy(CONFIGS / "qwen3-32b.json", directory / "config.json")
    return str(directory)


@pytest.fixture
def yaml_file(tmp_path: Path):
    def write(name: str, data: bytes) -> str:
        (tmp_path / name).write_bytes(data)
        return str(tmp_path / name)

    return write


# --- --config in a pasted line (vLLM's parser) -------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "said"),
    [
        ("tag.yaml", b"x: !!python/object/apply:os.system ['true']\n", "is not YAML vLLM reads"),
        ("list.yaml", b"- -tp\n- 2\n", "is a YAML list; vLLM takes a mapping of flag: value"),
        ("nul.yaml", b"tensor-parallel-size: 2\0\n", "unacceptable character #x0000"),
        ("c.json", b'{"tensor-parallel-size": 2}', "vLLM takes a .yaml or .yml file"),
        ("bin.yaml", b"\xff\xfe\0", "is not UTF-8 text, so not YAML"),
    ],
)
def test_a_config_file_vllm_cannot_read_is_one_line(model, yaml_file, name, data, said):
    pytest.importorskip("vllm")
    path = yaml_file(name, data)
    line = one_line("--", "vllm", "serve", model, "--config", path)
    assert line.startswith(f"doctor: --config {path!r}: ") and said in line, line


def test_a_missing_fifo_or_doubled_config_is_one_line_and_never_blocks(model, tmp_path, yaml_file):
    pytest.importorskip("vllm")
    missing = str(tmp_path / "none.yaml")
    assert one_line("--", "vllm", "serve", model, "--config", missing).endswith(": no such file")
    pipe = fifo(tmp_path / "pipe.yaml")
    line = one_line("--", "vllm", "serve", model, "--config", str(pipe))
    assert line.endswith("a FIFO, not a regular file"), line
    ok = yaml_file("ok.yaml", b"max-num-seqs: 16\n")
    twice = one_line("--", "vllm", "serve", model, "--config", ok, "--config", ok)
    assert twice == "doctor: --config is given 2 times; vLLM reads one file"


def test_a_config_file_vllm_reads_sets_the_line(model, yaml_file):
    pytest.importorskip("vllm")
    path = yaml_file("ok.yaml", b"max-num-seqs: 16\nmax-model-len: 4096\n")
    line = ["vllm", "serve", model, "--config", path]
    reading = vllmline.read(line, {}, vllmline.installed() or "")
    assert reading.configuration.startswith("built by vLLM")
    assert (reading.args.max_num_seqs, reading.args.max_model_len) == (16, 4096)


# --- -tp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", ["0", "-1"])
def test_tp_below_one_is_vllms_refusal_not_a_crash(model, tp):
    pytest.importorskip("vllm")
    code, out, err = in_process("--json", "--", "vllm", "serve", model, "-tp", tp)
    assert code == 0 and err == "", err
    got = json.loads(out)
    assert got["main_cause"] == "vllm_refuses"
    assert "greater than or equal to 1" in got["serve_line"]["configuration"]


def test_tp_nan_is_refused_by_vllms_parser_in_one_line(model):
    pytest.importorskip("vllm")
    line = one_line("--", "vllm", "serve", model, "-tp", "nan")
    assert (
        line
        == "doctor: vLLM's parser: argument --tensor-parallel-size/-tp: invalid int value: 'nan'"
    )


def test_tp_zero_on_a_configuration_vllm_cannot_reach_is_doctors_refusal(tmp_path):
    """No config.json here: vLLM builds nothing, and the line's own -tp 0 is refused."""
    pytest.importorskip("vllm")
    line = one_line("--", "vllm", "serve", str(tmp_path / "elsewhere"), "-tp", "0")
    assert line.startswith("doctor: --tensor-parallel-size '0' is not valid"), line


# --- images: Intel's by the repository name alone -------------------------------------------


@pytest.mark.parametrize(
    "reference",
    [
        f"intel/llm-scaler-vllm:0.21.0-b2{DIGEST}",
        "docker.io/intel/llm-scaler-vllm:0.21.0-b2",
        "registry.example:5000/intel/llm-scaler-vllm:vllm-0.21.0-b2",
    ],
)
def test_a_digest_or_registry_keeps_intels_image(reference):
    image = catalog.image_named(reference)
    assert image is not None and image.tag == "0.21.0-b2"


OTHERS = ["nvidia/cuda:0.21.0-b2", "intel/llm-scaler-vllm-x:0.21.0-b2", "evil/intel/llm-scaler-vllm:0.21.0-b2"]  # fmt: skip  # noqa: E501


@pytest.mark.parametrize("reference", OTHERS)
def test_another_repository_is_not_intels_image_whatever_its_tag(reference):
    assert catalog.image_named(reference) is None
    line = refused(doctor("--image", reference, "--params", "8B"))
    assert line == (
        f"doctor: --image: image {reference!r} is not Intel's llm-scaler image "
        "(intel/llm-scaler-vllm:TAG, or TAG)"
    )


# --- host files --------------------------------------------------------------------------------


def test_a_host_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "host.toml"
    path.write_bytes(b"\xef\xbb\xbf" + B70_HOST.encode())
    result = doctor("--host", str(path), "--params", "8B", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["machine"] == str(path)


@pytest.mark.parametrize("memory", ["1e-9", "0.5"])
def test_a_gpus_memory_below_one_gib_is_refused(tmp_path, memory):
    path = host_file(tmp_path, f"[[gpu]]\nmodel = 'B70'\nmemory_gib = {memory}\n")
    line = refused(doctor("--host", path))
    assert "[[gpu]] #1 memory_gib:" in line and "accepted: a number from 1 to 1024 (GiB)" in line
