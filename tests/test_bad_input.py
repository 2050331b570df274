"""Bad input never hangs, crashes or misleads (issue 19).

Numeric switches and CLI options follow one rule; lock-directory entries that are not
regular files are refused with one line and the warm-up or load runs unlocked; the lock
wrappers keep every failure of their own from vLLM and pass vLLM's on unchanged; monitor,
plot and check refuse bad arguments and files with exit 2 and one line, never a traceback,
and never touch a file they were not asked to write.
"""

from __future__ import annotations

import csv
import fcntl
import io
import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from helpers.odd_files import fifo, within
from helpers.warm_ups import one_warm_up
from hosts import B70, build_host
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_xpu_memfix.cli import DEVICE_GIB, INTERVAL_S, RANKS, UTILIZATION, compat, main
from vllm_xpu_memfix.cli.monitor import COLUMNS
from vllm_xpu_memfix.core import config, numbers
from vllm_xpu_memfix.core.host_lock import OWNER_READ_BYTES, HostSemaphore, LockDirError
from vllm_xpu_memfix.fixes import driver_env, load_lock, warmup_lock

ROOT = Path(__file__).parent.parent
NUMERIC = [v for v in config.VARIABLES if v.bounds is not None]
KEPT = b"the user's bytes\n"
# Each hypothesis example is one in-process run; a few dozen cover the classes.
FEW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def cli(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process (exit codes are real)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_XPU_MEMFIX")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "vllm_xpu_memfix.cli", *argv],
        cwd=cwd,
        env={**clean, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def in_process(*argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)``, argparse's exits included."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code  # type: ignore[assignment]
    return code, out.getvalue(), err.getvalue()


def refused(code: int, stdout: str, stderr: str) -> str:
    """The one line of a refusal, after checking its exact shape."""
    assert code == 2, (code, stdout, stderr)
    assert stdout == "", stdout
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def refused_run(result: subprocess.CompletedProcess) -> str:
    return refused(result.returncode, result.stdout, result.stderr)


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry under ``directory``: a file's bytes, a link's target, ``dir``."""
    state: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        key = str(path.relative_to(directory))
        if path.is_symlink():
            state[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            state[key] = "dir"
        elif path.is_file():
            state[key] = path.read_bytes()
        else:
            state[key] = "special"
    return state


# --- numeric switches -------------------------------------------------------------------


def refusal_of(variable: config.Variable, raw: str) -> str:
    return (
        f"{variable.name}={numbers.shown(raw)} is not valid; accepted values: {variable.accepted}"
    )


@pytest.mark.parametrize("variable", NUMERIC, ids=lambda v: v.name)
@pytest.mark.parametrize(
    "raw", ["nan", "inf", "-inf", "NaN", "1e29", str(10**29), "1e400", "1_0", "0x10", "", " "]
)
def test_non_finite_huge_or_odd_numbers_are_refused_with_name_value_and_range(variable, raw):
    with pytest.raises(numbers.ConfigError) as err:
        config.load({variable.name: raw})
    assert str(err.value) == refusal_of(variable, raw)


@pytest.mark.parametrize("variable", NUMERIC, ids=lambda v: v.name)
def test_the_range_ends_are_accepted_and_one_step_beyond_is_not(variable):
    bounds = variable.bounds
    low, high = bounds.minimum, bounds.maximum
    assert getattr(config.load({variable.name: str(high)}), variable.field) == high
    with pytest.raises(numbers.ConfigError):
        config.load({variable.name: str(high + 1)})
    if bounds.above_minimum:
        with pytest.raises(numbers.ConfigError):
            config.load({variable.name: str(low)})
    else:
        assert getattr(config.load({variable.name: str(low)}), variable.field) == low
        with pytest.raises(numbers.ConfigError):
            config.load({variable.name: str(low - 1)})


@given(variable=st.sampled_from(NUMERIC), raw=st.text(max_size=30))
def test_any_text_is_either_a_number_in_range_or_refused_with_the_exact_line(variable, raw):
    bounds = variable.bounds
    try:
        value = getattr(config.load({variable.name: raw}), variable.field)
    except numbers.ConfigError as exc:
        assert str(exc) == refusal_of(variable, raw)
        return
    assert isinstance(value, int) if bounds.integer else isinstance(value, float)
    assert bounds.minimum <= value <= bounds.maximum
    assert value == (int(raw) if bounds.integer else float(raw))


def in_range(data: Any, bounds: numbers.Bounds) -> float:
    """A value ``bounds`` accepts, drawn by hypothesis."""
    if bounds.integer:
        return data.draw(st.integers(int(bounds.minimum), int(bounds.maximum)))
    value = data.draw(st.floats(bounds.minimum, bounds.maximum))
    assume(not (bounds.above_minimum and value == bounds.minimum))
    return value


@given(data=st.data(), variable=st.sampled_from(NUMERIC))
def test_every_number_in_range_written_plainly_is_accepted(data, variable):
    bounds = variable.bounds
    value = in_range(data, bounds)
    assert getattr(config.load({variable.name: repr(value)}), variable.field) == value


@given(
    variable=st.sampled_from(NUMERIC),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.integers(min_value=10**6).map(str),
        st.integers(max_value=-1).map(str),
    ),
)
def test_values_outside_the_range_are_refused(variable, value):
    assume(variable.bounds.value_of(value) is None or float(value) > variable.bounds.maximum)
    with pytest.raises(numbers.ConfigError) as err:
        config.load({variable.name: value})
    assert str(err.value) == refusal_of(variable, value)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S", "nan"),
        ("VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S", "inf"),
        ("VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S", "nan"),
        ("VLLM_XPU_MEMFIX_LOAD_TIMEOUT_S", "inf"),
        ("VLLM_XPU_MEMFIX_WARMUP_SLOTS", "1e29"),
        ("VLLM_XPU_MEMFIX_LOAD_SLOTS", str(10**29)),
    ],
)
def test_a_bad_switch_stops_the_command_with_the_config_error_line(name, raw, tmp_path):
    line = refused_run(cli("check", "--source", str(tmp_path), cwd=tmp_path, env={name: raw}))
    variable = next(v for v in NUMERIC if v.name == name)
    assert line == f"vllm-xpu-memfix: {refusal_of(variable, raw)}"


# --- lock-directory entries -------------------------------------------------------------


@contextmanager
def logged(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    """The records ``logger`` emits meanwhile, whatever its propagation."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def loud(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    path = tmp_path / "locks"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the lock directory, with a file no lock code may change."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "target").write_bytes(KEPT)
    return path


def lock_settings(lock_dir: Path, **extra: str) -> config.Settings:
    return config.load({"VLLM_XPU_MEMFIX_LOCK_DIR": str(lock_dir), **extra})


# How an entry can be odd: (id, make it at path, what the refusal says).
ODD_ENTRIES: list[tuple[str, Callable[[Path, Path], None], str]] = [
    ("symlink-outside", lambda p, o: p.symlink_to(o / "target"), "is a symlink (to "),
    ("dangling-symlink", lambda p, o: p.symlink_to(o / "new"), "is a symlink (to "),
    ("symlink-dev-zero", lambda p, o: p.symlink_to("/dev/zero"), "is a symlink (to /dev/zero)"),
    ("fifo", lambda p, o: fifo(p), "is a FIFO"),
    ("directory", lambda p, o: p.mkdir(), "is a directory"),
]


def free(lock_file: Path) -> bool:
    """Whether nobody holds the slot of ``lock_file`` (our own descriptor would conflict)."""
    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("entry", ["lock", "owner"])
@pytest.mark.parametrize(("kind", "make", "says"), ODD_ENTRIES, ids=[e[0] for e in ODD_ENTRIES])
def test_an_odd_entry_refuses_the_lock_in_one_line_and_the_warmup_runs_unlocked(
    entry, kind, make, says, lock_dir, outside
):
    path = lock_dir / f"warmup.slot0.{entry}"
    make(path, outside)
    before = snapshot(outside)
    ran: list[bool] = []
    wrapper = one_warm_up("qwen_triton_warmup", lock_settings(lock_dir))
    with logged(warmup_lock.logger) as records:
        result = within(10, lambda: wrapper(lambda: ran.append(True) or 42, None, (), {}))
    assert (result, ran) == (42, [True])
    (line,) = loud(records)
    assert line.startswith(
        f"vllm-xpu-memfix: warm-up lock unusable, qwen_triton_warmup runs unlocked: {path} {says}"
    )
    assert line.endswith(", not a regular file: remove it to use the lock")
    assert snapshot(outside) == before  # nothing written through a link
    if entry == "owner":
        assert free(lock_dir / "warmup.slot0.lock")  # the slot was given back


def test_an_owner_file_with_another_hard_link_is_not_written(lock_dir, outside):
    owner = lock_dir / "warmup.slot0.owner"
    os.link(outside / "target", owner)
    wrapper = one_warm_up("qwen_triton_warmup", lock_settings(lock_dir))
    with logged(warmup_lock.logger) as records:
        assert within(10, lambda: wrapper(lambda: 7, None, (), {})) == 7
    (line,) = loud(records)
    assert f"{owner} has 2 hard links; refusing to write it" in line and "runs unlocked" in line
    assert (outside / "target").read_bytes() == KEPT
    assert free(lock_dir / "warmup.slot0.lock")


@pytest.mark.parametrize(
    ("kind", "make", "says"),
    [e for e in ODD_ENTRIES if e[0] in ("symlink-dev-zero", "fifo", "directory")],
    ids=["symlink-dev-zero", "fifo", "directory"],
)
def test_a_waiter_reading_an_odd_owner_file_refuses_at_once(kind, make, says, lock_dir, outside):
    """The slot is held (by a descriptor of this test); the waiter reads the owner file to
    name the holder, finds it odd, and runs unlocked at once instead of waiting or reading
    /dev/zero without end."""
    lock_file = lock_dir / "warmup.slot0.lock"
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    make(lock_dir / "warmup.slot0.owner", outside)
    try:
        settings_ = lock_settings(lock_dir, VLLM_XPU_MEMFIX_WARMUP_TIMEOUT_S="60")
        wrapper = one_warm_up("qwen_triton_warmup", settings_)
        with logged(warmup_lock.logger) as records:
            assert within(5, lambda: wrapper(lambda: "done", None, (), {})) == "done"
    finally:
        os.close(fd)
    (line,) = loud(records)
    assert "runs unlocked" in line and f"warmup.slot0.owner {says}" in line


def test_a_huge_owner_file_is_read_only_a_few_kib(lock_dir):
    (lock_dir / "warmup.slot0.owner").write_bytes(b"x" * (8 << 20))
    assert len(HostSemaphore(lock_dir, "warmup", 1).holders()) == OWNER_READ_BYTES


def load_config() -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(max_parallel_loading_workers=None, world_size=1),
        load_config=SimpleNamespace(load_format="auto"),
    )


MODEL = SimpleNamespace(modules=lambda: [])


@pytest.mark.parametrize("entry", ["lock", "owner"])
@pytest.mark.parametrize(("kind", "make", "says"), ODD_ENTRIES, ids=[e[0] for e in ODD_ENTRIES])
def test_an_odd_entry_makes_the_rank_load_unlocked(entry, kind, make, says, lock_dir, outside):
    path = lock_dir / f"load.slot0.{entry}"
    make(path, outside)
    before = snapshot(outside)
    wrapper = load_lock.patches(lock_settings(lock_dir, VLLM_XPU_MEMFIX_LOAD_LOCK="on"))[0].wrapper
    with logged(load_lock.logger) as records:
        model = within(
            10, lambda: wrapper(lambda **_: MODEL, None, (), {"vllm_config": load_config()})
        )
    assert model is MODEL
    (line,) = loud(records)
    assert line.startswith("vllm-xpu-memfix: load lock unusable, this rank loads unlocked: ")
    assert f"{path} {says}" in line
    assert snapshot(outside) == before


# --- the wrappers keep their own failures from vLLM -------------------------------------


class VllmOwnError(Exception):
    """Raised by the wrapped vLLM function itself."""


PLUGIN_FAILURES = [
    RuntimeError("plugin bug"),
    ValueError("bad value"),
    KeyError("key"),
    TypeError("type"),
    AttributeError("attribute"),
    OSError(28, "No space left on device"),
    LockDirError("odd lock directory"),
    ZeroDivisionError("zero"),
]


def failing(error: Exception) -> Callable[..., Any]:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise error

    return fail


@pytest.mark.parametrize("stage", ["acquire", "release"])
@pytest.mark.parametrize("error", PLUGIN_FAILURES, ids=lambda e: type(e).__name__)
def test_a_warmup_lock_failure_is_one_line_and_the_warmup_still_runs_once(
    stage, error, lock_dir, monkeypatch
):
    monkeypatch.setattr(HostSemaphore, stage, failing(error))
    calls: list[int] = []
    wrapper = one_warm_up("qwen_triton_warmup", lock_settings(lock_dir))
    with logged(warmup_lock.logger) as records:
        assert wrapper(lambda x: calls.append(x) or x * 2, None, (21,), {}) == 42
    assert calls == [21]
    (line,) = loud(records)
    assert str(error) in line and "\n" not in line


@pytest.mark.parametrize("stage", [None, "acquire", "release"])
@pytest.mark.parametrize("own", [VllmOwnError("vllm"), OSError(5, "vLLM's I/O"), LockDirError("x")])
def test_the_warmups_own_exception_propagates_unchanged(stage, own, lock_dir, monkeypatch):
    if stage is not None:
        monkeypatch.setattr(HostSemaphore, stage, failing(RuntimeError("plugin")))
    calls: list[bool] = []

    def warmup() -> None:
        calls.append(True)
        raise own

    wrapper = one_warm_up("qwen_triton_warmup", lock_settings(lock_dir))
    with pytest.raises(type(own)) as err:
        wrapper(warmup, None, (), {})
    assert err.value is own and calls == [True]
    if stage is None:  # the slot it held is free again
        assert free(lock_dir / "warmup.slot0.lock")


@pytest.mark.parametrize("error", PLUGIN_FAILURES, ids=lambda e: type(e).__name__)
def test_a_load_lock_failure_at_any_point_is_one_line_and_vllm_goes_on(
    error, lock_dir, monkeypatch
):
    after_construction, after_processing, around_load_model = load_lock.patches(
        lock_settings(lock_dir, VLLM_XPU_MEMFIX_LOAD_LOCK="on")
    )
    monkeypatch.setattr(load_lock.LoadSection, "_free_staging", failing(error))
    with logged(load_lock.logger) as records:
        model = after_construction.wrapper(
            lambda **_: MODEL, None, (), {"vllm_config": load_config()}
        )
        assert not free(lock_dir / "load.slot0.lock")  # taken
        processed = after_processing.wrapper(lambda *a: "processed", None, (MODEL, None), {})
        loaded = around_load_model.wrapper(lambda: "loaded", SimpleNamespace(rank=0), (), {})
    assert (model, processed, loaded) == (MODEL, "processed", "loaded")
    assert free(lock_dir / "load.slot0.lock")  # given back although freeing the staging failed
    (line,) = loud(records)
    assert line == (
        "vllm-xpu-memfix: load lock: freeing this rank's staging and giving the slot back "
        f"failed ({type(error).__name__}: {error}); vLLM goes on"
    )


@pytest.mark.parametrize("error", PLUGIN_FAILURES, ids=lambda e: type(e).__name__)
def test_a_failure_taking_the_load_slot_leaves_an_unlocked_load(error, lock_dir, monkeypatch):
    after_construction = load_lock.patches(lock_settings(lock_dir, VLLM_XPU_MEMFIX_LOAD_LOCK="on"))[
        0
    ]
    monkeypatch.setattr(load_lock, "decide", failing(error))
    with logged(load_lock.logger) as records:
        model = after_construction.wrapper(
            lambda **_: MODEL, None, (), {"vllm_config": load_config()}
        )
    assert model is MODEL
    (line,) = loud(records)
    assert "taking a slot (this rank loads unlocked) failed" in line and str(error) in line


@pytest.mark.parametrize("leave_fails", [False, True])
def test_a_failed_load_raises_vllms_own_exception_unchanged(leave_fails, lock_dir, monkeypatch):
    after_construction, _, around_load_model = load_lock.patches(
        lock_settings(lock_dir, VLLM_XPU_MEMFIX_LOAD_LOCK="on")
    )
    if leave_fails:
        monkeypatch.setattr(load_lock.LoadSection, "_free_staging", failing(RuntimeError("x")))
    own = VllmOwnError("the checkpoint is truncated")

    def load_model() -> None:
        after_construction.wrapper(lambda **_: MODEL, None, (), {"vllm_config": load_config()})
        raise own

    with pytest.raises(VllmOwnError) as err:
        around_load_model.wrapper(load_model, SimpleNamespace(rank=0), (), {})
    assert err.value is own
    assert free(lock_dir / "load.slot0.lock")


# --- CLI options ------------------------------------------------------------------------


class Option(NamedTuple):
    command: str
    flag: str
    shown_as: str  # as argparse names it in an error
    dest: str
    bounds: numbers.Bounds
    tail: tuple[str, ...] = ()

    def argv(self, raw: str) -> list[str]:
        return [self.command, f"{self.flag}={raw}", *self.tail]


TP = "--tensor-parallel-size/-tp"
OPTIONS = [
    Option("doctor", "--device-memory-gib", "--device-memory-gib", "device_memory_gib", DEVICE_GIB),
    Option(
        "doctor",
        "--gpu-memory-utilization",
        "--gpu-memory-utilization",
        "gpu_memory_utilization",
        UTILIZATION,
    ),
    Option("doctor", "--tensor-parallel-size", TP, "tensor_parallel_size", RANKS),
    Option("doctor", "-tp", TP, "tensor_parallel_size", RANKS),
    Option(
        "doctor",
        "--max-parallel-loading-workers",
        "--max-parallel-loading-workers",
        "max_parallel_loading_workers",
        RANKS,
    ),
    Option("monitor", "--interval", "--interval", "interval", INTERVAL_S, ("--", "true")),
]


def option_refusal(option: Option, raw: str) -> str:
    return (
        f"vllm-xpu-memfix {option.command}: error: argument {option.shown_as}: "
        f"{option.bounds.refusal(raw)}; see vllm-xpu-memfix {option.command} --help"
    )


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.flag)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e300", "-5", "0", "1e29", "x", ""])
def test_a_bad_option_value_is_refused_in_one_line(option, raw):
    assert option.bounds.value_of(raw) is None
    assert refused(*in_process(*option.argv(raw))) == option_refusal(option, raw)


@pytest.mark.parametrize(
    ("option", "argv"),
    [
        (OPTIONS[0], ["doctor", "--device-memory-gib", "nan"]),
        (OPTIONS[0], ["doctor", "--device-memory-gib", "1e300"]),
        (OPTIONS[0], ["doctor", "--device-memory-gib", "-5"]),
        (OPTIONS[0], ["doctor", "--device-memory-gib", "0"]),
        (OPTIONS[3], ["doctor", "-tp", "1.5"]),
        (OPTIONS[5], ["monitor", "--interval", "inf", "--", "true"]),
        (OPTIONS[5], ["monitor", "--interval", "nan", "--", "true"]),
    ],
)
def test_the_console_command_exits_2_with_the_one_line(option, argv, tmp_path):
    line = refused_run(cli(*argv, cwd=tmp_path))
    assert line == option_refusal(option, argv[2])
    assert not list(tmp_path.iterdir())  # monitor started nothing, wrote nothing


@FEW
@given(option=st.sampled_from(OPTIONS), raw=st.text(max_size=20))
def test_any_text_for_a_numeric_option_is_a_number_in_range_or_one_line(option, raw):
    from vllm_xpu_memfix.cli import build_parser

    value = option.bounds.value_of(raw)
    if value is None:
        assert refused(*in_process(*option.argv(raw))) == option_refusal(option, raw)
    else:
        assert getattr(build_parser().parse_known_args(option.argv(raw))[0], option.dest) == value


@FEW
@given(option=st.sampled_from(OPTIONS), data=st.data())
def test_every_value_in_range_parses_to_itself(option, data):
    from vllm_xpu_memfix.cli import build_parser

    bounds = option.bounds
    value = in_range(data, bounds)
    args, _ = build_parser().parse_known_args(option.argv(repr(value)))
    assert getattr(args, option.dest) == value


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
        (["plot"], "the following arguments are required: csv"),
        (["check", "--bogus"], "unrecognized arguments: --bogus"),
        (["monitor", "--interval"], "argument --interval: expected one argument"),
    ],
)
def test_usage_errors_are_one_line(argv, message):
    line = refused(*in_process(*argv))
    assert message in line and line.endswith("--help")


# --- monitor ----------------------------------------------------------------------------

MARKER = "import pathlib; pathlib.Path('started').write_text('yes')"


@pytest.mark.parametrize(
    ("make_out", "says"),
    [
        (lambda d: d / "afile", "--out {out} exists and is not a directory"),
        (lambda d: d / "results", "{out}/monitor.csv exists; give another --out or move it away"),
        (lambda d: d / "linked", "{out}/monitor.csv exists; give another --out or move it away"),
        (lambda d: d / "afile" / "sub", "--out {out}: cannot create it (Not a directory)"),
    ],
    ids=["out-is-a-file", "csv-exists", "csv-is-a-symlink", "out-under-a-file"],
)
def test_monitor_refuses_an_output_it_cannot_use_before_starting(make_out, says, tmp_path, outside):
    (tmp_path / "afile").write_bytes(KEPT)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "monitor.csv").write_bytes(KEPT)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "monitor.csv").symlink_to(outside / "target")
    before = snapshot(tmp_path)
    out = make_out(tmp_path)
    result = cli("monitor", "--out", str(out), "--", sys.executable, "-c", MARKER, cwd=tmp_path)
    line = refused_run(result)
    assert line == f"monitor: {says.format(out=out)}; nothing was started"
    assert snapshot(tmp_path) == before  # no 'started', no file changed, the link's target kept


def test_monitor_refuses_a_command_it_cannot_run_before_creating_anything(tmp_path):
    (tmp_path / "not-executable").write_text("echo hi\n")
    (tmp_path / "no-format").write_text("neither ELF nor #!\n")
    (tmp_path / "no-format").chmod(0o755)
    before = snapshot(tmp_path)
    cases = [
        (str(tmp_path), "it is a directory"),
        (str(tmp_path / "not-executable"), "not executable"),
        (str(tmp_path / "missing"), "no such file"),
        ("no-such-program-anywhere", "not found on PATH"),
        (str(tmp_path / "no-format"), "Exec format error"),
    ]
    for program, says in cases:
        line = refused_run(
            cli("monitor", "--out", str(tmp_path / "out"), "--", program, cwd=tmp_path)
        )
        assert line == f"monitor: cannot run {program!r}: {says}; nothing was started"
        assert snapshot(tmp_path) == before, program


# --- plot -------------------------------------------------------------------------------

NUMBER = st.floats(0, 1e12, allow_nan=False).map(repr)
WORD = st.text("abcdefghij-_ ()0123456789", min_size=1, max_size=12)


def csv_text(rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def good_rows(t: float) -> list[dict[str, str]]:
    ts = 1_700_000_000 + t
    return [
        {"ts": repr(ts), "t": repr(t), "pid": "11", "label": "worker (11)", "rss": "1024"},
        {
            "ts": repr(ts),
            "t": repr(t),
            "pid": "system",
            "label": "system",
            "mem_available": "1048576",
            "outside_processes": "0",
        },
    ]


NOT_A_NUMBER = st.sampled_from(["abc", "nan", "inf", "-inf", "1,5", "0x1f", "--", "1e999"])
BAD_ROWS = st.one_of(
    # a system row with a figure plot reads that is not a finite number
    st.tuples(st.sampled_from(["t", "ts", "mem_available", "outside_processes"]), NOT_A_NUMBER).map(
        lambda kv: {"pid": "system", "label": "system", "t": "1.0", "ts": "1.0", kv[0]: kv[1]}
    ),
    # a process row the same
    st.tuples(st.sampled_from(["t", "rss", "pss"]), NOT_A_NUMBER).map(
        lambda kv: {"pid": "12", "label": "x", "t": "1.0", kv[0]: kv[1]}
    ),
    # a process row without a time
    st.just({"pid": "12", "label": "x", "t": "", "rss": "5"}),
)


def plot_args(csv_path: Path, out: Path, ledger: Path | None = None) -> list[str]:
    return ["plot", str(csv_path), "-o", str(out), *(["--ledger", str(ledger)] if ledger else [])]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib")
    return tmp_path_factory.mktemp("plot")


@FEW
@given(
    layout=st.lists(st.one_of(st.just("good"), BAD_ROWS), min_size=1, max_size=8),
    torn=st.booleans(),
)
def test_unreadable_csv_rows_are_left_out_and_counted_in_one_line(layout, torn, workdir):
    rows: list[dict[str, str]] = []
    bad_lines: list[int] = []
    for i, item in enumerate(layout):
        if item == "good":
            rows.extend(good_rows(float(i)))
        else:
            rows.append(item)
            bad_lines.append(len(rows) + 1)  # the header is line 1
    text = csv_text(rows)
    if torn:  # a monitor killed mid-write: the last row ends early
        text += "1700000099.0,99.0,sys"
        bad_lines.append(len(rows) + 2)
    csv_path, out = workdir / "monitor.csv", workdir / "out.png"
    csv_path.write_text(text)
    out.unlink(missing_ok=True)
    code, stdout, stderr = in_process(*plot_args(csv_path, out))
    if "good" not in layout:
        assert refused(code, stdout, stderr) == (
            f"plot: {csv_path} holds no samples; is it a vllm-xpu-memfix monitor CSV?"
        )
        assert not out.exists()
        return
    assert (code, stdout) == (0, f"plot: wrote {out}\n")
    assert out.stat().st_size > 0
    expected = (
        [
            f"plot: left out {len(bad_lines)} unreadable row(s) or ledger line(s), "
            f"the first at monitor.csv line {bad_lines[0]}"
        ]
        if bad_lines
        else []
    )
    assert stderr.splitlines() == expected


def floatable(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


GOOD_LEDGER_LINE = st.builds(
    lambda t, phase: json.dumps({"ts": 1_700_000_000 + t, "phase": phase, "role": "worker-0"}),
    st.floats(0, 10),
    WORD,
)
BAD_LEDGER_LINE = st.one_of(
    GOOD_LEDGER_LINE.flatmap(lambda line: st.integers(0, len(line) - 1).map(lambda k: line[:k])),
    st.builds(lambda p: json.dumps({"phase": p, "role": "worker-0"}), WORD),
    st.builds(
        lambda ts: json.dumps({"ts": ts, "phase": "x", "role": "worker-0"}),
        WORD.filter(lambda w: not floatable(w)),
    ),
    st.sampled_from([float("nan"), float("inf")]).map(
        lambda ts: json.dumps({"ts": ts, "phase": "x", "role": "worker-0"})
    ),
    st.builds(lambda ts: json.dumps({"ts": ts, "phase": 5, "role": "worker-0"}), st.floats(0, 9)),
    st.sampled_from(["[]", "1", '"ts"', "null", "[" * 5000]),
)


@FEW
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=6), data=st.data())
def test_unreadable_ledger_lines_are_left_out_and_counted_in_one_line(kinds, data, workdir):
    ledger = workdir / "ledger"
    ledger.mkdir(exist_ok=True)
    texts, bad = [], []
    for number, good in enumerate(kinds, start=1):
        texts.append(data.draw(GOOD_LEDGER_LINE if good else BAD_LEDGER_LINE))
        if not good:
            bad.append(number)
    (ledger / "ledger-host-1.jsonl").write_text("\n".join(texts) + "\n")
    csv_path, out = workdir / "monitor.csv", workdir / "out.png"
    csv_path.write_text(csv_text(good_rows(0.0) + good_rows(1.0)))
    code, stdout, stderr = in_process(*plot_args(csv_path, out, ledger))
    assert (code, stdout) == (0, f"plot: wrote {out}\n")
    expected = (
        [
            f"plot: left out {len(bad)} unreadable row(s) or ledger line(s), the first at "
            f"ledger-host-1.jsonl line {bad[0]}"
        ]
        if bad
        else []
    )
    assert stderr.splitlines() == expected


@FEW
@given(content=st.binary(max_size=300))
def test_any_bytes_as_a_csv_give_a_picture_or_one_line(content, workdir):
    csv_path, out = workdir / "any.csv", workdir / "any.png"
    csv_path.write_bytes(content)
    out.unlink(missing_ok=True)
    code, stdout, stderr = in_process(*plot_args(csv_path, out))
    assert "Traceback" not in stderr
    if code == 0:
        assert out.exists() and stdout == f"plot: wrote {out}\n"
        assert len(stderr.splitlines()) <= 1
    else:
        line = refused(code, stdout, stderr)
        assert line.startswith(f"plot: {csv_path} ")
        assert not out.exists()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (
            b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01",
            "is not a text CSV (not UTF-8); is it a monitor CSV?",
        ),
        (
            b"ts,t,pid,label\n1,2,3,x\n",
            "is not a vllm-xpu-memfix monitor CSV: no column rss, pss, "
            "mem_available, outside_processes",
        ),
        (
            b"",
            "is not a vllm-xpu-memfix monitor CSV: no column ts, t, pid, label, rss, pss, "
            "mem_available, outside_processes",
        ),
    ],
    ids=["binary", "columns-missing", "empty"],
)
def test_a_file_that_is_not_a_monitor_csv_is_refused(content, says, tmp_path):
    pytest.importorskip("matplotlib")
    csv_path = tmp_path / "in.csv"
    csv_path.write_bytes(content)
    line = refused_run(cli("plot", str(csv_path), "-o", str(tmp_path / "o.png"), cwd=tmp_path))
    assert line == f"plot: {csv_path} {says}"
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("picture.txt", "cannot write .txt"),
        ("picture", "cannot write a file without an extension"),
        ("picture.png.gz", "cannot write .gz"),
    ],
)
def test_an_output_plot_cannot_write_is_refused_before_reading(name, says, tmp_path):
    pytest.importorskip("matplotlib")
    csv_path = tmp_path / "monitor.csv"
    csv_path.write_text(csv_text(good_rows(0.0)))
    out = tmp_path / name
    line = refused_run(cli("plot", str(csv_path), "-o", str(out), cwd=tmp_path))
    assert line == (
        f"plot: -o {out}: {says}; give a name ending in .png, .svg, .pdf, or an existing directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["monitor.csv"]


def test_output_into_a_directory_names_the_file_really_written(tmp_path):
    pytest.importorskip("matplotlib")
    csv_path = tmp_path / "monitor.csv"
    csv_path.write_text(csv_text(good_rows(0.0) + good_rows(1.0)))
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    result = cli("plot", str(csv_path), "-o", str(pictures), cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"plot: wrote {pictures / 'host-memory.png'}\n"
    assert (pictures / "host-memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "pictures.png").exists()


def test_output_under_a_file_is_refused_in_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    csv_path = tmp_path / "monitor.csv"
    csv_path.write_text(csv_text(good_rows(0.0)))
    out = tmp_path / "monitor.csv" / "x.png"
    line = refused_run(cli("plot", str(csv_path), "-o", str(out), cwd=tmp_path))
    assert line.startswith(f"plot: cannot write {out}: ")
    assert csv_path.read_text() == csv_text(good_rows(0.0))


# --- check ------------------------------------------------------------------------------

TARGET = "vllm.model_executor.warmup.kernel_warmup"


def source_tree(root: Path, content: bytes) -> Path:
    module = root.joinpath(*TARGET.split(".")).with_suffix(".py")
    module.parent.mkdir(parents=True)
    module.write_bytes(content)
    return module


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"def qwen_triton_warmup(:\n", "syntax error at line 1: "),
        (b"def qwen_triton_warmup():\n    pass\x00\n", "null bytes"),
        (b"def qwen_triton_warmup():\n    return '\xff'\n", "not UTF-8 (byte 38)"),
    ],
    ids=["syntax-error", "nul-byte", "bad-utf8"],
)
def test_check_reports_an_unreadable_target_module_in_one_line(content, reason, tmp_path):
    module = source_tree(tmp_path / "src", content)
    result = cli("check", "--source", str(tmp_path / "src"), cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    rows = result.stdout.splitlines()
    (at,) = [i for i, line in enumerate(rows) if line.startswith("unreadable:")]
    more = itertools.takewhile(lambda row: row.startswith("    "), rows[at + 1 :])
    line = " ".join([rows[at], *(row.strip() for row in more)])  # wrapped at 100
    assert line.startswith(f"unreadable: {module}: ") and reason in line
    assert result.stdout.count("unreadable (see below)") == 4  # 3 warm-ups, 1 removal rule


def test_check_strict_counts_an_unreadable_module_as_missing(tmp_path):
    source_tree(tmp_path / "src", b"def (\n")
    result = cli("check", "--source", str(tmp_path / "src"), "--strict", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (1, "")


def test_check_refuses_an_empty_source(tmp_path):
    line = refused_run(cli("check", "--source", "", cwd=tmp_path))
    assert line == "check: --source is empty; give the directory that holds vllm/"


@FEW
@given(content=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_any_module_bytes_give_a_status_or_unreadable_never_an_exception(content, workdir):
    root = workdir / "tree"
    module = root.joinpath(*TARGET.split(".")).with_suffix(".py")
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_bytes(content)
    try:
        status = compat.target_status(root, f"{TARGET}:qwen_triton_warmup")
    except compat.Unreadable as exc:
        assert exc.path == module and "\n" not in exc.reason
    else:
        assert status in (compat.PRESENT, "missing: qwen_triton_warmup")


# --- the driver guard's inputs ----------------------------------------------------------


def test_a_bad_driver_env_value_stops_the_command_with_the_config_error_line(tmp_path):
    result = cli(
        "check", "--source", str(tmp_path), cwd=tmp_path, env={"VLLM_XPU_MEMFIX_DRIVER_ENV": "p2p"}
    )
    assert refused_run(result) == (
        "vllm-xpu-memfix: VLLM_XPU_MEMFIX_DRIVER_ENV='p2p' is not valid; accepted values: "
        "auto, on, off, no_peer_access"
    )


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)


@FEW
@given(
    keys=st.dictionaries(
        st.sampled_from(driver_env.DRIVER_KEYS), TEXT | st.sampled_from(["0", "1", "-1"])
    ),
    osrelease=st.binary(max_size=40) | st.none(),
    mode=st.sampled_from(["auto", "on", "no_peer_access"]),
)
def test_any_driver_keys_and_kernel_release_give_a_decision_in_one_line(
    keys, osrelease, mode, tmp_path_factory
):
    """Garbage never crashes the guard: each value the driver would not take is named and
    taken as absent, and what the guard sets is only its own keys."""
    root = build_host(tmp_path_factory.mktemp("host"), [B70, B70], kernel=None)
    if osrelease is not None:
        (root / "proc/sys/kernel").mkdir(parents=True)
        (root / "proc/sys/kernel/osrelease").write_bytes(osrelease)
    settings = config.load(
        {"VLLM_XPU_MEMFIX_SYSROOT": str(root), "VLLM_XPU_MEMFIX_DRIVER_ENV": mode}
    )
    decision = driver_env.decide(settings, keys)
    assert set(decision.env) <= set(driver_env.DRIVER_KEYS)
    for name, value in keys.items():
        try:
            int(value)
        except ValueError:  # not a number to anyone: named, and taken as absent
            assert any(item.startswith(f"{name}=") for item in decision.not_understood)
            assert decision.user_set[name] == value
    assert "\n" not in driver_env.summary(decision)
