"""Bad input to doctor and to the model reading behind it, and the demo's attribution.

Every case asserts the exact outcome: exit code, the one line on stderr and no traceback
for a model doctor cannot read; the report's figures and notes for one it reads in part.
Headers are fuzzed with hypothesis, with the safetensors library (what vLLM loads with)
as the oracle of which files are valid.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.odd_files import fifo
from hosts import B70, build_host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_xpu_memfix import cli
from vllm_xpu_memfix.core import config
from vllm_xpu_memfix.memory.attribution import attribute
from vllm_xpu_memfix.memory.checkpoint import DTYPE_BITS, INDEX_NAME
from vllm_xpu_memfix.memory.ledger import Ledger
from vllm_xpu_memfix.memory.snapshot import Snapshot
from vllm_xpu_memfix.startup.staging import STAGING_BYTES_PER_PARAM

MiB = 1024**2
# A valid small checkpoint: three tensors, 35 bytes of data.
TENSORS = {"a.weight": ("F32", [2, 3]), "b.bias": ("BF16", [4]), "c": ("I8", [3])}


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]] = TENSORS) -> bytes:
    """A safetensors file as the library writes it: header padded with spaces to 8."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPE_BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + bytes(range(offset))


def with_header(header: Any, data_bytes: int) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"\0" * data_bytes


TOTAL = 35


def clean_env(**env: str) -> dict[str, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_XPU_MEMFIX", "HF_", "HUGGINGFACE"))
        and k not in ("NEOReadDebugKeys", "EnableDeferBacking")
    }
    return {**base, "HF_HUB_OFFLINE": "1", **env}


def doctor(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command in a fresh process (no Hugging Face cache unless ``env`` gives one)."""
    env.setdefault("HF_HUB_CACHE", str(Path(cwd or "/nonexistent") / "no-hf-cache"))
    return subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", "doctor", *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def doctor_in_process(*args: str) -> tuple[int, str, str]:
    """``cli.main`` in this process, for the fuzzing: any exception fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["doctor", *args])
    return code, out.getvalue(), err.getvalue()


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refusal: exit 2, nothing on stdout, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def report(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def model_dir(tmp_path: Path, shard: bytes, config_text: str | None = None) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(shard)
    if config_text is not None:
        (model / "config.json").write_text(config_text)
    return model


# --- headers checked against the file -------------------------------------------------------


def test_a_valid_file_reads_exactly(tmp_path):
    model = model_dir(tmp_path, safetensors_bytes())
    got = report(doctor(str(model), "--json"))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    assert got["model"]["size_from"] == "safetensors headers"


def _shard_refusal(tmp_path: Path, shard: bytes) -> str:
    model = model_dir(tmp_path, shard)
    line = refused(doctor(str(model)))
    prefix = f"doctor: {model / 'model.safetensors'}: "
    assert line.startswith(prefix), line
    return line.removeprefix(prefix)


def entry(dtype: str = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    ("header", "data_bytes", "reason"),
    [
        # The "10^12 bytes reported from a 100-byte file".
        (
            {"a": entry(shape=[250_000_000_000], offsets=[0, 10**12])},
            8,
            "the tensors cover 1000000000000 bytes of a data section of 8 bytes",
        ),
        # The reversed offsets (negative bytes).
        ({"a": entry(offsets=[8, 0])}, 8, "tensor 'a': data_offsets [8, 0] end before they begin"),
        ({"a": entry(offsets=[0, 12])}, 12, "data_offsets [0, 12] span 12 bytes, but F32 x [2]"),
        (
            {"a": entry(), "b": entry(offsets=[4, 12])},
            12,
            "tensor 'b': data_offsets [4, 12] overlap the previous tensor",
        ),
        (
            {"a": entry(offsets=[4, 12])},
            12,
            "tensor 'a': data_offsets [4, 12] leave a gap before them",
        ),
        ({"a": entry()}, 16, "the tensors cover 8 bytes of a data section of 16 bytes"),
        ({"__metadata__": ["x"], "a": entry()}, 8, "__metadata__ is a list, not an object"),
        ({"__metadata__": {"k": 1}, "a": entry()}, 8, "__metadata__['k'] is a int, not a string"),
        ({"a": [1, 2]}, 8, "tensor 'a' is a list, not an object"),
        ({"a": {"dtype": "F32", "shape": [2]}}, 8, "tensor 'a' has no data_offsets"),
        ({"a": {"shape": [2], "data_offsets": [0, 8]}}, 8, "tensor 'a' has no dtype"),
        ({"a": entry(dtype="F31")}, 8, "tensor 'a' has an unknown dtype 'F31'"),
        ({"a": entry(shape=[-2])}, 8, "shape '[-2]' is not a list of integers >= 0"),
        ({"a": entry(shape=[2.0])}, 8, "shape '[2.0]' is not a list of integers >= 0"),
        ({"a": entry(shape=[True, 2])}, 8, "is not a list of integers >= 0"),
        ({"a": entry(offsets=[0])}, 8, "data_offsets '[0]' are not two integers >= 0"),
        ({"a": entry(offsets=[0, 2**64 + 8])}, 8, "are not two integers >= 0"),
        ({"a": entry(dtype="F4", shape=[3], offsets=[0, 2])}, 2, "is not a whole number of bytes"),
        ([1, 2], 0, "the header is a JSON list, not an object"),
    ],
)
def test_a_header_that_breaks_a_rule_is_refused_with_the_rule(tmp_path, header, data_bytes, reason):
    assert reason in _shard_refusal(tmp_path, with_header(header, data_bytes))


def test_a_header_length_past_the_end_of_the_file_is_refused(tmp_path):
    shard = safetensors_bytes()
    shard = struct.pack("<Q", 1000) + shard[8:]
    assert _shard_refusal(tmp_path, shard) == (
        f"header length 1000 points past the end of the file ({len(shard)} bytes)"
    )
    huge = struct.pack("<Q", 2**63) + shard[8:]
    assert _shard_refusal(tmp_path / "2", huge) == (
        f"header length {2**63} is above safetensors' limit of 100000000"
    )


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b'{"a": ', "the safetensors header is not JSON (Expecting"),
        (b'{"a": NaN}', "the safetensors header is not JSON (NaN is not JSON)"),
        (b'{"\xff": 1}', "the safetensors header is not UTF-8"),
        (b"[" * 100_000, "the safetensors header is not JSON"),
    ],
)
def test_a_header_that_is_not_json_is_refused(tmp_path, blob, reason):
    shard = struct.pack("<Q", len(blob)) + blob
    assert _shard_refusal(tmp_path, shard).startswith(reason)


def test_a_file_name_with_a_newline_still_gives_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "bad\nname.safetensors").write_bytes(b"\x01")
    line = refused(doctor(str(model)))
    assert line == f"doctor: {model}/bad\\nname.safetensors: too short to be a safetensors file"


def test_a_fifo_is_never_opened(tmp_path):
    """A named pipe as a shard or as config.json would block a read forever."""
    model = model_dir(tmp_path, safetensors_bytes())
    fifo(model / "config.json")
    fifo(model / "extra.safetensors")
    got = report(doctor(str(model), "--json"))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    assert "refused config.json: not a regular file" in got["notes"]


# --- fuzzing: random corruptions of a valid file ------------------------------------------


def safetensors_verdict(path: Path) -> tuple[int, int] | None:
    """The safetensors library's own reading: (tensors, their bytes), or None if it refuses."""
    safetensors = pytest.importorskip("safetensors")
    try:
        with safetensors.safe_open(str(path), "np") as f:
            slices = [f.get_slice(name) for name in f.keys()]  # noqa: SIM118 (safe_open is no dict)
            sizes = [math.prod(s.get_shape()) * DTYPE_BITS[s.get_dtype()] // 8 for s in slices]
    except Exception:
        return None
    return len(sizes), sum(sizes)


def assert_doctor_agrees(directory: Path) -> None:
    """Exit 0 with exactly the library's size, or exit 2 with one line: nothing else."""
    shard = directory / "model.safetensors"
    verdict = safetensors_verdict(shard)
    code, out, err = doctor_in_process(str(directory), "--json")
    if verdict is not None and verdict[0]:
        assert code == 0, err
        assert json.loads(out)["model"]["checkpoint_bytes"] == verdict[1]
        return
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    if verdict is None:
        assert err.startswith(f"doctor: {shard}: "), err
    else:  # a valid file with no tensor: nothing to serve
        assert err == f"doctor: {directory}: its safetensors files hold no tensors\n"


FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VALID = safetensors_bytes()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_random_bytes_in_the_header_never_mislead(tmp_path_factory, changes):
    data = bytearray(VALID)
    for position, value in changes:
        data[position] = value
    directory = tmp_path_factory.mktemp("bytes")
    (directory / "model.safetensors").write_bytes(bytes(data))
    assert_doctor_agrees(directory)


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.binary(max_size=16))
def test_truncated_or_extended_files_are_refused(tmp_path_factory, keep, tail):
    directory = tmp_path_factory.mktemp("cut")
    (directory / "model.safetensors").write_bytes(VALID[:keep] + tail)
    assert_doctor_agrees(directory)
    if keep >= HEADER_END and keep + len(tail) != len(VALID):
        code, _, err = doctor_in_process(str(directory))
        assert code == 2 and err.count("\n") == 1, "a data section cut or grown is refused"


# Lone surrogates: Python's json takes "\ud800", safetensors' parser does not; no real
# writer emits them, so they are left out rather than matched.
NO_SURROGATES = st.characters(exclude_categories=("Cs",))
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(NO_SURROGATES, max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(NO_SURROGATES, max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", None])


@FUZZ
@given(st.sampled_from([*TENSORS, "__metadata__"]), FIELDS, JSON_VALUES)
def test_any_value_in_any_field_never_misleads(tmp_path_factory, name, field, value):
    header = json.loads(VALID[8:HEADER_END])
    if field is None or name == "__metadata__":
        header[name] = value
    else:
        header[name][field] = value
    directory = tmp_path_factory.mktemp("field")
    (directory / "model.safetensors").write_bytes(with_header(header, TOTAL))
    assert_doctor_agrees(directory)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(DTYPE_BITS)),
            st.lists(st.integers(0, 5), max_size=3),
            st.integers(-3, 3),
            st.integers(-3, 3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_offsets_off_by_a_few_bytes_never_mislead(tmp_path_factory, specs):
    """Tensors of every dtype whose offsets are nudged: the span must be shape x dtype
    and the spans must tile the data section exactly."""
    header: dict[str, Any] = {}
    offset = 0
    for i, (dtype, shape, nudge_begin, nudge_end) in enumerate(specs):
        size = math.prod(shape) * DTYPE_BITS[dtype] // 8
        begin = max(0, offset + nudge_begin)
        header[f"t{i}"] = entry(dtype, shape, [begin, max(0, offset + size + nudge_end)])
        offset += size
    directory = tmp_path_factory.mktemp("offsets")
    (directory / "model.safetensors").write_bytes(with_header(header, offset))
    assert_doctor_agrees(directory)


# --- config.json, the index, missing shards ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "refused config.json: not JSON (Expecting property name"),
        ("[1, 2]", "refused config.json: a JSON list, not an object"),
        ('"text"', "refused config.json: a JSON str, not an object"),
    ],
)
def test_a_bad_config_is_refused_and_the_weights_still_read(tmp_path, text, reason):
    model = model_dir(tmp_path, safetensors_bytes(), config_text=text)
    got = report(doctor(str(model), "--json", "--tensor-parallel-size", "3"))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    assert [n for n in got["notes"] if n.startswith("refused config.json")] == [
        n for n in got["notes"] if n.startswith(reason)
    ]
    assert any(n.startswith(reason) for n in got["notes"])


def sharded(tmp_path: Path, total_size: int | None, present: tuple[int, ...]) -> Path:
    """Two shards named by an index; only those in ``present`` written."""
    model = tmp_path / "sharded"
    model.mkdir()
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    weight_map = {"a.weight": names[0], "b.bias": names[1]}
    index: dict[str, Any] = {"weight_map": weight_map}
    if total_size is not None:
        index["metadata"] = {"total_size": total_size}
    (model / INDEX_NAME).write_text(json.dumps(index))
    shards = [{"a.weight": TENSORS["a.weight"]}, {"b.bias": TENSORS["b.bias"]}]
    for i in present:
        (model / names[i]).write_bytes(safetensors_bytes(shards[i]))
    return model


def test_missing_shards_are_reported_and_the_size_is_the_indexs(tmp_path):
    model = sharded(tmp_path, total_size=10**10, present=(0,))
    got = report(doctor(str(model), "--json"))
    assert got["model"]["checkpoint_bytes"] == 10**10, "not the smaller sum of what is there"
    assert got["model"]["size_from"] == f"{INDEX_NAME} total_size"
    assert got["model"]["shards"] == 1
    assert (
        f"could not see 1 of the 2 shards {INDEX_NAME} names: 'model-00002-of-00002.safetensors'"
    ) in got["notes"]


def test_missing_shards_without_a_total_size_are_refused(tmp_path):
    model = sharded(tmp_path, total_size=None, present=(0,))
    assert refused(doctor(str(model))) == (
        f"doctor: {model} lacks 1 of the 2 shards {INDEX_NAME} names "
        "('model-00002-of-00002.safetensors') and the index gives no total_size, so the "
        "model's size is unknown; give it with --params (e.g. --params 8B) or pass a "
        "directory that holds the weights"
    )


def test_only_the_shards_the_index_names_are_counted(tmp_path):
    """vLLM skips safetensors files the index does not name (e.g. consolidated.safetensors)."""
    model = sharded(tmp_path, total_size=32, present=(0, 1))
    (model / "consolidated.safetensors").write_bytes(safetensors_bytes())
    got = report(doctor(str(model), "--json"))
    assert got["model"]["checkpoint_bytes"] == 24 + 8
    assert got["model"]["size_from"] == "safetensors headers"
    assert (
        f"refused not named by {INDEX_NAME}, not counted: 'consolidated.safetensors'"
        in got["notes"]
    )


@pytest.mark.parametrize(
    ("index_text", "reason"),
    [
        ("{", "not JSON"),
        ('{"weight_map": []}', "no weight_map object"),
        ('{"weight_map": {"a": "../outside.safetensors"}}', "'../outside.safetensors' is not a"),
        ('{"weight_map": {"a": ["x"]}}', "\"['x']\" is not a file name"),
    ],
)
def test_a_bad_index_is_refused_and_every_file_is_counted(tmp_path, index_text, reason):
    model = model_dir(tmp_path, safetensors_bytes())
    (model / INDEX_NAME).write_text(index_text)
    got = report(doctor(str(model), "--json"))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    (note,) = [n for n in got["notes"] if n.startswith(f"refused {INDEX_NAME}")]
    assert reason in note and note.endswith("counted every *.safetensors file instead")


def test_an_empty_or_missing_model_is_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(doctor(str(empty))) == (
        f"doctor: {empty} holds no *.safetensors files, so the model's size is unknown; "
        "give it with --params (e.g. --params 8B) or pass a directory that holds the weights"
    )
    assert refused(doctor(str(tmp_path / "nope" / "x"))) == (
        f"doctor: {tmp_path / 'nope' / 'x'}: its format and size are unknown (it is not on "
        "this machine); pass a local path, or the model's size with --params (e.g. --params 8B)"
    )
    no_tensors = model_dir(tmp_path, with_header({"__metadata__": {}}, 0))
    assert refused(doctor(str(no_tensors))) == (
        f"doctor: {no_tensors}: its safetensors files hold no tensors"
    )


# --- tensor parallelism against the heads --------------------------------------------------


def heads_config(heads: int, kv_heads: int, multimodal: bool = False) -> str:
    text = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": 64}
    return json.dumps({"text_config": text} if multimodal else text)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "multimodal", "expected"),
    [
        (
            32,
            8,
            3,
            False,
            [
                "--tensor-parallel-size 3 does not divide the 32 attention heads (config.json "
                "num_attention_heads): vLLM refuses to start",
                "--tensor-parallel-size 3 and the 8 KV heads (config.json num_key_value_heads) "
                "divide neither way: vLLM refuses to start",
            ],
        ),
        (48, 8, 6, False, ["--tensor-parallel-size 6 and the 8 KV heads (config.json"]),
        (32, 8, 4, False, []),
        (32, 2, 8, False, []),  # KV heads replicated: 8 is a multiple of 2
        (40, 8, 16, True, ["--tensor-parallel-size 16 does not divide the 40 attention heads "]),
    ],
)
def test_a_tp_size_that_does_not_divide_the_heads_is_a_note(
    tmp_path, heads, kv_heads, tp, multimodal, expected
):
    model = model_dir(tmp_path, safetensors_bytes(), heads_config(heads, kv_heads, multimodal))
    got = report(doctor(str(model), "--json", "--tensor-parallel-size", str(tp)))
    notes = [n for n in got["notes"] if "tensor-parallel-size" in n and "heads" in n]
    assert len(notes) == len(expected)
    for note, start in zip(notes, expected, strict=True):
        assert note.startswith(start), note
    if multimodal:
        assert "(text_config num_attention_heads)" in notes[0]


def test_the_human_report_shows_the_heads_note(tmp_path):
    model = model_dir(tmp_path, safetensors_bytes(), heads_config(32, 32))
    out = doctor(str(model), "-tp", "3").stdout
    assert "  note: --tensor-parallel-size 3 does not divide the 32 attention heads" in out


# --- VLLM_XPU_MEMFIX_SYSROOT ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_sysroot_is_unset_not_the_current_directory(tmp_path, value):
    """The issue: an empty value rooted every look-up at the cwd ("available 0 MiB")."""
    assert config.load({"VLLM_XPU_MEMFIX_SYSROOT": value}).sysroot == Path("/")
    # A host tree in the cwd with 4 B70 and 1 GiB available must not be what doctor reads.
    build_host(tmp_path, [B70] * 4, mem_total_gib=2, mem_available_gib=1)
    got = report(doctor("--json", cwd=tmp_path, VLLM_XPU_MEMFIX_SYSROOT=value))
    assert got["gpus"]["visible_battlemage"] == 0
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert got["host"]["mem_total"] == total_kib * 1024
    at_cwd = report(doctor("--json", cwd=tmp_path, VLLM_XPU_MEMFIX_SYSROOT="."))
    assert at_cwd["gpus"]["visible_battlemage"] == 4, "an explicit '.' still reads the cwd"


# --- Hugging Face ids -----------------------------------------------------------------------

REPO = "Org/Tiny-Model"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(root: Path, files: dict[str, bytes], repo: str = REPO) -> Path:
    """huggingface_hub's cache layout: blobs, a snapshot of symlinks to them, refs/main."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    snapshot = repo_dir / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for i, (name, content) in enumerate(files.items()):
        blob = repo_dir / "blobs" / f"{i:040x}"
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return root


CONFIG = json.dumps(
    {
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "torch_dtype": "bfloat16",
    }
).encode()
INDEX = json.dumps(
    {
        "metadata": {"total_size": 16_381_470_720},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.bias": "model-00002-of-00002.safetensors",
        },
    }
).encode()


def test_an_id_whose_weights_are_cached_reads_like_a_directory(tmp_path):
    cache = hf_cache(tmp_path / "hub", {"config.json": CONFIG, "model.safetensors": VALID})
    got = report(doctor(REPO, "--json", HF_HUB_CACHE=str(cache)))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    assert got["model"]["model"] == f"{REPO} (Hugging Face cache, snapshot {REVISION[:12]})"
    assert got["model"]["directory"] == str(cache / "models--Org--Tiny-Model/snapshots" / REVISION)
    assert not [n for n in got["notes"] if n.startswith(("could not see", "refused"))]


def test_an_id_with_only_config_and_index_cached_takes_the_indexs_size(tmp_path):
    cache = hf_cache(tmp_path / "hub", {"config.json": CONFIG, INDEX_NAME: INDEX})
    result = doctor(REPO, "--json", "-tp", "3", HF_HUB_CACHE=str(cache))
    got = report(result)
    assert got["model"]["checkpoint_bytes"] == 16_381_470_720
    assert got["model"]["shards"] == 0 and got["model"]["checkpoint_dtype"] == "BF16"
    assert got["notes"][:2] == [
        f"could not see 2 of the 2 shards {INDEX_NAME} names: "
        "'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'",
        f"the checkpoint's size comes from {INDEX_NAME} total_size, not its headers",
    ]
    assert any("does not divide the 32 attention heads" in n for n in got["notes"])


def test_without_tensor_headers_the_staged_layer_comes_from_the_config(tmp_path):
    """sym_int4 stages one linear layer at a time; with only config.json and the index
    cached, the largest is hidden_size x intermediate_size, and the note says so."""
    cache = hf_cache(tmp_path / "hub", {"config.json": CONFIG, INDEX_NAME: INDEX})
    got = report(doctor(REPO, "--json", "-q", "sym_int4", HF_HUB_CACHE=str(cache)))
    assert got["per_rank"]["quantization_staging"] == 4096 * 12288 * STAGING_BYTES_PER_PARAM
    assert (
        "no tensor header read: the staged unit is a linear layer (from config.json), and "
        "every 16-bit weight is taken for a linear layer"
    ) in got["notes"]
    packed = 16_381_470_720 / 2 * 0.535  # sym_int4's one device layout per weight element
    assert got["model"]["device_weight_bytes_per_rank"] == pytest.approx(packed)


def test_an_id_with_only_config_cached_offline_is_unknown_unless_params_give_it(tmp_path):
    cache = hf_cache(tmp_path / "hub", {"config.json": CONFIG})
    snapshot = cache / "models--Org--Tiny-Model/snapshots" / REVISION
    assert refused(doctor(REPO, HF_HUB_CACHE=str(cache))) == (
        f"doctor: {REPO}: its format and size are unknown (the Hugging Face cache lacks its "
        "weights' headers; HF_HUB_OFFLINE is set, so the Hub is not asked); pass a local "
        "path, or the model's size with --params (e.g. --params 8B)"
    )
    got = report(doctor(REPO, "--json", "--params", "8B", HF_HUB_CACHE=str(cache)))
    assert got["model"]["checkpoint_bytes"] == 8 * 10**9 * 2, "bfloat16 from config.json"
    assert got["model"]["directory"] == str(snapshot)
    assert "could not see the weights (no *.safetensors file)" in got["notes"]
    assert (
        "the checkpoint's size comes from 8,000,000,000 parameters x BF16, not its headers"
        in got["notes"]
    )


def test_an_id_offline_and_not_in_the_cache_is_unknown_in_one_line(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    assert refused(doctor("Qwen/Qwen3-8B", HF_HUB_CACHE=str(cache))) == (
        "doctor: Qwen/Qwen3-8B: its format and size are unknown (Qwen/Qwen3-8B is not a local "
        f"directory and is not in the Hugging Face cache ({cache}); HF_HUB_OFFLINE is set, so "
        "the Hub is not asked); pass a local path, or the model's size with --params "
        "(e.g. --params 8B)"
    )
    got = report(doctor("Qwen/Qwen3-8B", "--json", "--params", "8.2B", HF_HUB_CACHE=str(cache)))
    assert got["model"]["checkpoint_bytes"] == 8_200_000_000 * 2
    assert got["model"]["model"] == "Qwen/Qwen3-8B (neither at hand nor read from the Hub)"
    assert got["notes"][:2] == ["could not see config.json", "could not see the weights"]


def test_hf_home_is_honoured(tmp_path):
    hf_cache(tmp_path / "home" / "hub", {"model.safetensors": VALID})
    env = {"HF_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", "doctor", REPO, "--json"],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report(result)["model"]["checkpoint_bytes"] == TOTAL


def test_a_missing_blob_counts_as_a_missing_shard(tmp_path):
    files = {"config.json": CONFIG, INDEX_NAME: INDEX, "model-00001-of-00002.safetensors": VALID}
    cache = hf_cache(tmp_path / "hub", files)
    blobs = sorted((cache / "models--Org--Tiny-Model/blobs").iterdir())
    blobs[-1].unlink()  # the shard's symlink now dangles, as after an interrupted download
    got = report(doctor(REPO, "--json", HF_HUB_CACHE=str(cache)))
    assert got["model"]["shards"] == 0 and got["model"]["checkpoint_bytes"] == 16_381_470_720


def test_without_huggingface_hub_an_id_is_one_line(tmp_path):
    """The plugin does not depend on huggingface_hub; a stub that fails to import stands
    in for an environment without it."""
    stub = tmp_path / "stub" / "huggingface_hub"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no huggingface_hub here')\n")
    line = refused(doctor(REPO, PYTHONPATH=f"{stub.parent}:{os.environ.get('PYTHONPATH', '')}"))
    assert line == (
        f"doctor: {REPO}: its format and size are unknown ({REPO} is not a local directory, "
        "and huggingface_hub (installed with vLLM) is not importable here to look it up in "
        "the Hugging Face cache); pass a local path, or the model's size with --params "
        "(e.g. --params 8B)"
    )


def test_doctor_imports_huggingface_hub_only_for_an_id():
    code = (
        "import sys, vllm_xpu_memfix.cli.doctor, vllm_xpu_memfix.memory.hub_cache\n"
        "print('huggingface_hub' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr


def test_a_path_that_exists_is_never_looked_up_as_an_id(tmp_path):
    """Org/Name that exists in the cwd as a directory is that directory (as in vLLM)."""
    local = tmp_path / "Org" / "Tiny-Model"
    local.mkdir(parents=True)
    (local / "model.safetensors").write_bytes(safetensors_bytes({"x": ("F64", [3])}))
    cache = hf_cache(tmp_path / "hub", {"model.safetensors": VALID})
    got = report(doctor(REPO, "--json", cwd=tmp_path, HF_HUB_CACHE=str(cache)))
    assert got["model"]["checkpoint_bytes"] == 24 and got["model"]["model"] == REPO


# --- --params --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [("8B", 8 * 10**9), ("8e9", 8 * 10**9), ("500m", 5 * 10**8), ("1.5T", 15 * 10**11)],
)
def test_params_alone_gives_the_size(text, count):
    got = report(doctor("--params", text, "--json", "--dtype", "float16"))
    assert got["model"]["checkpoint_bytes"] == count * 2
    assert got["model"]["model"] == "--params" and got["model"]["checkpoint_dtype"] == "F16"


@pytest.mark.parametrize("text", ["nan", "inf", "-5", "0", "8X", "", "1e300"])
def test_a_bad_params_is_refused(text):
    result = doctor("--params", text)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (
        f"vllm-xpu-memfix doctor: error: argument --params: {text!r} is not valid; accepted "
        "values: a number from 1 to 1000000000000000, optionally with K, M, B or T; "
        "see vllm-xpu-memfix doctor --help\n"
    )


def test_params_beside_readable_weights_is_ignored_with_a_note(tmp_path):
    model = model_dir(tmp_path, safetensors_bytes())
    got = report(doctor(str(model), "--params", "8B", "--json"))
    assert got["model"]["checkpoint_bytes"] == TOTAL
    assert "--params 8,000,000,000 ignored: the safetensors headers give the size" in got["notes"]


# --- the demo's attribution, on recorded ledger rows ---------------------------------------

# Recorded: the worker's ledger JSON lines of `vllm-xpu-memfix demo` (vLLM 0.32 CPU build,
# random Qwen3 of 0.4 MiB, VLLM_CPU_KVCACHE_SPACE=1) on the 2-core development VM, with the
# fields this version records (kv_cache_device, host_weight_bytes). Only the figures the
# attribution reads are kept. Other sessions ran on the VM at the time: MemAvailable fell
# 322 MiB more than the vLLM tree grew.
RECORDED_WORKER = [
    {"phase": "process start", "ts": 1796306849.708, "rss_anon": 444276736,
     "rss_file": 199041024, "mem_available": 22980018176, "cached": 4137459712,
     "tree_anon_pss": 1319956480},
    {"phase": "weights loaded", "ts": 1796306850.341, "rss_anon": 449753088,
     "rss_file": 208519168, "mem_available": 22880878592, "cached": 4137762816},
    {"phase": "weights processed", "ts": 1796306850.353, "rss_anon": 450564096,
     "rss_file": 212807680, "mem_available": 22879666176, "cached": 4137914368,
     "host_weight_bytes": 395040},
    {"phase": "KV cache sized", "ts": 1796306851.365, "rss_anon": 450412544,
     "rss_file": 213368832, "mem_available": 22758404096, "cached": 4138229760,
     "kv_cache_bytes": 1073741824, "kv_cache_device": "cpu"},
    {"phase": "KV cache allocated", "ts": 1796306851.778, "rss_anon": 1524178944,
     "rss_file": 213368832, "mem_available": 21651664896, "cached": 4138295296},
    {"phase": "warm-up done", "ts": 1796306851.782, "rss_anon": 1524187136,
     "rss_file": 213368832, "mem_available": 21651664896, "cached": 4138295296},
    {"phase": "ready", "ts": 1796306854.295, "rss_anon": 1524203520, "rss_file": 213368832,
     "mem_available": 21543333888, "cached": 4140359680, "tree_anon_pss": 2418753536},
]  # fmt: skip
SNAPSHOT_FIELDS = ("ts", "rss_anon", "rss_file", "mem_available", "cached")
EXTRA_FIELDS = ("host_weight_bytes", "kv_cache_bytes", "kv_cache_device")


def replayed_ledger(rows: list[dict[str, Any]]) -> Ledger:
    snaps = iter(Snapshot(pid=19789, **{k: row[k] for k in SNAPSHOT_FIELDS}) for row in rows)
    pss = iter([rows[0]["tree_anon_pss"], rows[-1]["tree_anon_pss"]])
    ledger = Ledger("worker-0", take=lambda _pss: next(snaps), tree_anon_pss=lambda: next(pss))
    for row in rows:
        ledger.record(row["phase"], **{k: row[k] for k in EXTRA_FIELDS if k in row})
    return ledger


def test_the_recorded_demo_does_not_blame_staging_for_the_kv_cache():
    ledger = replayed_ledger(RECORDED_WORKER)
    attribution = ledger.attribution()
    assert attribution is not None
    assert dict(attribution.known) == {"KV cache": 1073741824, "weights": 395040}
    assert attribution.anon == 1524203520 - 444276736
    assert attribution.unexplained_anon == 1524203520 - 444276736 - 1073741824 - 395040
    assert attribution.cause == "outside_no_gpu"
    assert "; ".join(ledger.summary_lines()) == (
        "attribution since process start: anon +1,030 MiB (known: KV cache 1,024 MiB, "
        "weights 0.4 MiB; unexplained +6 MiB), file +14 MiB, page cache +3 MiB, outside any "
        "process +322 MiB; likely cause: memory outside the vLLM processes: other processes "
        "on the host or the kernel (vLLM's CPU backend: no GPU driver to pin a host copy)"
    )
    first, last = ledger.entries[0], ledger.entries[-1]
    blind = attribute(first.snapshot, last.snapshot, first.tree_anon_pss, last.tree_anon_pss)
    assert blind.cause == "anon", "without the known parts: the issue's line, staging blamed"


# Recorded: a second run of the same demo on the same VM, with the host quiet ("outside any
# process" -46 MiB).
RECORDED_QUIET = [
    {"phase": "process start", "ts": 1796307194.507, "rss_anon": 444284928,
     "rss_file": 199208960, "mem_available": 22682615808, "cached": 4333924352,
     "tree_anon_pss": 1319993344},
    {"phase": "weights loaded", "ts": 1796307195.794, "rss_anon": 449716224,
     "rss_file": 208723968, "mem_available": 22677196800, "cached": 4336730112},
    {"phase": "weights processed", "ts": 1796307195.822, "rss_anon": 450514944,
     "rss_file": 213037056, "mem_available": 22677196800, "cached": 4336721920,
     "host_weight_bytes": 395040},
    {"phase": "KV cache sized", "ts": 1796307197.867, "rss_anon": 450420736,
     "rss_file": 213622784, "mem_available": 22696443904, "cached": 4336644096,
     "kv_cache_bytes": 1073741824, "kv_cache_device": "cpu"},
    {"phase": "KV cache allocated", "ts": 1796307198.424, "rss_anon": 1524170752,
     "rss_file": 213622784, "mem_available": 21635592192, "cached": 4328222720},
    {"phase": "warm-up done", "ts": 1796307198.427, "rss_anon": 1524178944,
     "rss_file": 213622784, "mem_available": 21635592192, "cached": 4328222720},
    {"phase": "ready", "ts": 1796307200.647, "rss_anon": 1524195328, "rss_file": 213622784,
     "mem_available": 21631643648, "cached": 4327219200, "tree_anon_pss": 2418753536},
]  # fmt: skip


def test_on_a_quiet_host_the_known_parts_explain_the_demos_growth():
    ledger = replayed_ledger(RECORDED_QUIET)
    attribution = ledger.attribution()
    assert attribution is not None and attribution.cause == "known"
    assert "; ".join(ledger.summary_lines()) == (
        "attribution since process start: anon +1,030 MiB (known: KV cache 1,024 MiB, "
        "weights 0.4 MiB; unexplained +6 MiB), file +14 MiB, page cache -6 MiB, outside any "
        "process -46 MiB; likely cause: the parts the ledger knows; nothing significant is "
        "unexplained"
    )


def test_growth_beyond_the_known_parts_is_still_blamed_on_staging():
    """The quiet recording with 512 MiB more RssAnon at ready (modified, not recorded)."""
    rows = [dict(row) for row in RECORDED_QUIET]
    rows[-1]["rss_anon"] += 512 * MiB
    attribution = replayed_ledger(rows).attribution()
    assert attribution is not None and attribution.cause == "anon"
    assert attribution.unexplained_anon == 1524195328 + 512 * MiB - 444284928 - 1073741824 - 395040
    assert "weight staging" in attribution.explanation


def test_a_kv_cache_on_the_device_is_not_taken_out():
    """On XPU the KV cache lives in device memory: its bytes are not host growth."""
    rows = [dict(row) for row in RECORDED_WORKER]
    rows[3]["kv_cache_device"] = "xpu"
    ledger = replayed_ledger(rows)
    assert ledger.known_host_parts() == {"weights": 395040}
    attribution = ledger.attribution()
    assert attribution is not None and attribution.cause == "anon"
