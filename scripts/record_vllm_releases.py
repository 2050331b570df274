"""Record, per vLLM release, what doctor checks a serve line against when it is judged for
another vLLM than the one installed (an image's): the ``-q`` methods (``QuantizationMethods``
in ``vllm/model_executor/layers/quantization/__init__.py``), the fields of ``EngineArgs``
(``vllm/engine/arg_utils.py``) and the methods the XPU platform serves
(``XPUPlatform.supported_quantization`` in ``vllm/platforms/xpu.py``; null where the class
sets none, so ``Platform.verify_quantization`` passes every method), all read with
:mod:`ast` from the release's wheel.

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
XPU = "vllm/platforms/xpu.py"


def engine_fields(source: str) -> list[str]:
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"]
    return [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def platform_methods(source: str, platform: str) -> list[str] | None:
    """``platform``'s own ``supported_quantization`` list; None where the class sets none."""
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == platform]
    for node in cls.body:
        if (
            isinstance(node, ast.AnnAssign | ast.Assign)
            and "supported_quantization" in ast.unparse(node).split("=")[0]
        ):
            assert isinstance(node.value, ast.List)
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def record(wheel: Path) -> tuple[str, dict[str, object]]:
    from vllm_xpu_memfix.cli import compat

    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        archive.extract(QUANT, tmp)
        methods = compat.literal_strings(
            Path(tmp), "vllm.model_executor.layers.quantization", "QuantizationMethods"
        )
        fields = engine_fields(archive.read(ARGS).decode())
        xpu = platform_methods(archive.read(XPU).decode(), "XPUPlatform")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return version, {
        "wheel": wheel.name,
        "sha256": digest,
        "quantization": " ".join(methods or ()),
        "engine_args": " ".join(fields),
        "xpu_quantization": None if xpu is None else " ".join(xpu),
    }


def main(wheels: list[str]) -> int:
    releases = dict(record(Path(w)) for w in wheels)
    data = {
        "about": "per vLLM release: QuantizationMethods, the EngineArgs fields and "
        "XPUPlatform.supported_quantization (space-separated names; null: the platform "
        "sets none and serves every method), read with Python's ast from each wheel (pip "
        "download --no-deps vllm==X.Y.Z) by scripts/record_vllm_releases.py",
        "releases": dict(
            sorted(releases.items(), key=lambda kv: tuple(map(int, kv[0].split("."))))
        ),
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
