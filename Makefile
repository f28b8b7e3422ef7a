VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint unit bench types

$(VENV)/.setup-done: pyproject.toml scripts/setup.sh scripts/torchvision_cpu_shim.py
	bash scripts/setup.sh

setup: $(VENV)/.setup-done

## Set everything up (first time) and start the server on the embedded default model.
run: setup
	$(BIN)/vllm-realtime serve $(ARGS)

## Set everything up (first time), lint, and run the whole test suite.
test: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## Fast tests only (no engine).
unit: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

## Regenerate the wire types from protocol/: the JSON Schema and the TypeScript declarations,
## and the demo page's tuned replies (tests/clients/test_types_drift.py fails when they drift).
types: setup
	$(BIN)/python -m protocol.schema > clients/js/protocol.schema.json
	cd clients/js && npm run --silent types
	$(BIN)/python -m training.page_formats > realtime/static/tuned-replies.json
