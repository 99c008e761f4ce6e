"""One real `pdcluster serve` per engine for every attack on it (starting one costs most of a
minute): see tests/security/served.py.

`served` is parametrized over the nodes' engines: the project's own (`own`, the tiny llama-gqa)
and vLLM (`vllm`, the tiny llama-vllm; vLLM is an optional extra, so that half runs where it is
installed, as tests/vllm_backend does). Each attack written against `served` thus runs on both.
A probe that holds for one engine only narrows it with `own_engine_only` (the member controls
of the side-channel probes write one contiguous block per address: the own engine's KV layout;
a vLLM node's region is one segment per layer tensor)."""

from __future__ import annotations

import importlib.util

import pytest

from pdcluster.benchmarks.ports import free_port
from tests.security.served import start_served

ENGINES = [
    pytest.param("pdcluster", id="own"),
    pytest.param("vllm", id="vllm", marks=pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make setup-vllm)")),
]
MODELS = {"pdcluster": "llama-gqa", "vllm": "llama-vllm"}
# Narrows a test of `served` to the own engine's cluster (the same session-wide one).
own_engine_only = pytest.mark.parametrize("served", ["pdcluster"], indirect=True, ids=["own"])


@pytest.fixture(scope="session", params=ENGINES)
def served(request, model_dirs):
    engine = request.param
    cluster = start_served(model_dirs[MODELS[engine]], free_port(), engine=engine)
    yield cluster
    cluster.stop()
