VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint upstream-check

setup:
	./scripts/setup.sh

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

test: lint upstream-check
	$(BIN)/pytest -v --durations=15

# Everything but the tests that start a real vLLM server, engine or Ray cluster: the
# start-up model, doctor, the fixes' units and the recorded data, in a few minutes.
test-fast: lint
	$(BIN)/pytest -q -m "not server" --durations=10
