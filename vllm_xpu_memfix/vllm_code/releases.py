"""What each vLLM release an Intel image serves (0.10.0 to 0.21.0) and each from 0.26.0 to
0.34.0 accepts, recorded: its ``-q`` methods, its ``EngineArgs`` fields and the methods its
XPU platform serves (``releases.json``, written by scripts/record_vllm_releases.py from
each release's wheel). doctor checks a serve line against them when it judges for another
vLLM than the one installed (an Intel image's: ``intel.catalog``); the start-up model asks
:func:`xpu_quantization` of the release judged for (:func:`judged_for`), else of the
installed one."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any


@functools.cache
def _releases() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("releases.json").read_text()
    releases: dict[str, Any] = json.loads(text)["releases"]
    return releases


def recorded() -> tuple[str, ...]:
    """The releases recorded, oldest first."""
    return tuple(_releases())


def quantization_methods(version: str) -> tuple[str, ...] | None:
    """vLLM ``version``'s ``QuantizationMethods``; None where it is not recorded."""
    release = _releases().get(version)
    return None if release is None else tuple(release["quantization"].split())


def engine_fields(version: str) -> frozenset[str] | None:
    """vLLM ``version``'s ``EngineArgs`` field names; None where it is not recorded."""
    release = _releases().get(version)
    return None if release is None else frozenset(release["engine_args"].split())


def xpu_quantization(version: str | None) -> frozenset[str] | None:
    """The methods vLLM ``version``'s XPU platform serves: its
    ``XPUPlatform.supported_quantization``, or where it sets none (before 0.27.0) every
    method of its ``QuantizationMethods`` (``Platform.verify_quantization`` passes all);
    None where ``version`` is not recorded."""
    release = _releases().get(version or "")
    if release is None:
        return None
    return frozenset((release["xpu_quantization"] or release["quantization"]).split())


# The vLLM release judged for, where another than the installed one (judged_for).
_DESCRIBED: list[str] = []


@contextlib.contextmanager
def judged_for(version: str | None) -> Iterator[None]:
    """Judge for vLLM ``version`` (None: the installed one) while inside."""
    _DESCRIBED[:] = [version] if version else []
    try:
        yield
    finally:
        _DESCRIBED.clear()


def described() -> str | None:
    """The release judged for, where it is not the installed vLLM's."""
    if not _DESCRIBED or _DESCRIBED[0] == installed_version():
        return None
    return _DESCRIBED[0]


def judged() -> str | None:
    """The release a line is judged for: the described one, else the installed one."""
    return described() or installed_version()


@functools.cache
def installed_version() -> str | None:
    """The installed vLLM's version, read from its ``vllm/_version.py`` (written by its
    build) without importing vLLM; a local build's suffix (``0.32.0+cpu``) is dropped."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "_version.py"
    try:
        match = re.search(r"^__version__ = version = '([^']+)'", path.read_text(), re.M)
    except OSError:
        return None
    return match.group(1).split("+")[0] if match else None
