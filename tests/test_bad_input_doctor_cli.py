"""doctor's command line under hostile input (issue 38, and issue 36's serve-line points).

Input files are regular files up to a cap, refused in one line otherwise; ``--write-host``
never writes through a link or over a file it was not told to replace; the text report
cannot be forged by what a file or the environment holds; unknown options are refused; the
round trip ``--write-host`` then ``--host`` holds for every value it writes; a described
machine's ``[env]`` is judged as that machine's; doctor's own flags and the pasted serve
line mean the same; and docs/commands.md names exactly the CLI's commands and options.
"""
# ruff: noqa: E501  (the tables of bad input read best one case a line)

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
from helpers.odd_files import fifo, within
from helpers.own_parser import own_parser
from hosts import B70, build_host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_xpu_memfix.cli import build_parser, main
from vllm_xpu_memfix.cli.doctor import choices, described, facts, hostfile, serveline
from vllm_xpu_memfix.core import config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parent.parent
B70_HOST = '[host]\nram_gib = 128\nkernel = "7.1.8"\n\n[[gpu]]\nmodel = "Arc Pro B70"\ncount = 2\n'
FEW = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)`` in this process, argparse's exits
    included; the environment is a clean one (no plugin variable, no Hugging Face cache);
    doctor's own serve-line parser, as without vLLM (its tests are these)."""
    out, err = io.StringIO(), io.StringIO()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_XPU_MEMFIX", "HF_"))}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(
        {**clean, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent", **(env or {})}
    )
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), own_parser():
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code  # type: ignore[assignment]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def refused(code: int, stdout: str, stderr: str) -> str:
    assert code == 2, (code, stdout, stderr)
    assert stdout == "" and "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# --- --host FILE: regular files only, up to a cap ----------------------------------------------


def _huge(path: Path) -> Path:
    with path.open("wb") as f:
        f.truncate(4 * 1024**3)  # sparse: 4 GiB that cost no disk
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: Path("/dev/zero"), "a character device, not a regular file"),
        (fifo, "a FIFO, not a regular file"),
        (_huge, "4,096 MiB: too large (at most 1 MiB)"),
        (lambda d: d.mkdir() or d, "a directory, not a regular file"),
    ],
    ids=["dev-zero", "fifo", "4-GiB", "directory"],
)
def test_a_host_file_that_is_not_a_small_regular_file_is_one_line_within_a_second(
    tmp_path, make, says
):
    path = make(tmp_path / "h.toml")
    started = time.monotonic()
    line = refused(*within(10, lambda: run("doctor", "--host", str(path), "--params", "8B")))
    assert time.monotonic() - started < 1.0
    assert line == f"doctor: {path}: {says}"


def test_plot_and_doctor_refuse_the_same_files_with_the_same_words(tmp_path):
    pipe = fifo(tmp_path / "x")
    assert refused(*within(10, lambda: run("plot", str(pipe)))) == (
        f"plot: {pipe}: a FIFO, not a regular file"
    )


@pytest.mark.parametrize("option", ["--host", "--write-host"])
def test_an_empty_path_is_refused(option):
    line = refused(*run("doctor", option, "", "--params", "8B"))
    assert f"argument {option}: an empty path" in line


# --- --write-host FILE ---------------------------------------------------------------------------


def test_write_host_writes_through_a_temporary_file_with_mode_0644_and_says_so(tmp_path):
    target = tmp_path / "this.toml"
    old = os.umask(0o077)
    try:
        code, out, err = run("doctor", "--params", "8B", "--json", "--write-host", str(target))
    finally:
        os.umask(old)
    assert code == 0, err
    json.loads(out)  # stdout stays the report alone
    assert err.splitlines()[-1] == f"doctor: wrote {target}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["this.toml"], "no temporary left"
    hostfile.load(target)


def test_write_host_never_replaces_a_file_without_force(tmp_path):
    target = tmp_path / "this.toml"
    target.write_text("mine\n")
    line = refused(*run("doctor", "--params", "8B", "--write-host", str(target)))
    assert line == f"doctor: {target}: exists; not replaced without --force"
    assert target.read_text() == "mine\n"
    code, _, err = run("doctor", "--params", "8B", "--write-host", str(target), "--force")
    assert code == 0, err
    assert target.read_text().startswith("# This machine as vllm-xpu-memfix doctor read it")


@pytest.mark.parametrize("force", [False, True])
def test_write_host_never_writes_through_a_symlink(tmp_path, force):
    victim = tmp_path / "victim"
    victim.write_text("kept\n")
    link = tmp_path / "this.toml"
    link.symlink_to(victim)
    line = refused(
        *run("doctor", "--params", "8B", "--write-host", str(link), *(["--force"] if force else []))
    )
    assert line == f"doctor: {link}: a symlink (to {victim}), not a regular file; not written"
    assert victim.read_text() == "kept\n" and link.is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_write_host_refuses_a_fifo_or_a_device_at_once(tmp_path, kind):
    path = fifo(tmp_path / "f") if kind == "fifo" else Path("/dev/null")
    line = refused(
        *within(10, lambda: run("doctor", "--params", "8B", "--write-host", str(path), "--force"))
    )
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert line == f"doctor: {path}: {what}, not a regular file; not written"


# --- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--write-hots", "x.toml", "--params", "8B"],
        ["doctor", "--jsn", "--params", "8B"],
        ["doctor", "--params", "8B", "--enforce-eager"],
        ["doctor", "--params", "8B", "--json", "x", "y"],
    ],
)
def test_an_unknown_option_is_refused_and_nothing_is_written(tmp_path, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(*run(*argv))
    assert "unrecognized arguments" in line and line.endswith("--help")
    assert list(tmp_path.iterdir()) == []


# --- the text report ------------------------------------------------------------------------------


def test_the_text_report_escapes_what_a_file_or_the_environment_holds(tmp_path):
    forged = "0,1\r\nVerdict: FORGED\x1b[2J\x07\u202e"
    huge = "9" * 100_000
    text = B70_HOST + f"\n[env]\nZE_AFFINITY_MASK = {json.dumps(forged)}\n"
    text += f"ONEAPI_DEVICE_SELECTOR = {json.dumps('level_zero:' + huge)}\n"
    path = tmp_path / "h\nVerdict: FORGED.toml"
    path.write_text(text)
    code, out, err = run("doctor", "--host", str(path), "--params", "8B")
    assert code == 0, err
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out and "\u202e" not in out
    assert not any(line.startswith("Verdict: FORGED") for line in out.splitlines())
    assert "ZE_AFFINITY_MASK=0,1\\r\\nVerdict: FORGED\\x1b[2J\\x07\\u202e" in out
    assert max(len(line) for line in out.splitlines()) < 2_000, "100 KB strings are cut"
    assert "… (100,011 chars)" in " ".join(out.split())  # the cut value's mark, maybe wrapped
    code, out, _ = run("doctor", "--host", str(path), "--params", "8B", "--json")
    assert json.loads(out)["environment"]["ZE_AFFINITY_MASK"] == forged, "JSON as it is"


# --- the round trip -------------------------------------------------------------------------------


VERSIONS = st.one_of(
    st.from_regex(
        r"\A[0-9]{2}\.[0-9]{1,2}(\.[0-9]{1,9}(\.[0-9]{1,9})?)?([-+~][0-9A-Za-z.+~-]{0,12})?\Z"
    ),
    st.from_regex(r"\A1\.[0-9]{1,3}\.[0-9]{1,9}(\.[0-9]{1,4})?(-[0-9a-z~.]{0,8})?\Z"),
    # what a status file can hold: any text but a lone surrogate, and undecodable bytes
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\n\r"), max_size=20),
    st.binary(max_size=20).map(
        lambda b: b.replace(b"\n", b"").replace(b"\r", b"").decode("utf-8", "surrogateescape")
    ),
)
ENV_VALUE = st.one_of(
    st.text(max_size=20),  # any code point: controls, quotes, backslashes, astral
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "surrogateescape")),
)
ENV_NAMES = [
    "NEOReadDebugKeys",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
    "CCL_TOPO_P2P_ACCESS",
]


@FEW
@given(
    version=VERSIONS,
    environ=st.dictionaries(st.sampled_from(ENV_NAMES), ENV_VALUE, max_size=4),
    osrelease=st.sampled_from(["6.14.0-37-generic", "7.1.8+deb13-amd64", "linux", "6." + "9" * 99]),
    lib_build=st.none() | st.from_regex(r"\A[0-9]{1,9}\Z"),
)
def test_write_host_then_host_reads_back_every_value_it_writes(
    tmp_path_factory, version, environ, osrelease, lib_build
):
    root = build_host(
        tmp_path_factory.mktemp("host"), [B70, B70], runtime=None, lib_build=lib_build
    )
    (root / "var/lib/dpkg/status").write_text(
        f"Package: intel-opencl-icd\nStatus: install ok installed\nVersion: {version}\n",
        encoding="utf-8",
        errors="surrogateescape",
    )
    (root / "proc/sys/kernel/osrelease").write_text(osrelease + "\n")
    settings_ = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root)})
    measured = facts.measure(settings_, facts.ServeArgs(model=None, params=8 * 10**9), environ)
    text = described.write_host(measured)
    back = hostfile.parse(tomllib.loads(text), "h.toml")

    runtime = measured.runtime
    if runtime is None:
        assert back.runtime is None
    else:
        assert back.runtime is not None
        assert (back.runtime.version, back.runtime.build, back.runtime.release) == (
            runtime.version,
            runtime.build,
            runtime.release,
        )
    kernel = measured.kernel
    if kernel is not None and kernel.version is not None:
        assert back.kernel is not None
        assert (back.kernel.release, back.kernel.version) == (kernel.release, kernel.version)
    else:
        assert back.kernel is None
    as_toml = {
        k: re.sub("[\ud800-\udfff]", "\ufffd", v) for k, v in environ.items()
    }  # TOML holds no lone surrogate: each undecodable byte is U+FFFD
    assert back.env == as_toml
    assert back.ram == measured.snap.mem_total and back.available == measured.room.mem_available
    assert [(g.device_id, g.count, g.memory_bytes) for g in back.gpus] == [
        (0xE223, 2, 32 * 1024**3)
    ]


def test_an_unknown_gpu_without_a_vram_file_reads_back_with_its_memory_unknown(tmp_path):
    root = build_host(tmp_path, [(0x8086, 0x7D55)], vram_gib=None)  # an iGPU: no VRAM file
    settings_ = config.load({"VLLM_XPU_MEMFIX_SYSROOT": str(root)})
    measured = facts.measure(settings_, facts.ServeArgs(model=None, params=8 * 10**9), {})
    back = hostfile.parse(tomllib.loads(described.write_host(measured)), "h.toml")
    assert [(g.device_id, g.memory_bytes) for g in back.gpus] == [(0x7D55, None)]
    assert any("its memory is unknown" in line for line in back.assumed)


# --- a described machine's [env] ------------------------------------------------------------------


def test_a_described_machines_paths_are_never_looked_up_here(tmp_path):
    here = tmp_path / "a-file-here"  # a directory there, maybe
    here.write_text("")
    text = B70_HOST + (
        '\n[env]\nVLLM_XPU_MEMFIX_SYSROOT = "/only/on/that/machine"\n'
        f'VLLM_XPU_MEMFIX_LEDGER_DIR = "{here}"\n'
        'VLLM_XPU_MEMFIX_LOCK_DIR = "/run/user/1000/locks"\n'
        "\n[plugin]\ninstalled = true\n"
    )
    path = tmp_path / "h.toml"
    path.write_text(text)
    code, out, err = run("doctor", "--host", str(path), "--params", "8B", "--json")
    assert code == 0, err
    assert json.loads(out)["machine"] == str(path)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('VLLM_XPU_MEMFIX_LOAD_LOCK = "maybe"', "VLLM_XPU_MEMFIX_LOAD_LOCK='maybe' is not valid"),
        (
            'VLLM_XPU_MEMFIX_LOCK_DIR = "relative"',
            "VLLM_XPU_MEMFIX_LOCK_DIR='relative' is not valid",
        ),
    ],
)
def test_a_bad_value_in_a_described_env_names_the_file_and_the_table(tmp_path, line, says):
    path = tmp_path / "h.toml"
    path.write_text(B70_HOST + f"\n[env]\n{line}\n\n[plugin]\ninstalled = true\n")
    refusal = refused(*run("doctor", "--host", str(path), "--params", "8B"))
    assert refusal.startswith(f"doctor: {path}: [env] {says}")


# --- doctor's own flags and the serve line ------------------------------------------------------


def test_a_flag_before_the_serve_line_means_what_it_means_after_it():
    before = json.loads(run("doctor", "--params", "8B", "--max-num-seqs", "64", "--json")[1])
    after = json.loads(
        run(
            "doctor", "--params", "8B", "--json", "--", "vllm", "serve", "m", "--max-num-seqs", "64"
        )[1]
    )
    plain = json.loads(run("doctor", "--params", "8B", "--json")[1])
    assert any("--max-num-seqs not given" in a for a in plain["assumed"])
    assert not any("--max-num-seqs" in a for a in before["assumed"])
    assert before["phases"] == after["phases"] and before["assumed"] == after["assumed"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-tp", "2", "--tensor-parallel-size", "4"], "argument --tensor-parallel-size/-tp: given twice, 2 and 4"),
        (["--max-num-seqs", "8", "--", "vllm", "serve", "m", "--max-num-seqs", "16"], "max_num_seqs is 8 in doctor's flags but 16 in the serve line"),
        (["--", "vllm", "serve", "m", "-tp", "2", "--tensor-parallel-size=4"], "--tensor-parallel-size is given twice: 2 and 4"),
        (["--", "vllm", "serve", "m", "-q", "fp8", "--quantization", "awq"], "--quantization is given twice: 'fp8' and 'awq'"),
        (["m", "--model", "n"], "two models: 'm' and --model 'n'"),
    ],
)  # fmt: skip
def test_two_different_values_for_one_flag_are_refused(argv, says):
    assert says in refused(*run("doctor", "--params", "8B", *argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["-q", "foobar"],
        ["--dtype", "bogus"],
        ["--", "vllm", "serve", "m", "-q", "foobar"],
        ["--", "vllm", "serve", "m", "--dtype=bogus"],
    ],
)
def test_an_unknown_quantization_or_dtype_is_one_line(argv):
    line = refused(*run("doctor", "--params", "8B", *argv))
    assert "is not valid; accepted values: " in line
    assert ("awq, " in line and "sym_int4" in line) or "auto, half, float16" in line


def test_the_names_doctor_takes_are_vllms_own_and_intels():
    """The names read from vLLM's source without importing it are the list vLLM holds."""
    from typing import get_args

    from vllm.config.model import ModelDType
    from vllm.model_executor.layers.quantization import QuantizationMethods

    names = choices.quantization_names()
    assert names is not None
    assert set(get_args(QuantizationMethods)) <= set(names)
    assert set(names) - set(get_args(QuantizationMethods)) == {"sym_int4", "int4", "woq_int4"}
    assert choices.dtype_names() == get_args(ModelDType)
    for name in names:
        assert serveline.value_of("quantization", name) == name


# --- help and docs/commands.md ------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _rows() -> dict[str, str]:
    text = (ROOT / "docs" / "commands.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `vllm-xpu-memfix ([a-z-]+)(.*?)` \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_docs_commands_names_exactly_the_commands_and_their_options():
    commands, rows = _subcommands(), _rows()
    assert set(rows) == set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", rows[name]), (
                    f"docs/commands.md's {name} row lacks {option}"
                )
    assert "-- vllm serve" in rows["doctor"]


def test_help_lists_only_commands_and_every_doctor_option_has_text():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "compat" not in out.getvalue()
    doctor = _subcommands()["doctor"]
    for action in doctor._actions:
        if action.help != argparse.SUPPRESS:
            assert action.help, f"doctor {action.option_strings or action.dest} has no help"


def test_without_vllms_list_a_quantization_is_taken_unchecked_and_said(monkeypatch):
    monkeypatch.setattr(choices, "quantization_names", lambda: None)
    code, out, err = run("doctor", "--params", "8B", "-q", "my_plugin_quant", "--json")
    assert code == 0, err
    assert (
        choices.QUANTIZATION_NOT_CHECKED.format(name="my_plugin_quant")
        in json.loads(out)["assumed"]
    )
