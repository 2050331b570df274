"""A host-wide counting semaphore on kernel-released file locks.

Each of N slots is one ``fcntl`` lock file (through ``filelock``): the kernel
drops a dead holder's lock with its file descriptor, so a crash never leaves a
slot taken. The holder writes its pid and start time into a separate
``.owner`` file (``filelock`` truncates the lock file itself on every attempt),
so a waiter can say whom it waits for. The directory is per user, mode 0700.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from vllm_xpu_memfix.process import instance_key

POLL_S = 0.05


class LockDirError(RuntimeError):
    """The lock directory is not safe to use."""


def prepare_lock_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise LockDirError(f"lock directory {path} is a symlink; refusing to use it")
    if not stat.S_ISDIR(info.st_mode):
        raise LockDirError(f"lock directory {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise LockDirError(
            f"lock directory {path} is owned by uid {info.st_uid}, not by this user "
            f"(uid {os.geteuid()}); refusing to use it"
        )
    if info.st_mode & 0o022:
        raise LockDirError(
            f"lock directory {path} is group- or world-writable "
            f"(mode {stat.S_IMODE(info.st_mode):o}); refusing to use it"
        )
    return path


def scoped_name(name: str, scope: str) -> str:
    """The semaphore's name for a scope: ``host`` shares it across every vLLM instance;
    ``instance`` gives each engine its own, keyed by what its ranks on this host share
    (``process.instance_key``: the EngineCore pid, or vLLM's instance id on Ray)."""
    return name if scope == "host" else f"{name}-{instance_key()}"


@dataclass
class Holding:
    slot: int | None
    waited_s: float
    waited_for: str
    held_s: float = 0.0

    @property
    def acquired(self) -> bool:
        return self.slot is not None


class HostSemaphore:
    def __init__(self, directory: Path, name: str, slots: int) -> None:
        self.directory = directory
        self.name = name
        self.slots = slots

    def _lock_path(self, slot: int) -> Path:
        return self.directory / f"{self.name}.slot{slot}.lock"

    def _owner_path(self, slot: int) -> Path:
        return self.directory / f"{self.name}.slot{slot}.owner"

    def holders(self) -> str:
        """Who holds the slots, as their owner files say (may be stale for free slots)."""
        owners = []
        for slot in range(self.slots):
            try:
                owners.append(self._owner_path(slot).read_text().strip())
            except OSError:
                continue
        return ", ".join(owners) or "unknown"

    @contextmanager
    def hold(self, timeout_s: float) -> Iterator[Holding]:
        """Hold a slot for the ``with`` block; after ``timeout_s`` proceed without one.

        The yielded :class:`Holding` says which slot (``None`` after a time-out),
        how long the wait was and for whom.
        """
        prepare_lock_dir(self.directory)
        locks = [FileLock(str(self._lock_path(s)), mode=0o600) for s in range(self.slots)]
        started = time.monotonic()
        waited_for = ""
        taken: int | None = None
        while taken is None:
            for slot, lock in enumerate(locks):
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue
                taken = slot
                break
            if taken is not None:
                break
            waited_for = waited_for or self.holders()
            if time.monotonic() - started >= timeout_s:
                break
            time.sleep(POLL_S)
        holding = Holding(taken, time.monotonic() - started, waited_for)
        if taken is not None:
            self._owner_path(taken).write_text(
                f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n"
            )
        held_from = time.monotonic()
        try:
            yield holding
        finally:
            holding.held_s = time.monotonic() - held_from
            if taken is not None:
                locks[taken].release()
