# Builds and runs pdcluster from a fresh machine. scripts/setup.sh installs in two stages: `serve`
# (what `make run` needs, including the built-in model) and `test` (serve's, plus the test tools
# and helm: `make setup`, `make test`). The other targets use the project's .venv.
SHELL := /bin/bash
.DEFAULT_GOAL := setup

# No model hub is reachable: nothing may try to download at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# Everything pdcluster caches (the built-in model, converted GGUFs, the peer benchmarks' venvs)
# stays in the checkout's .cache/ (core/paths.py; installed elsewhere it is ~/.cache/pdcluster).
export PDCLUSTER_CACHE_DIR ?= $(CURDIR)/.cache

VENV := .venv
PDCLUSTER := $(VENV)/bin/pdcluster
# The built-in model: SmolLM2-135M-Instruct, converted from GGUF by scripts/setup.sh. Its API
# name is the folder's: smollm2-135m-instruct.
MODEL ?= $(PDCLUSTER_CACHE_DIR)/smollm2-135m-instruct
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: setup setup-serve setup-vllm run run-vllm test lint bench peers bench-client bench-peers \
	bench-chaos bench-vllm gpu-carry clean distclean

setup:
	bash scripts/setup.sh test

setup-serve:
	bash scripts/setup.sh serve

# vLLM as the nodes' engine (`--engine vllm`): what `setup-serve` installs, plus vLLM's CPU
# build (its CUDA build with PDCLUSTER_GPU=1). `make setup` and `make test` include it.
setup-vllm:
	bash scripts/setup.sh vllm

# Serves the cluster (1 prefill + 1 decode node on a local Ray, the metadata service, the
# router) with $(MODEL) at http://127.0.0.1:$(PORT)/v1 until Ctrl-C. SERVE_ARGS adds flags,
# e.g. SERVE_ARGS="--local-prefill-threshold 0" sends every new prompt through the prefill node.
run: setup-serve
	$(PDCLUSTER) serve --model $(MODEL) --num-prefill 1 --num-decode 1 --port $(PORT) \
		$(SERVE_ARGS)

# ruff on the package, the harnesses, the tests and the build scripts; mypy as pyproject.toml's
# [tool.mypy] says.
lint: setup
	$(VENV)/bin/ruff check pdcluster benchmarks tests scripts setup.py
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest -q

# The same cluster with vLLM as both nodes' engine (pdcluster's connector, index and router).
run-vllm: setup-vllm
	$(PDCLUSTER) serve --engine vllm --model $(MODEL) --num-prefill 1 --num-decode 1 \
		--port $(PORT) $(SERVE_ARGS)

bench: setup-serve
	$(PDCLUSTER) bench engine --json
	$(PDCLUSTER) bench engine --json --model $(MODEL)
	$(PDCLUSTER) bench transfer --json
	$(PDCLUSTER) bench metadata --json
	$(PDCLUSTER) bench curve --json

# Third-party load clients, each in its own virtual environment under .cache/peers (never the
# project's .venv, never part of `make test`). aiperf loads the local tokenizer folder only with
# HF_HUB_OFFLINE unset: `pdcluster bench client` unsets it for aiperf alone.
AIPERF_VERSION := 0.13.0
peers: $(PDCLUSTER_CACHE_DIR)/peers/aiperf/bin/aiperf

$(PDCLUSTER_CACHE_DIR)/peers/aiperf/bin/aiperf:
	python3 -m venv $(PDCLUSTER_CACHE_DIR)/peers/aiperf
	$(PDCLUSTER_CACHE_DIR)/peers/aiperf/bin/pip install aiperf==$(AIPERF_VERSION)

# aiperf against a cluster already serving $(MODEL) on $(PORT) (`make run` in another shell).
bench-client: setup-serve peers
	$(PDCLUSTER) bench client --url http://127.0.0.1:$(PORT) --json \
		--model $(notdir $(MODEL)) --tokenizer $(MODEL)

# The harnesses of benchmarks/ (from this checkout; not in the installed package): each is
# `python -m benchmarks NAME`, and prints its JSON result last as `pdcluster bench` does.
# The engine against vLLM's CPU build (first run installs it into .cache/peers/vllm: ~3.4 GB)
# and transformers, on $(MODEL). Not part of `bench` or `test`: it installs and takes minutes.
bench-peers: setup-serve
	$(VENV)/bin/python -m benchmarks peers --json --model $(MODEL)

# Faults under load on a local cluster (nodes killed, metadata service and etcd restarted, an
# abort storm, a churn soak): nothing may be lost.
bench-chaos: setup-serve
	$(VENV)/bin/python -m benchmarks chaos --json

# vLLM as the nodes' engine against vLLM offline on $(MODEL) (needs `make setup-vllm`).
bench-vllm: setup-vllm
	$(VENV)/bin/python -m benchmarks vllm --json --model $(MODEL)

# What scripts/gpu_check.sh needs on the lent GPU machine, which has no network and lacks a few
# small packages: their python 3.12 wheels in .whl/ and mistral-common's tokenizer file in
# .gpu/ (the tests' tiny models are built with it). Both are git-ignored: carry them there.
gpu-carry: setup
	rm -rf .whl && mkdir -p .whl .gpu
	$(VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d .whl cbor2 pyzmq 'llguidance>=1.0' 'gguf>=0.10'
	cp "$$($(VENV)/bin/python -c 'import mistral_common, pathlib; \
		print(pathlib.Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")')" .gpu/
	du -sh .whl .gpu

clean:
	rm -rf .cache build dist *.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
