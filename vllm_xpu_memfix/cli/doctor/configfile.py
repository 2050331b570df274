"""``--config FILE`` in a pasted serve line, checked before vLLM's parser reads it.

vLLM's ``FlexibleArgumentParser`` (vllm/utils/argparse_utils.py, 0.32.0) opens the file with
``open()`` (a FIFO blocks it), asserts there is one ``--config``, and takes whatever
``yaml.safe_load`` returns as a mapping: a missing file, a YAML tag, a list, a NUL byte, a
``.json`` and two ``--config`` each end in a traceback. Here the file is read as host files
are (``core.files``: a regular file, at most :data:`CAP`), parsed once, and refused in one
line; vLLM's parser then reads a private copy of the bytes checked, never the path again.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_xpu_memfix.cli.doctor.serveline import ServeLineError
from vllm_xpu_memfix.core import files

CAP = files.MiB
FLAG = "--config"


class ConfigFileError(ServeLineError):
    """The ``--config`` file cannot be read as vLLM reads one; the message is one line."""


def _checked(path: str) -> bytes:
    """The file's bytes, where vLLM would take them as a YAML mapping of flags."""
    shown = f"{FLAG} {path!r}"
    if path.rpartition(".")[2] not in ("yaml", "yml"):
        raise ConfigFileError(f"{shown}: vLLM takes a .yaml or .yml file")
    try:
        raw = files.read_input(path, CAP)
    except files.InputRefused as exc:
        raise ConfigFileError(f"{shown}: {exc}") from None
    import yaml  # vLLM's own dependency, as its parser reads the file

    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigFileError(f"{shown}: is not UTF-8 text, so not YAML") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigFileError(f"{shown}: is not YAML vLLM reads ({problem[:200]})") from None
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        kind = type(data).__name__
        raise ConfigFileError(f"{shown}: is a YAML {kind}; vLLM takes a mapping of flag: value")
    return raw


def check_count(args: list[str]) -> None:
    """One ``--config`` at most, as vLLM's parser asserts."""
    if args.count(FLAG) > 1:
        raise ConfigFileError(f"{FLAG} is given {args.count(FLAG)} times; vLLM reads one file")


@contextmanager
def _copy(raw: bytes, suffix: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="vllm-xpu-memfix-config-") as directory:
        path = os.path.join(directory, f"config{suffix}")
        Path(path).write_bytes(raw)
        yield path


def load(path: str, vllms_load: Callable[[str], list[str]]) -> list[str]:
    """vLLM's ``load_config_file`` on the checked bytes of ``path``."""
    raw = _checked(path)
    with _copy(raw, "." + path.rpartition(".")[2]) as copy:
        return vllms_load(copy)
