"""issue 52: every reader of a file the plugin did not write (the ledger's rows for the
OOM-kill line, the at-ready line, ``report`` and ``plot``; config.json; host files; GGUF
headers) stays within bounded time and memory on hostile input (deep nesting, huge
integers, huge totals, non-UTF-8, FIFOs), and a value out of bounds is a counted, named
skip or one refusal, never an exception out of the reader.

Memory is tracemalloc's peak of the Python heap during the read; the bounds are generous
for a loaded machine yet far below what the unbounded readers took (a 12 MiB ledger file
read whole is over 24 MiB; 200k empty GGUF arrays built as lists are over 10 MiB)."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.odd_files import fifo, within

from vllm_xpu_memfix.cli import plot
from vllm_xpu_memfix.cli.doctor import hostfile
from vllm_xpu_memfix.core import bounded
from vllm_xpu_memfix.core.process import start_identity
from vllm_xpu_memfix.memory import checkpoint, gguf, ledger_files, oom_victim

MiB = 2**20
# The rows of this start-up (core.process.start_identity), as the OOM-kill line reads only those.
ROW = {"phase": "process start", "pid": 4, "role": "worker-0", "rank": 0, "ts": 100.0}
ROW["start"] = start_identity()
HOSTILE_LINES = {
    "nested deeper than 16": "[" * 5_000,
    "an integer of more than 20 digits": json.dumps({**ROW, "rss": 10**400}),
    "more than 10,000 values": json.dumps({**ROW, "list": [[]] * 200_000}),
    "a number beyond a float": '{"ts": 1e400, "pid": 4}',
    "not JSON": "\udcff not json",
}


def measured(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """``call()``'s result, seconds and tracemalloc peak in bytes."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, time.perf_counter() - started, peak


def refused(call: Callable[[], Any], kind: type[Exception]) -> tuple[Exception, float, int]:
    """The ``kind`` exception ``call()`` raised, with :func:`measured`'s seconds and peak."""

    def catch() -> Exception:
        with pytest.raises(kind) as raised:
            call()
        return raised.value

    return measured(catch)


def ledger_dir(tmp_path: Path, lines: list[str]) -> Path:
    directory = tmp_path / "ledger"
    directory.mkdir()
    text = "\n".join([json.dumps(ROW), *lines, json.dumps({**ROW, "ts": 101.0})]) + "\n"
    (directory / "ledger-h-1.jsonl").write_bytes(text.encode("utf-8", "surrogateescape"))
    return directory


def test_each_hostile_ledger_line_is_one_named_skip_and_the_rows_around_it_stay(tmp_path):
    directory = ledger_dir(tmp_path, list(HOSTILE_LINES.values()))
    found, seconds, peak = measured(lambda: ledger_files.read(directory))
    assert [row["ts"] for row in found.rows] == [100.0, 101.0]
    assert dict(found.skips) == dict.fromkeys(HOSTILE_LINES, 1)
    assert found.first_skip == ("ledger-h-1.jsonl", 2)
    assert seconds < 10 and peak < 16 * MiB, (seconds, peak)


def test_the_oom_kill_line_reads_past_a_huge_integer_row(tmp_path):
    """A row whose integer no float holds was kept, then float() of it raised
    OverflowError inside the OOM-kill line; now it is one skipped row."""
    directory = ledger_dir(tmp_path, [HOSTILE_LINES["an integer of more than 20 digits"]])
    rows = oom_victim.ledger_rows(directory, since=0.0)
    assert rows.skipped == 1 and [r["pid"] for r in rows.last] == [4]
    oom_victim.likely_victim(rows, RuntimeError("engine core failed"))


def test_plot_streams_a_ledger_file_and_skips_a_line_longer_than_the_cap(tmp_path):
    """plot read every ledger file whole (a 1 GiB file took 2.1 GB); it now streams."""
    directory = tmp_path / "ledger"
    directory.mkdir()
    other = json.dumps({**ROW, "role": "api_server", "note": "x" * 200}) + "\n"
    with (directory / "ledger-h-1.jsonl").open("w") as out:
        out.write(json.dumps(ROW) + "\n")
        out.write("9" * (ledger_files.LINE_CAP + 10) + "\n")
        out.write(other * (12 * MiB // len(other)))
        out.write(json.dumps({**ROW, "ts": 105.0, "phase": "ready"}) + "\n")
    fifo(directory / "ledger-h-2.jsonl")
    skipped = plot.Skipped()
    marks, seconds, peak = measured(
        lambda: within(60, lambda: plot.read_ledger_phases(directory, skipped=skipped))
    )
    assert marks == [(100.0, "process start"), (105.0, "ready")]
    assert skipped.count == 2 and skipped.first.startswith("ledger-h-1.jsonl line 2")
    assert peak < 8 * MiB, f"{peak / MiB:.1f} MiB for a 12 MiB file"
    assert seconds < 60


@pytest.mark.parametrize(
    ("content", "refusal"),
    [
        ("[" * 100_000, "nested deeper than 32"),
        ('{"num_hidden_layers": ' + "9" * 5000 + "}", "an integer of more than 20 digits"),
        ('{"a": [' + "[]," * 2_000_000 + "[]]}", "more than 1,000,000 values"),
        ('{"a": 1e999}', "a number beyond a float"),
        (b'{"a": "\xff"}', "not UTF-8"),
    ],
)
def test_config_json_out_of_bounds_is_one_refusal(tmp_path, content, refusal):
    (tmp_path / "config.json").write_bytes(
        content if isinstance(content, bytes) else content.encode()
    )
    (config, why), seconds, peak = measured(lambda: checkpoint.read_config(tmp_path))
    assert config == {} and why == f"config.json: {refusal}"
    assert seconds < 10 and peak < 32 * MiB, (seconds, peak)


def test_a_fifo_as_config_json_is_refused_without_blocking(tmp_path):
    fifo(tmp_path / "config.json")
    config, why = within(10, lambda: checkpoint.read_config(tmp_path))
    assert config == {} and why == "config.json: a FIFO, not a regular file"


@pytest.mark.parametrize(
    ("content", "refusal"),
    [
        ("a = " + "[" * 2000, "nested or numbered beyond a host file"),
        ("a = " + "9" * 5000, "nested or numbered beyond a host file"),
        ("a = [" + "1," * 400_000 + "1]", "more than 10,000 values; not a host file"),
        ("a = " + "[" * 20 + "1" + "]" * 20, "nested deeper than 8; not a host file"),
        (b"[host]\nram_gib = \xff\n", "is not UTF-8 text, so not TOML"),
    ],
)
def test_a_hostile_host_file_is_one_refusal(tmp_path, content, refusal):
    path = tmp_path / "host.toml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    error, seconds, peak = refused(lambda: hostfile.load(path), hostfile.HostFileError)
    assert str(error) == f"{path}: {refusal}"
    assert seconds < 10 and peak < 16 * MiB, (seconds, peak)


def test_a_host_file_is_refused_in_bounded_time(tmp_path):
    """tomllib takes seconds for 400k values: they are counted before it parses."""
    path = tmp_path / "host.toml"
    path.write_text("a = [" + "1," * 400_000 + "1]")
    started = time.perf_counter()
    with pytest.raises(hostfile.HostFileError):
        hostfile.load(path)
    assert time.perf_counter() - started < 5


def _gguf(pairs: list[tuple[str, bytes]]) -> bytes:
    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value)) + value.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs))
    return head + b"".join(text(key) + value for key, value in pairs)


def test_a_gguf_header_is_bounded_in_total_not_only_per_count(tmp_path, monkeypatch):
    """Each count was capped, the total not: a 120 MB header of empty arrays took 34 s and
    735 MB. Arrays are now passed over, never built, and the header's reads are capped."""
    monkeypatch.setattr(gguf, "MAX_READS", 100_000)
    arrays = 200_000
    empty = struct.pack("<I", 9) + struct.pack("<IQ", 9, arrays) + struct.pack("<IQ", 0, 0) * arrays
    path = tmp_path / "empty-arrays.gguf"
    path.write_bytes(_gguf([("x", empty)]))
    error, seconds, peak = refused(lambda: gguf.read(path), gguf.GgufError)
    assert str(error) == "the header takes more than 100,000 reads"
    assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB"
    assert seconds < 30


def test_a_gguf_vocabulary_is_counted_not_held(tmp_path):
    tokens = 50_000
    pieces = b"".join(struct.pack("<Q", 5) + b"token" for _ in range(tokens))
    arch = struct.pack("<I", 8) + struct.pack("<Q", 5) + b"llama"
    path = tmp_path / "vocab.gguf"
    path.write_bytes(
        _gguf(
            [
                ("general.architecture", arch),
                ("tokenizer.ggml.tokens", struct.pack("<IIQ", 9, 8, tokens) + pieces),
            ]
        )
    )
    (_, config), _, peak = measured(lambda: gguf.read(path))
    assert config["vocab_size"] == tokens and config["model_type"] == "llama"
    assert peak < 2 * MiB, f"{peak / MiB:.1f} MiB"


def test_a_fifo_as_a_gguf_file_is_refused_without_blocking(tmp_path):
    path = fifo(tmp_path / "model.gguf")
    with pytest.raises(gguf.GgufError, match="not a regular file"):
        within(10, lambda: gguf.read(path))


def test_bounded_json_refuses_before_building():
    """The structure is measured before json builds a value: 3M empty lists are refused
    with no list built."""
    text = "[" + "[]," * 3_000_000 + "[]]"
    error, _, peak = refused(lambda: bounded.json_value(text), bounded.OutOfBounds)
    assert str(error) == "more than 1,000,000 values"
    assert peak < 3 * len(text), f"{peak / MiB:.1f} MiB for {len(text) / MiB:.1f} MiB of text"
