"""The shape of the plugin's log records, held in one place (core/log.py): at most LIMIT
characters, no DEBUG record that says WARNING, cause codes that point to an entry that
``vllm-xpu-memfix explain`` prints; and records made before vLLM configures logging are not lost."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_xpu_memfix.cli import explain
from vllm_xpu_memfix.core import causes, log
from vllm_xpu_memfix.startup import codes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def caught():
    """The records of a fresh plugin logger, DEBUG included; the shape's notes are taken
    back so that the suite's own check (conftest) does not fail this test for them."""
    logger = log.get_logger("test_shape")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.DEBUG
    yield logger, records
    logger.removeHandler(handler)
    logger.level = level
    log.VIOLATIONS.clear()


def test_a_record_over_the_limit_is_cut_and_noted_never_raised(caught):
    logger, records = caught
    logger.info("vllm-xpu-memfix: %s", "x" * 400)
    (record,) = records
    assert len(record.getMessage()) == log.LIMIT and record.getMessage().endswith(log.CUT_MARK)
    (note,) = log.VIOLATIONS
    assert "test_shape 417 characters" in note


def test_a_record_within_the_limit_passes_untouched(caught):
    logger, records = caught
    text = "vllm-xpu-memfix: " + "y" * (log.LIMIT - 17)
    logger.warning(text)
    assert [r.getMessage() for r in records] == [text] and log.VIOLATIONS == []


def test_a_debug_record_that_says_warning_is_noted(caught):
    logger, records = caught
    logger.debug("vllm-xpu-memfix: WARNING compute-runtime #916")
    logger.info("vllm-xpu-memfix: WARNING is fine above DEBUG")
    assert len(records) == 2
    (note,) = log.VIOLATIONS
    assert "a DEBUG record that says WARNING" in note


def test_a_list_stays_within_its_width_and_counts_the_rest():
    names = [f"warmup_{i}" for i in range(100)]
    shown = log.listed(names, 60)
    assert len(shown) <= 60 and shown.endswith("more")
    kept = shown.split(", and ")[0].split(", ")
    assert names[: len(kept)] == kept and shown.endswith(f"and {100 - len(kept)} more")
    assert log.listed(["a", "b"], 60) == "a, b"


def test_the_cause_names_are_doctors_and_each_has_its_entry():
    names = {v for k, v in vars(causes).items() if k.isupper()}
    assert names == set(codes.CAUSES), "one list of cause codes"
    assert names <= set(explain.sections(explain.guide_text()))
    assert log.see(causes.SAMPLER_BURST) == "vllm-xpu-memfix explain sampler_burst"


def test_every_pointer_in_the_package_names_a_code_with_an_entry():
    """A record points with ``see(CODE)`` or a literal command; no record names a repository
    path, which an installed wheel does not have."""
    known = set(codes.CAUSES) | set(codes.REMEDIES)
    for path in (REPO / "vllm_xpu_memfix").rglob("*.py"):
        text = path.read_text()
        for code in re.findall(r"vllm-xpu-memfix explain ([a-z0-9_]+)", text):
            assert code in known and explain.entry(code), (path.name, code)
        assert "troubleshooting.md#" not in text, path.name


def test_a_record_made_before_vllm_configures_logging_waits_for_it(tmp_path):
    """As in vLLM's API server, which loads plugins before it configures logging: an INFO
    record made then would be lost; it comes right after configure_logging, with vLLM's
    prefix."""
    pytest.importorskip("vllm")
    code = textwrap.dedent(
        """
        import logging
        import vllm.logger
        from vllm.config.logging import LoggingConfig
        from vllm_xpu_memfix.core.log import get_logger
        from vllm_xpu_memfix.core.patching import log_when_configured

        log_when_configured(get_logger("early"), logging.INFO, "vllm-xpu-memfix: held back")
        print("before configure", flush=True)
        vllm.logger.configure_logging(LoggingConfig())
        print("after configure", flush=True)
        log_when_configured(get_logger("early"), logging.INFO, "vllm-xpu-memfix: said now")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stdout"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    held = next(i for i, line in enumerate(lines) if line.endswith("vllm-xpu-memfix: held back"))
    assert lines.index("before configure") < held < lines.index("after configure")
    assert "INFO" in lines[held] and "pid=" in lines[held], "vLLM's prefix"
    assert lines[-1].endswith("vllm-xpu-memfix: said now")
