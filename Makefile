# snugkv: `make demo` runs the engine on the embedded default model (SmolLM2), `make test` the CPU suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint gpu-check clean

setup: $(STAMP)

# torch is installed first and on its own: on a CPU machine `torch==2.13.0` is the CPU wheel;
# a bare requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/snugkv generate --chat --max-tokens 64 "In two sentences, why does a KV cache speed up text generation?"

# CI's command: the whole suite over TEST_WORKERS pytest-xdist workers (TEST_WORKERS=0: one
# process). OMP_NUM_THREADS=1 for every process the tests start too (servers, engines, tp ranks):
# two workers on 2 cores each with torch's threads on both cores would fight over them.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# The inner loop: the suite without the end-to-end tests marked `slow` (server processes, tp ranks,
# the LLM against transformers), over TEST_WORKERS pytest-xdist workers.
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS)

lint: setup
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
