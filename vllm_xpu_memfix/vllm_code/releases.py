"""What each vLLM release from 0.26.0 to 0.34.0 accepts, recorded: its ``-q`` methods and
its ``EngineArgs`` fields (``releases.json``, written by scripts/record_vllm_releases.py
from each release's wheel). doctor checks a serve line against them when it judges for
another vLLM than the one installed (an Intel image's: ``intel.catalog``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
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
