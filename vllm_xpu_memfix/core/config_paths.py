"""The path switches' values: the default lock and ledger directories, and the checks that
a directory given can be created and written in. Read by ``core.config`` only; a failure
here is a refusal of that variable, never an exception out of ``register()``."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_xpu_memfix.core.numbers import invalid

if TYPE_CHECKING:
    from vllm_xpu_memfix.core.config import Variable


def default_lock_dir(environ: Mapping[str, str] = os.environ) -> Path:
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "vllm-xpu-memfix"
    return Path(f"/tmp/vllm-xpu-memfix-{os.geteuid()}")


def default_ledger_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """``$XDG_CACHE_HOME/vllm-xpu-memfix/ledger``, else ``~/.cache/...``; None where this
    user has no home to put it in. Each variable from ``environ``, else this process's."""
    cache = environ.get("XDG_CACHE_HOME") or os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(cache):
        return Path(cache) / "vllm-xpu-memfix" / "ledger"
    home = environ.get("HOME") or os.environ.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".cache" / "vllm-xpu-memfix" / "ledger" if os.path.isabs(home) else None


def optional_directory(_variable: Variable, raw: str, _environ: Mapping[str, str]) -> Path | None:
    return Path(raw).expanduser() if raw.strip() else None


def check_creatable(variable: Variable, raw: str, path: Path) -> None:
    """Refuse a directory that could not be created or written in: its nearest existing
    part is not a directory, or this user may not write there. ``stat`` raises for a name
    too long or a part that is a file: :func:`read_variable` turns that into a refusal."""
    for part in (path, *path.parents):
        try:
            found = part.stat()
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(found.st_mode):
            where = "this path" if part == path else str(part)
            raise invalid(variable.name, raw, f"{variable.accepted}; {where} is not a directory")
        if not os.access(part, os.W_OK | os.X_OK):
            raise invalid(variable.name, raw, f"{variable.accepted}; {part} is not writable")
        return


LEDGER_OFF = "off"


def ledger_dir(variable: Variable, raw: str, environ: Mapping[str, str]) -> Path | None:
    if not raw.strip():
        return default_ledger_dir(environ)
    if raw.strip().lower() == LEDGER_OFF:
        return None
    return optional_directory(variable, raw, environ)


def existing_directory(variable: Variable, raw: str, _environ: Mapping[str, str]) -> Path:
    # Empty means unset, as for the other path variables: Path("") would be the cwd.
    path = Path(raw if raw.strip() else variable.default).expanduser()
    if not path.is_dir():
        raise invalid(variable.name, raw, "an existing directory")
    return path


def lock_dir(variable: Variable, raw: str, environ: Mapping[str, str]) -> Path:
    if not raw.strip():
        return default_lock_dir(environ)
    if not os.path.isabs(raw):
        raise invalid(variable.name, raw, variable.accepted)
    return Path(raw)
