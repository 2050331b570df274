"""The command line's manners: a description in every ``--help``, no traceback when the
reader closes the pipe, ``demo`` without vLLM in one line and nothing created, ``explain``
entries that need no other page, and text within 100 columns."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_xpu_memfix.cli import build_parser, explain
from vllm_xpu_memfix.core.lines import WIDTH
from vllm_xpu_memfix.startup import codes

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def cli(*argv: str, cwd: Path, hide: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """The CLI in a child, with ``hide`` made unimportable there."""
    code = (
        "import sys\n"
        f"for name in {hide!r}: sys.modules[name] = None\n"
        "from vllm_xpu_memfix.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
    )


def test_every_command_describes_itself_in_its_help():
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert len(COMMANDS) == 8
    for name, sub in choices.items():
        assert sub.description and len(sub.description) > 60, name
        help_text = sub.format_help()
        assert all(len(line) <= WIDTH for line in help_text.splitlines()), name


@pytest.mark.parametrize(
    "argv",
    [["explain"], ["explain", "driver_host_copy"], ["doctor", "--params", "8B"], ["report"]],
    ids=" ".join,
)
def test_a_closed_pipe_ends_the_command_quietly(argv, tmp_path):
    """As `... | head -0`: the reader is gone before the first line."""
    child = cli(*argv, cwd=tmp_path, hide=("vllm", "torch"))
    assert child.stdout is not None
    child.stdout.close()
    _, err = child.communicate(timeout=120)
    assert (child.returncode, err.decode()) == (141, "")


def test_demo_without_vllm_or_torch_says_what_is_missing_and_creates_nothing(tmp_path):
    child = cli("demo", cwd=tmp_path, hide=("vllm", "torch"))
    out, err = child.communicate(timeout=120)
    lines = err.decode().splitlines()
    assert child.returncode == 2 and out == b"" and len(lines) == 1
    assert lines[0].startswith("vllm-xpu-memfix demo: no vllm, torch in this Python")
    assert "make demo" in lines[0] and "Traceback" not in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_every_explain_entry_stands_alone_within_the_width():
    """No pointer to a page of the repository (the wheel ships only the guide), and prose
    within 100 columns; the guide itself still links them for a reader of the repository."""
    guide = explain.guide_text()
    assert re.search(r"\]\(fixes\.md#", guide)
    for code in [*codes.CAUSES, *codes.REMEDIES]:
        text = explain.entry(code)
        assert text is not None and code in text
        assert not re.search(r"\]\((?![a-z]+://)", text), code
        assert ".md#" not in text and "()" not in text, code
        shown = explain.fitted(text).splitlines()
        assert all(len(line) <= WIDTH for line in shown if not line.startswith("|")), code


class _Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_doctor_says_it_imports_vllm_on_a_terminal_and_nowhere_else(monkeypatch, tty):
    """Issue 57, class 10: the seconds of vLLM's import are not silent on a terminal, and a
    pipe (doctor --json | jq, the tests) gets nothing but the answer."""
    from vllm_xpu_memfix.cli.doctor import vllmline

    stderr = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.delitem(sys.modules, "vllm.engine.arg_utils", raising=False)
    vllmline._say_while_importing("0.32.0")
    expected = "doctor: reading the line with vLLM 0.32.0's parser (importing vLLM)..."
    assert stderr.getvalue().splitlines() == ([expected] if tty else [])
