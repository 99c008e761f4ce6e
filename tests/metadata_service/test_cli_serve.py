"""`pdcluster metadata serve` runs the real server process and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from metadata_service.client import MetadataClient, make_node_info
from metadata_service.errors import MetadataAuthError
from tests.metadata_service.helpers import free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_serve_with_token_from_env() -> None:
    port = free_port()
    env = {**os.environ, "PDCLUSTER_METADATA_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "metadata", "serve", "--port", str(port)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        with MetadataClient(f"127.0.0.1:{port}", token="tok") as client:
            wait_until(lambda: client.register(make_node_info("p0", "prefill"), 5), timeout_s=10)
            assert [n.node_id for n in client.list_nodes()] == ["p0"]
        with MetadataClient(f"127.0.0.1:{port}") as client, pytest.raises(MetadataAuthError):
            client.ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_serve_rejects_bad_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "metadata", "serve", "--hash-size", "20"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pdcluster metadata serve: error: hash_size must be one of (16, 32), got 20")
