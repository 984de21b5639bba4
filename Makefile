# The two commands from the README: `make demo` (main job) and `make test` (test suite).
# Each creates or reuses .venv and installs what it needs (CPU torch 2.13.0; see README for GPU).
# pytest's exit status passes through unchanged: 5 (no tests collected) fails, since both
# targets expect tests (skipped tests still count as collected).
# `make test` skips tests marked slow (benchmarks, scripts end to end, multi-process runs), runs
# the rest in two pytest-xdist workers (one torch thread each, tests/conftest.py) and prints
# the 15 slowest; `make test-slow` runs only the slow ones, in one process.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PyTorch's CPU wheels: from the default index a stock pip takes the multi-GB CUDA build. Where
# only the configured index is reachable, the second pip call falls back to it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-slow test-browser test-wheel lint bench-env clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 --index-url $(TORCH_INDEX) --timeout 20 --retries 1 \
	  || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/ruff check protein_performer tests scripts examples
	$(BIN)/python -m pytest -q -n 2 --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The HTML report in real Chromium (slow-marked; skips where Debian's chromium is missing).
test-browser: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/viz/test_report_browser.py

# A wheel built with `pip wheel`, installed in a fresh venv and run outside the repository
# (train --help, train experiment=demo, finetune; slow-marked).
test-wheel: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/test_wheel.py

# Reference implementations for the benchmarks (performer-pytorch, fair-esm, transformers).
bench-env: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'

lint: $(STAMP)
	$(BIN)/ruff check protein_performer tests scripts examples

clean-venv:
	rm -rf $(VENV)
