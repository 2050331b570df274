"""One deadline for the whole of a doctor run (``--deadline S``, default 30 s).

The steps that can wait on what doctor does not control are cut at it: vLLM's import and
its configuration build (``create_engine_config`` fetches config.json, the tokenizer's and
a draft model's files through huggingface_hub, retrying), each run inside :func:`step`;
doctor's own Hub reader is given what is :func:`left` (``memory.hub``, a thread joined
with that timeout), both a little before the deadline (:data:`RESERVE`). Local work
(/proc, sysfs, the judgement) is never cut: it goes on, and the steps still to come are
not run, said "not read" or "not built". Whatever still runs :data:`GRACE` seconds past
the deadline is stopped by :class:`PastDeadline` reaching the command, one line. Files
named on the command line are opened only where they are regular files (``core.files``),
so no FIFO waits on a writer.

The timer is ``SIGALRM`` (it interrupts a blocking socket read too); off the main thread
(an embedding program) no signal can be had: the steps then run unbounded, and the Hub
reader keeps its own deadline.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_S = 30.0
# The steps are cut this much before the deadline: the exit of an interpreter that imported
# vLLM and torch takes about 1.5 s here, and the answer is the process's end.
RESERVE = 2.0
GRACE = 3.0  # past the deadline, what still runs is stopped: within the 5 s promised


class PastDeadline(BaseException):
    """The deadline passed inside a step: what it read so far is dropped. Not an
    ``Exception``, so that no library's ``except Exception`` (huggingface_hub's retries,
    transformers' fallbacks) takes it for a network error and goes on."""


class _Run:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.ends: float | None = None  # monotonic time; None: no run under way
        self.in_step = 0
        self.expired = False


_run = _Run()


def left(cap: float = float("inf")) -> float:
    """Seconds a step may still take (0 once past), at most ``cap``; ``cap`` where no run
    is under way."""
    if _run.ends is None:
        return cap
    return max(0.0, min(cap, _run.ends - time.monotonic()))


def passed() -> str:
    """What a step not run past the deadline says."""
    return f"not read: doctor's deadline of {_run.seconds:g} s had passed"


def _expire(_signum: int, _frame: Any) -> None:
    first = not _run.expired
    _run.expired = True
    if _run.in_step or not first:
        raise PastDeadline(f"doctor's deadline of {_run.seconds:g} s")


@contextlib.contextmanager
def run(seconds: float) -> Iterator[None]:
    """The whole run within ``seconds``: a step under way :data:`RESERVE` seconds before
    the deadline is cut; local work left then has until :data:`GRACE` seconds past the
    deadline before :class:`PastDeadline` stops it."""
    cut = max(seconds - min(RESERVE, seconds / 2), 1e-3)
    _run.seconds, _run.ends, _run.expired = seconds, time.monotonic() + cut, False
    timed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _expire) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, cut, seconds + GRACE - cut)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        _run.ends = None


def step(what: str, work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)``, cut at the run's deadline: a ``TimeoutError`` saying so then (the
    caller's "not built", as any failure to reach the Hub), raised outside the step's own
    handlers; at once where the deadline had passed before it began."""
    if _run.expired or (_run.ends is not None and left() <= 0):
        raise TimeoutError(f"{what}: {passed()}")
    _run.in_step += 1
    try:
        return work(*args)
    except PastDeadline as past:
        raise TimeoutError(f"{what} was cut at {past}") from None
    finally:
        _run.in_step -= 1
