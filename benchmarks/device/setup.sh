#!/usr/bin/env bash
# On a CUDA machine with no network: make vLLM's pure-Python modules importable.
# Expects .device/vllm-src.tar.gz (the .py files of the test bed's vLLM) and .device/whl/
# (cp312 wheels of vLLM's import-time dependencies); see benchmarks/device/README.md.
# Prints the PYTHONPATH to export.
set -euo pipefail
src=/tmp/vsrc site=/tmp/site
mkdir -p "$src" "$site"
tar xzf .device/vllm-src.tar.gz -C "$src"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .device/whl/*.whl >&2
# Stand-ins, for measuring only: a version record so vLLM picks the CUDA platform, and an
# empty module for the compiled extension the CUDA platform imports.
mkdir -p "$src/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > "$src/vllm-0.32.0.dist-info/METADATA"
: > "$src/vllm/_C_stable_libtorch.py"
echo "$src:$site:$PWD"
