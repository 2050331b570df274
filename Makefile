VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint

setup:
	./scripts/setup.sh

demo: setup
	$(BIN)/vllm-xpu-memfix demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -v --durations=15
