"""Record, per vLLM release, what doctor checks a serve line against when it is judged for
another vLLM than the one installed (an image's): the ``-q`` methods (``QuantizationMethods``
in ``vllm/model_executor/layers/quantization/__init__.py``) and the fields of ``EngineArgs``
(``vllm/engine/arg_utils.py``), both read with :mod:`ast` from the release's wheel.

Usage: ``pip download --no-deps vllm==X.Y.Z -d DIR`` for each release, then
``python scripts/record_vllm_releases.py DIR/*.whl``; writes
``vllm_xpu_memfix/vllm_code/releases.json``. No code of vLLM is copied: names only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "vllm_xpu_memfix" / "vllm_code" / "releases.json"
QUANT = "vllm/model_executor/layers/quantization/__init__.py"
ARGS = "vllm/engine/arg_utils.py"


def engine_fields(source: str) -> list[str]:
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"]
    return [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def record(wheel: Path) -> tuple[str, dict[str, object]]:
    from vllm_xpu_memfix.cli import compat

    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        archive.extract(QUANT, tmp)
        methods = compat.literal_strings(
            Path(tmp), "vllm.model_executor.layers.quantization", "QuantizationMethods"
        )
        fields = engine_fields(archive.read(ARGS).decode())
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return version, {
        "wheel": wheel.name,
        "sha256": digest,
        "quantization": " ".join(methods or ()),
        "engine_args": " ".join(fields),
    }


def main(wheels: list[str]) -> int:
    releases = dict(record(Path(w)) for w in wheels)
    data = {
        "about": "per vLLM release: QuantizationMethods and the EngineArgs fields "
        "(space-separated names), read with Python's ast from each wheel (pip download "
        "--no-deps vllm==X.Y.Z) by scripts/record_vllm_releases.py",
        "releases": dict(
            sorted(releases.items(), key=lambda kv: tuple(map(int, kv[0].split("."))))
        ),
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
