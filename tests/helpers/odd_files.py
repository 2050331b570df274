"""Odd files for the bad-input tests: a named pipe nobody writes (a blocking open or read
of it never returns), and a guard that turns such a hang into a failed test."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fifo(path: Path) -> Path:
    """A named pipe at ``path``, in place of any file there; nobody ever writes it."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``, failing the test instead of hanging when it outlasts ``seconds``."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
