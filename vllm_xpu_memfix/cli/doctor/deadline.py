"""A time limit on the one step of doctor that can wait on the network without a bound of
its own: vLLM building the configuration (``create_engine_config``), which fetches
config.json, the tokenizer's files and a draft model's from the Hub through
huggingface_hub, retrying. doctor's own Hub reads carry their deadline already
(``memory.hub``); a ``--config`` FIFO is refused before vLLM opens it (``configfile``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_S = 30.0


class PastDeadline(BaseException):
    """The step did not finish within its time: what it read so far is dropped. Not an
    ``Exception``, so that no library's ``except Exception`` (huggingface_hub's retries,
    transformers' fallbacks) takes it for a network error and goes on."""


@contextlib.contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`PastDeadline` in the block once ``seconds`` have passed. A timer signal
    interrupts a blocking socket read too; off the main thread (an embedding program) no
    signal can be had, and the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise PastDeadline(f"{what} took longer than doctor's deadline of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call(seconds: float, what: str, step: Callable[..., Any], *args: Any) -> Any:
    """``step(*args)`` within ``seconds``; past them a ``TimeoutError`` (the caller's "not
    built", as any failure to reach the Hub), raised outside the step's own handlers."""
    try:
        with within(seconds, what):
            return step(*args)
    except PastDeadline as past:
        raise TimeoutError(str(past)) from None
