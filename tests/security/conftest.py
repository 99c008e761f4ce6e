"""One real `pdcluster serve` per session for every attack on it (starting one costs most of
a minute): see tests/security/served.py."""

from __future__ import annotations

import socket

import pytest

from tests.security.served import start_served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served(model_dirs):
    cluster = start_served(model_dirs["llama-gqa"], _free_port())
    yield cluster
    cluster.stop()
