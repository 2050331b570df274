"""A host-wide counting semaphore on kernel-released file locks.

Each of N slots is one lock file held with ``fcntl.flock``: the kernel drops a
dead holder's lock with its file descriptor, so a crash never leaves a slot
taken. The holder writes its pid and start time into a separate ``.owner``
file, so a waiter can say whom it waits for. The directory is per user, mode
0700.

Every entry of the directory is opened without following a symlink
(``O_NOFOLLOW``) and without blocking (``O_NONBLOCK``, so a FIFO cannot stall
the open), must be a regular file, and is read at most ``OWNER_READ_BYTES`` at a
time; anything else raises :class:`LockDirError` naming the path and what it is,
and the caller then runs unlocked. Nothing is ever written through a link.

This is ``flock`` directly rather than the ``filelock`` package: filelock 3.x opens its
lock file with ``O_TRUNC`` (read in 3.20.3, the line vLLM 0.32 requires), so a hard link
planted in the directory would have its target truncated, refuses symlinks only from
3.20.1 and never opens without blocking. The plugin goes into an existing vLLM
environment and cannot choose that version; the lock itself is a few lines of ``fcntl``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_xpu_memfix.core.files import what_is
from vllm_xpu_memfix.core.process import instance_key, start_time

POLL_S = 0.05
OWNER_READ_BYTES = 4096
_SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LockDirError(RuntimeError):
    """The lock directory, or an entry in it, is not safe to use."""


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


def _refused(path: Path) -> LockDirError:
    return LockDirError(f"{path} is {what_is(path)}, not a regular file: remove it to use the lock")


def open_entry(path: Path, flags: int) -> int:
    """A descriptor of the regular file ``path`` (created 0600 with ``O_CREAT``).

    Never follows a symlink and never blocks on a FIFO; anything but a regular
    file raises :class:`LockDirError`. ``FileNotFoundError`` passes through.
    """
    try:
        fd = os.open(path, flags | _SAFE_OPEN, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # ELOOP: a symlink; EISDIR: a directory; ENXIO: a FIFO without reader, a socket.
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise _refused(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path)
    return fd


def read_owner(path: Path) -> str | None:
    """The first ``OWNER_READ_BYTES`` of an owner file; None when there is none yet."""
    try:
        fd = open_entry(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, OWNER_READ_BYTES).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def refuse_hard_links(fd: int, path: Path) -> None:
    """Raise :class:`LockDirError` where the file has other hard links: writing it would
    change the linked file too."""
    links = os.fstat(fd).st_nlink
    if links > 1:
        raise LockDirError(
            f"{path} has {links} hard links; refusing to write it (remove it to let the "
            "lock work again)"
        )


def write_owner(path: Path, text: str) -> None:
    """Replace the owner file's text; a file with other hard links is refused."""
    fd = open_entry(path, os.O_WRONLY | os.O_CREAT)
    try:
        refuse_hard_links(fd, path)
        os.ftruncate(fd, 0)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


DECISION_END = "end"


def agree(directory: Path, name: str, token: str, decide: Callable[[], str]) -> tuple[str, bool]:
    """One value for every process that presents ``token``: the first to come runs
    ``decide()`` and writes its one-line answer to ``<name>.decision``; the others read it.
    Returns the value and whether this process decided it.

    The file is read and written under its own ``flock``, which the kernel drops when a
    holder dies; a value is trusted only with this token and its closing line, so a
    half-written file or a previous instance's (a reused pid) is decided afresh.
    Raises :class:`LockDirError` (or ``OSError``) where the directory or file is unusable.
    """
    prepare_lock_dir(directory)
    path = directory / f"{name}.decision"
    fd = open_entry(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a few /proc reads at most
        lines = os.read(fd, OWNER_READ_BYTES).decode("utf-8", "replace").split("\n")
        if len(lines) >= 3 and lines[0] == token and lines[2] == DECISION_END and lines[1]:
            return lines[1], False
        refuse_hard_links(fd, path)
        value = decide()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{token}\n{value}\n{DECISION_END}\n".encode(), 0)
        return value, True
    finally:
        os.close(fd)  # drops the flock


def first_alive(directory: Path, name: str) -> bool:
    """Whether this process is the one that speaks for the host on ``name``: the first to
    ask, or the first after that one has exited. ``<name>.speaker`` names the speaker by pid
    and start time (so a reused pid is not taken for it), read and written under its own
    ``flock``. Raises :class:`LockDirError` (or ``OSError``) where the directory or file is
    unusable.
    """
    prepare_lock_dir(directory)
    path = directory / f"{name}.speaker"
    fd = open_entry(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        pid, _, started = os.read(fd, OWNER_READ_BYTES).decode("utf-8", "replace").partition(" ")
        if pid.isascii() and pid.isdigit() and start_time(int(pid)) == started.strip():
            return int(pid) == os.getpid()
        refuse_hard_links(fd, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {start_time(os.getpid())}\n".encode(), 0)
        return True
    finally:
        os.close(fd)  # drops the flock


@dataclass
class Holding:
    slot: int | None
    waited_s: float
    waited_for: str
    held_s: float = 0.0
    fd: int | None = None
    held_from: float = 0.0

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
        """Who holds the slots, as their owner files say (may be stale for free slots);
        empty before any holder has written its file."""
        owners = [read_owner(self._owner_path(slot)) for slot in range(self.slots)]
        return ", ".join(owner for owner in owners if owner)

    def _try_slot(self, slot: int) -> int | None:
        """A descriptor holding ``slot``'s lock, or None when another process holds it."""
        fd = open_entry(self._lock_path(slot), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def acquire(self, timeout_s: float) -> Holding:
        """Take a slot, or give up after ``timeout_s``: the :class:`Holding` says which
        slot (``None`` after a time-out), how long the wait was and for whom. Raises
        :class:`LockDirError` (or ``OSError``) with no slot held."""
        prepare_lock_dir(self.directory)
        started = time.monotonic()
        waited, holder = False, ""
        while True:
            for slot in range(self.slots):
                fd = self._try_slot(slot)
                if fd is not None:
                    waited_for = holder or ("unknown" if waited else "")
                    return self._own(slot, fd, time.monotonic() - started, waited_for)
            # A holder writes its owner file just after taking the slot: read until it has.
            waited, holder = True, holder or self.holders()
            if time.monotonic() - started >= timeout_s:
                return Holding(None, time.monotonic() - started, holder or "unknown")
            time.sleep(POLL_S)

    def _own(self, slot: int, fd: int, waited_s: float, waited_for: str) -> Holding:
        try:
            write_owner(
                self._owner_path(slot), f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n"
            )
        except BaseException:
            os.close(fd)  # closing the descriptor drops the lock
            raise
        return Holding(slot, waited_s, waited_for, fd=fd, held_from=time.monotonic())

    def release(self, holding: Holding) -> None:
        """Give the slot back (a no-op for a holding that timed out or was released)."""
        if holding.fd is None:
            return
        holding.held_s = time.monotonic() - holding.held_from
        fd, holding.fd = holding.fd, None
        os.close(fd)

    @contextmanager
    def hold(self, timeout_s: float) -> Iterator[Holding]:
        """:meth:`acquire` for the ``with`` block, released at its end."""
        holding = self.acquire(timeout_s)
        try:
            yield holding
        finally:
            self.release(holding)
