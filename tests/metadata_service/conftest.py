"""Fixtures: a real etcd per test (killed at teardown), and in-process gRPC servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from tests.metadata_service.helpers import EtcdProcess, make_config


@pytest.fixture
def etcd(tmp_path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd-data").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def memory_server() -> Iterator[ServerThread]:
    with ServerThread(make_config()) as server:
        yield server


@pytest.fixture
def client(memory_server: ServerThread) -> Iterator[MetadataClient]:
    with MetadataClient(memory_server.address) as c:
        yield c
