"""Logging through vLLM's logger when vLLM is loaded, plain ``logging`` otherwise.

Under vLLM the logger is a child of the ``vllm`` logger, so lines carry vLLM's
format and process prefixes (``(Worker_TP1 pid=...)``).

Every record the plugin logs passes here, and here its shape is held: one finding of at
most :data:`LIMIT` characters (the message, before vLLM's prefix), details at DEBUG or in
the docs, and a DEBUG record never says WARNING. A record that breaks this is cut (never
raised: vLLM must not fail on a log line) and noted in :data:`VIOLATIONS`, which the test
suite fails on after every test. A finding with one of doctor's cause codes points to its
entry in the troubleshooting guide with :func:`see`: a command, since the wheel has no docs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

_FALLBACK_NAME = "vllm_xpu_memfix"
LIMIT = 320
CUT_MARK = " [cut]"
VIOLATIONS: list[str] = []  # the last few records that broke the shape, for the tests
_KEPT = 20


def see(code: str) -> str:
    """How to read the troubleshooting entry of doctor's cause or remedy code ``code``, from
    the installed package (``cli.explain``)."""
    return f"vllm-xpu-memfix explain {code}"


def fit(text: str, limit: int = LIMIT) -> str:
    """``text`` within ``limit`` characters, an ellipsis where it was cut: for a record the
    caller composes, so that the shape filter never has to cut it."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def listed(items: Sequence[str], width: int) -> str:
    """``items`` joined by commas within ``width`` characters, the rest counted: a list in a
    record keeps the record within :data:`LIMIT` however long the list grows."""
    shown: list[str] = []
    for index, item in enumerate(items):
        rest = len(items) - index - 1
        tail = f", and {rest} more" if rest else ""
        if len(", ".join([*shown, item]) + tail) > width:
            return ", ".join(shown) + f", and {len(items) - index} more"
        shown.append(item)
    return ", ".join(shown)


class _Shape(logging.Filter):
    """Cuts a record longer than :data:`LIMIT` and notes every record out of shape."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        broken = []
        if len(text) > LIMIT:
            broken.append(f"{len(text)} characters")
            record.msg, record.args = text[: LIMIT - len(CUT_MARK)] + CUT_MARK, None
        if record.levelno <= logging.DEBUG and "WARNING" in text:
            broken.append("a DEBUG record that says WARNING")
        if broken:
            VIOLATIONS.append(f"{record.name} {' and '.join(broken)}: {text[:100]!r}")
            del VIOLATIONS[:-_KEPT]
        return True


_SHAPE = _Shape()


def get_logger(name: str = "") -> logging.Logger:
    suffix = f".{name}" if name else ""
    vllm_logger = sys.modules.get("vllm.logger")
    if vllm_logger is not None:
        logger: logging.Logger = vllm_logger.init_logger(f"vllm.xpu_memfix{suffix}")
    else:
        logger = logging.getLogger(_FALLBACK_NAME + suffix)
        root = logging.getLogger(_FALLBACK_NAME)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
    if _SHAPE not in logger.filters:
        logger.addFilter(_SHAPE)
    return logger
