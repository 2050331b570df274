"""Reading files this process did not write, so that none can stop, hang or flood it, and
writing one where something else may already stand.

One rule for every such read, the plugin's and the commands': a file is opened without
blocking (``O_NONBLOCK``: a FIFO cannot stall the open), must then be a regular file
(``fstat``: a FIFO, a device, a socket or a directory is refused), and is read up to a
cap, never further. The kernel's own files pass (sysfs and ``/proc`` attributes are
regular files); ``/dev/zero``, a FIFO planted in a recorded tree or a status file that
never ends do not.

- :func:`read_bytes` and :func:`read_text` raise ``OSError`` (:class:`NotRegular`,
  :class:`TooLarge`, or the kernel's own): for readers that tell the errors apart.
- :func:`host_text` and :func:`host_bytes` never raise: the plugin's host reads (sysfs,
  dpkg's status, ``/proc``), where a file that cannot be read is a value that is unknown.
- :func:`input_problem` says in a few words why a file given on a command line cannot be
  read as one (``doctor --host``, ``plot``'s CSV), before anything opens it.
- :func:`write_file` writes a file a command was asked to write (``doctor --write-host``):
  never through a symlink, never into a FIFO or a device, never over an existing file
  unless asked, and never half-written (a temporary file beside it, then renamed).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from vllm_xpu_memfix.core.log import get_logger

KiB, MiB = 1024, 1024**2
# One sysfs or /proc attribute (the kernel prints at most a page of 4 KiB).
ATTRIBUTE_CAP = 64 * KiB
# A list the kernel or dpkg keeps: dpkg's status (a few MiB on a full desktop),
# /proc/self/maps, /proc/self/environ.
LIST_CAP = 64 * MiB

# A log record's most (the project's rule for every line the plugin logs).
_LOG_LIMIT = 320


class NotRegular(OSError):
    """The path is a FIFO, a device, a socket or a directory, not a regular file."""


class TooLarge(OSError):
    """The file holds more than the cap its reader allows."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symlink"),
)


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words (``a FIFO``)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def what_is(path: Path, follow: bool = False) -> str:
    """What stands at ``path`` (``a symlink (to X)``, ``a FIFO``), for a refusal message."""
    try:
        info = path.stat() if follow else path.lstat()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        try:
            return f"a symlink (to {os.readlink(path)})"
        except OSError:
            return "a symlink"
    return kind_of(info.st_mode)


def _size(count: int) -> str:
    return f"{count / MiB:,.0f} MiB" if count >= MiB else f"{count / KiB:,.0f} KiB"


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file at ``path``; :class:`NotRegular` for anything else.
    Never blocks on a FIFO."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        # ENXIO: a FIFO without a writer opened for writing, or a socket.
        if exc.errno == errno.ENXIO:
            raise NotRegular(exc.errno, "not a regular file", str(path)) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, f"{kind_of(mode)}, not a regular file", str(path))
    return fd


def read_bytes(path: str | os.PathLike[str], cap: int) -> bytes:
    """The whole regular file at ``path``, if it holds at most ``cap`` bytes.

    Raises :class:`NotRegular`, :class:`TooLarge` or the kernel's ``OSError``. The file is
    read until its end or past the cap, whatever its size says (``/proc`` says 0)."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        total = 0
        # One read for a file whose size is known (a large dpkg status); /proc says 0.
        step = max(MiB, os.fstat(fd).st_size + 1)
        while total <= cap:
            chunk = os.read(fd, min(cap + 1 - total, step))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    raise TooLarge(errno.EFBIG, f"more than {_size(cap)}", str(path))


def read_text(path: str | os.PathLike[str], cap: int) -> str:
    """:func:`read_bytes` as UTF-8 text, undecodable bytes replaced."""
    return read_bytes(path, cap).decode("utf-8", errors="replace")


def host_bytes(path: Path, cap: int = ATTRIBUTE_CAP) -> bytes | None:
    """The bytes of a host file, or None where it cannot be read. A missing or refused
    file is an unknown value; one that is not a regular file, or is larger than ``cap``,
    is also said in one DEBUG line."""
    try:
        return read_bytes(path, cap)
    except (NotRegular, TooLarge) as exc:
        _debug(f"vllm-xpu-memfix: {path}: {exc.strerror}; taken as unknown")
    except OSError:
        pass
    return None


def host_text(path: Path, cap: int = ATTRIBUTE_CAP) -> str | None:
    """:func:`host_bytes` as stripped UTF-8 text, undecodable bytes replaced."""
    data = host_bytes(path, cap)
    return None if data is None else data.decode("utf-8", errors="replace").strip()


def junk(path: Path, text: str, expected: str) -> None:
    """Say in one DEBUG line that ``path`` holds ``text``, not ``expected``, so its value is
    taken as unknown."""
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    _debug(f"vllm-xpu-memfix: {path} holds {shown}, not {expected}; taken as unknown")


def _debug(line: str) -> None:
    """One DEBUG record, cut to the most a record may hold."""
    cut = line if len(line) <= _LOG_LIMIT else line[: _LOG_LIMIT - 3] + "..."
    get_logger("files").debug(cut)


def input_problem(path: Path, cap: int | None = None) -> str | None:
    """Why the file given as ``path`` on a command line cannot be read as one, or None:
    ``no such file``, ``a FIFO, not a regular file``, ``3,072 MiB: too large (at most 1 MiB)``.
    Reads nothing; the read itself (:func:`read_bytes`) checks again."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return f"{kind_of(info.st_mode)}, not a regular file"
    if cap is not None and info.st_size > cap:
        return f"{_size(info.st_size)}: too large (at most {_size(cap)})"
    return None


class InputRefused(ValueError):
    """A file given on a command line that cannot be read as one; the message says why."""


def read_input(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of a file named on a command line (a host file, a ``--config``), at most
    ``cap``: :class:`InputRefused` with :func:`input_problem`'s reason, or the read's."""
    problem = input_problem(Path(path), cap)
    if problem is not None:
        raise InputRefused(problem)
    try:
        return read_bytes(path, cap)
    except OSError as exc:
        raise InputRefused(f"cannot be read ({exc.strerror or exc})") from None


class WriteRefused(OSError):
    """What stands at the path is not a file to replace; the message says what it is."""


def write_file(path: Path, text: str, replace: bool = False, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, then rename
    it into place (``replace``: over an existing regular file; else only where nothing is).

    Raises :class:`WriteRefused` for a symlink, a FIFO, a device, a directory, or an
    existing file without ``replace``; the kernel's ``OSError`` otherwise. Nothing is left
    behind on failure."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise WriteRefused(errno.EEXIST, f"{what_is(path)}, not a regular file; not written")
    if info is not None and not replace:
        raise WriteRefused(errno.EEXIST, "exists; not replaced without --force")
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), mode)
            out.write(text)
        if replace:
            os.replace(temporary, path)  # replaces what the path names, never a link's target
        else:
            os.link(temporary, path)  # fails where anything appeared meanwhile
            os.unlink(temporary)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise
