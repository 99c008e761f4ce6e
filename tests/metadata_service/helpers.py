"""Factories and a real etcd process for the metadata service tests."""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.events import BlockRemoved, BlockStored
from pdcluster.core.types import BlockHash
from pdcluster.metadata_service.client import make_node_info
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.publisher import NodePublisher


def make_hash(*parts: object) -> BlockHash:
    return hashlib.sha256(repr(parts).encode()).digest()


def make_chain(name: str, length: int) -> list[BlockHash]:
    return [make_hash(name, i) for i in range(length)]


def make_config(**overrides: object) -> MetadataConfig:
    """Unauthenticated unless ``cluster_secret`` is given: most tests of this room exercise the
    index, not the credentials (test_security.py and tests/security/ do those)."""
    base = dict(port=0, min_lease_ttl_s=1, flush_interval_s=0.05, health_interval_s=0.2,
                sweep_interval_s=0.05, etcd_timeout_s=1.0,
                allow_unauthenticated="cluster_secret" not in overrides)
    base.update(overrides)
    return MetadataConfig(**base)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = ""):
    """Poll until ``predicate()`` is truthy; return its value or fail with ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(interval_s)


class EtcdProcess:
    """A real etcd on free loopback ports with its own data dir; restartable on the same dir.
    Subclasses serve TLS (``scheme``, ``server_args``, ``etcdctl_args``: etcd_tls.py)."""

    scheme = "http"

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not installed (Debian package etcd-server; make setup)")
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def server_args(self) -> list[str]:
        return []

    def etcdctl_args(self) -> list[str]:
        return []

    def start(self) -> EtcdProcess:
        url = f"{self.scheme}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--log-level", "error",
             *self.server_args()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._accepts, timeout_s=15, what="etcd to listen")
        return self

    def _accepts(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "etcd exited"
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.client_port)) == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def etcdctl(self, *args: str) -> str:
        return subprocess.run(["etcdctl", "--endpoints", self.endpoint, *self.etcdctl_args(),
                               *args],
                              capture_output=True, text=True, check=True, timeout=10,
                              env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}).stdout


class FakeNode:
    """A node's prefix cache as a set, turned into events the way the block pool does."""

    def __init__(self) -> None:
        self.cached: set[bytes] = set()

    def store(self, hashes) -> BlockStored:
        self.cached.update(hashes)
        return BlockStored(tuple(hashes), None, 16)

    def evict(self, hashes) -> BlockRemoved:
        self.cached.difference_update(hashes)
        return BlockRemoved(tuple(hashes))


def make_publisher(client, node_id="p0", role="prefill", ttl=2) -> tuple[NodePublisher, FakeNode]:
    node = FakeNode()
    publisher = NodePublisher(client, make_node_info(node_id, role), lambda: node.cached, ttl)
    publisher.register()
    return publisher, node
