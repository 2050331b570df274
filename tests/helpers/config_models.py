"""Checkpoint directories that hold only a real, recorded config.json
(``tests/data/configs``): what vLLM's configuration and doctor read, with no weights."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

CONFIGS = Path(__file__).parent.parent / "data" / "configs"


def config_models(factory: pytest.TempPathFactory, names: Iterable[str]) -> dict[str, Path]:
    found = {}
    for name in names:
        directory = factory.mktemp(name)
        shutil.copy(CONFIGS / f"{name}.json", directory / "config.json")
        found[name] = directory
    return found
