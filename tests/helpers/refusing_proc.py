"""A /proc reader whose kernel refuses one process's files, as ``hidepid`` or an exit would.

The tests run as root, for whom no file mode refuses a read, so the refusal is played
at the one place the reader opens files: every read or listing under ``proc/<pid>/``
raises ``error`` (PermissionError for EACCES/EPERM, FileNotFoundError for ENOENT,
ProcessLookupError for ESRCH), and everything else is read from ``root``.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_xpu_memfix.memory.snapshot import ProcReader


class RefusingReader(ProcReader):
    def __init__(self, root: str | os.PathLike[str], pid: int | str, error: OSError) -> None:
        super().__init__(root)
        self.refused = self.root / "proc" / str(pid)
        self.error = error

    def _check(self, path: Path) -> None:
        if path.is_relative_to(self.refused):
            raise self.error

    def read_text(self, path: Path) -> str:
        self._check(path)
        return super().read_text(path)

    def list_dir(self, path: Path) -> list[Path]:
        self._check(path)
        return super().list_dir(path)
