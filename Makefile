# Builds and runs pdcluster from a fresh machine: `make setup` installs everything (see
# scripts/setup.sh); the other targets use the project's .venv.
SHELL := /bin/bash
.DEFAULT_GOAL := setup

# No model hub is reachable: nothing may try to download at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

VENV := .venv
PDCLUSTER := $(VENV)/bin/pdcluster
TINY_MODEL := .cache/tiny-llama
PORT ?= 8000

.PHONY: setup run test lint bench clean distclean

setup:
	bash scripts/setup.sh

# Serves the cluster (1 prefill + 1 decode node on a local Ray, the metadata service, the
# router) with the built-in tiny model at http://127.0.0.1:$(PORT)/v1 until Ctrl-C.
run: setup
	@if [[ ! -f $(TINY_MODEL)/config.json ]]; then \
		$(PDCLUSTER) make-tiny-model $(TINY_MODEL); \
	fi
	$(PDCLUSTER) serve --model $(TINY_MODEL) --num-prefill 1 --num-decode 1 --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check core engine transfer metadata_service node prefill_node \
		decode_node router cluster proto benchmarks tests

test: lint
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(PDCLUSTER) bench engine --json
	$(PDCLUSTER) bench transfer --json
	$(PDCLUSTER) bench metadata --json

clean:
	rm -rf .cache build dist *.egg-info .pytest_cache .hypothesis .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
