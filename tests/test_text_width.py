"""The text a person reads from ``doctor``, ``check`` and ``ray-env``: prose lines of at
most 100 characters (``core/lines.py``), and each quantity in one unit, never ``-0`` and
never ``0.0`` for a figure that is not zero (``core/units.py``).

Judged on every case of the public record (tests/data/public_record), on this machine, and
on constructed hosts (tests/hosts.py) that reach the longest texts: compute-runtime #916's
warning and remedies, the sampler burst of a 27B checkpoint with its config, a container's
room. The commands run in-process through their command line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.own_parser import own_parser
from helpers.public_cases import serve_line_cases
from hosts import A770, B70, build_host, qwen_27b_like

from vllm_xpu_memfix.cli import main
from vllm_xpu_memfix.core.lines import WIDTH, wrap
from vllm_xpu_memfix.core.units import GiB, MiB, figure, rounded, size
from vllm_xpu_memfix.fixes import driver_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

CORPUS = Path(__file__).parent / "data" / "public_record"
KERNEL_6 = "6.14.0-37-generic"  # before the xe fix of compute-runtime #916
CONFIG = {  # tests/hosts.qwen_27b_like's sizes, so the sampler burst is counted
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "torch_dtype": "bfloat16",
}


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), own_parser():
        assert main(argv) == 0, argv
    return out.getvalue()


def _corpus() -> Iterator[tuple[str, list[str]]]:
    for case, data in serve_line_cases():
        serve = data["serve"]
        params = ["--params", str(serve["params"])] if "params" in serve else []
        host = ["--host", str(case / "host.toml"), *params]
        yield case.name, ["doctor", *host, "--", *shlex.split(serve["line"])]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each command's text (and doctor's JSON beside it, as ``NAME json``), by name."""
    base = tmp_path_factory.mktemp("width")
    model = qwen_27b_like(base / "Qwen-27B")
    (model / "config.json").write_text(json.dumps(CONFIG))
    container = build_host(base / "4xB70-container", [B70] * 4)
    (container / "sys/fs/cgroup").mkdir(parents=True)
    (container / "sys/fs/cgroup/memory.max").write_text(f"{64 * GiB}\n")
    (container / "sys/fs/cgroup/memory.current").write_text(f"{56 * GiB}\n")
    hosts = {
        "2x B70, kernel 6.14": build_host(base / "b70-k6", [B70] * 2, kernel=KERNEL_6),
        "2x B70, no kernel": build_host(base / "b70-nok", [B70] * 2, kernel=None),
        "2x A770, kernel 6.14": build_host(base / "a770-k6", [A770] * 2, kernel=KERNEL_6),
        "4x B70 in a container": container,
    }
    runs: dict[str, tuple[dict[str, str], list[str]]] = {
        f"doctor {name}": ({}, argv) for name, argv in _corpus()
    }
    runs["doctor on this machine"] = ({}, ["doctor", "--params", "8B"])
    runs["check on this machine"] = ({}, ["check"])
    runs["ray-env on this machine"] = ({}, ["ray-env"])
    sym_int4 = ["--quantization", "sym_int4", "--dtype", "float16"]
    for name, root in hosts.items():
        env = {"VLLM_XPU_MEMFIX_SYSROOT": str(root)}
        runs[f"doctor {name}"] = (env, ["doctor", str(model), "-tp", "2", "--max-num-seqs", "1024"])
        runs[f"doctor {name}, sym_int4, guard off"] = (
            {**env, "VLLM_XPU_MEMFIX_DRIVER_ENV": "off"},
            ["doctor", str(model), "-tp", "4", *sym_int4],
        )
        runs[f"doctor {name}, TP 8"] = (env, ["doctor", str(model), "-tp", "8"])
        runs[f"check {name}"] = (env, ["check"])
        runs[f"ray-env {name}"] = (env, ["ray-env"])
        runs[f"ray-env {name}, no_peer_access"] = (
            {**env, "VLLM_XPU_MEMFIX_DRIVER_ENV": "no_peer_access"},
            ["ray-env"],
        )
    found: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in [*driver_env.DRIVER_KEYS, "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR"]:
            patch.delenv(name, raising=False)
        for name in list(os.environ):
            if name.startswith(("VLLM_XPU_MEMFIX", "HF_", "HUGGINGFACE_")):
                patch.delenv(name)
        patch.setenv("HF_HOME", str(base / "hf"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        for name, (env, argv) in runs.items():
            with pytest.MonkeyPatch.context() as each:
                for key, value in env.items():
                    each.setenv(key, value)
                found[name] = _run(argv)
                if argv[0] == "doctor":
                    found[f"{name} json"] = _run([*argv[:1], "--json", *argv[1:]])
    return found


def prose(name: str, text: str) -> list[str]:
    """The lines of ``text`` a person reads: every line, but a path that alone is wider."""
    long_path = re.compile(rf"/\S{{{WIDTH // 2},}}")
    return [line for line in text.splitlines() if not long_path.search(line)]


def test_the_outputs_cover_the_corpus_and_the_long_texts(outputs):
    cases = [case for case, _ in serve_line_cases()]
    assert all(f"doctor {case.name}" in outputs for case in cases) and len(cases) >= 8
    joined = "\n".join(outputs.values())
    for said in ("Remedies: kernel 7.1", "sampler_burst", "cgroup limit 64.0 GiB", "Verdict"):
        assert said in joined


def test_every_line_is_at_most_100_characters(outputs):
    over = {
        name: [line for line in prose(name, text) if len(line) > WIDTH]
        for name, text in outputs.items()
        if not name.endswith(" json")
    }
    assert {name: lines for name, lines in over.items() if lines} == {}


def test_a_quantity_is_written_in_one_unit(outputs):
    """The host's and the device's memory in GiB wherever doctor writes it (the room, the
    staging, the swap), the sampler burst's peak only in its cause's GiB; never ``-0``, and
    ``0.0`` never for a figure that is not zero (zero is ``0``)."""
    for name, text in outputs.items():
        if name.endswith(" json"):
            continue
        assert not re.search(r"(?<![\w.,])-0(\.0+)? [GM]iB", text), name
        assert not re.search(r"(?<![\w.,])0\.0+ [GM]iB", text), name
        if not name.startswith("doctor "):
            continue
        report = json.loads(outputs[f"{name} json"])
        figures = [*report["per_rank"].values(), *report["total"].values()]
        figures += [report["host"][k] for k in ("mem_total", "mem_available", "swap_total")]
        for value in figures:
            if value and abs(value) >= MiB:
                assert size(value, MiB) not in text, (name, value)
        assert not re.search(r"peak [\d,.]+ MiB", text), name
    burst = " ".join("\n".join(outputs.values()).split())  # unwrapped
    assert re.search(r"sampler_burst +[\d.]+ GiB .*the peak is at torch\.sort \(", burst)


@pytest.mark.parametrize(
    ("nbytes", "unit", "written"),
    [
        (0, GiB, "0 GiB"),
        (-0.0, MiB, "0 MiB"),
        (-0.3 * MiB, MiB, "-0.30 MiB"),
        (0.3 * MiB, GiB, "0.00029 GiB"),
        (0.04 * GiB, GiB, "0.040 GiB"),
        (138 * MiB, GiB, "0.1 GiB"),
        (124_518 * MiB, GiB, "121.6 GiB"),
        (124_518 * MiB, MiB, "124,518 MiB"),
        (-1.5 * GiB, GiB, "-1.5 GiB"),
        (None, GiB, "-"),
    ],
)
def test_one_formatter_writes_every_figure(nbytes, unit, written):
    assert size(nbytes, unit) == written


def test_a_rounded_figure_is_never_zero_unless_it_is():
    assert rounded(0.0047, 2) == 0.0047 and rounded(-0.001, 2) == -0.001
    assert str(rounded(-0.0, 2)) == "0.0" and rounded(1.234, 2) == 1.23
    assert figure(-0.004, 1) == "-0.0040" and figure(0, 0) == "0"


def test_wrap_keeps_the_indent_hangs_and_never_cuts_a_word():
    line = "  note: " + " ".join(["word"] * 60)
    wrapped = wrap(line)
    assert all(len(part) <= WIDTH for part in wrapped) and len(wrapped) > 1
    assert wrapped[0].startswith("  note: ") and wrapped[1].startswith("      word")
    assert " ".join(" ".join(wrapped).split()) == " ".join(line.split())
    long_word = "x" * 200
    assert wrap(f"  path {long_word} end") == ["  path", f"      {long_word}", "      end"]
