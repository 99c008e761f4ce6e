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
PROMPT := The capital of France is

.PHONY: setup run test lint bench clean distclean

setup:
	bash scripts/setup.sh

run: setup
	@if [[ ! -f $(TINY_MODEL)/config.json ]]; then \
		$(PDCLUSTER) make-tiny-model $(TINY_MODEL); \
	fi
	$(PDCLUSTER) generate --model $(TINY_MODEL) --prompt "$(PROMPT)" --max-tokens 32

lint: setup
	$(VENV)/bin/ruff check core engine transfer metadata_service prefill_node decode_node \
		router cluster proto benchmarks tests

test: lint
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(PDCLUSTER) bench engine --json

clean:
	rm -rf .cache build dist *.egg-info .pytest_cache .hypothesis .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
