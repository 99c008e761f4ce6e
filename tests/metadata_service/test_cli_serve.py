"""`pdcluster metadata serve` runs the real server process and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import SECRET_ENV, SECRET_FILE_ENV, write_secret_file
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return {**env, **extra}


def test_serve_with_the_cluster_secret_from_a_file(tmp_path) -> None:
    port = free_port()
    secret_file = write_secret_file(TEST_SECRET, tmp_path / "secret")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port)],
        cwd=REPO_ROOT, env=_env(**{SECRET_FILE_ENV: str(secret_file)}),
        stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        with MetadataClient(f"127.0.0.1:{port}", token=node_token("p0")) as client:
            wait_until(lambda: client.register(make_node_info("p0", "prefill"), 5), timeout_s=10)
        with MetadataClient(f"127.0.0.1:{port}", token=SERVICE_TOKEN) as client:
            assert [n.node_id for n in client.list_nodes()] == ["p0"]
        with MetadataClient(f"127.0.0.1:{port}") as client, pytest.raises(MetadataAuthError):
            client.ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_serve_refuses_to_start_without_the_cluster_secret() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", "0"],
        cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs the cluster secret" in proc.stderr
    assert SECRET_FILE_ENV in proc.stderr and SECRET_ENV in proc.stderr


def test_serve_rejects_bad_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--hash-size", "20"],
        cwd=REPO_ROOT, env=_env(**{SECRET_ENV: TEST_SECRET.to_text()}), capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pdcluster metadata serve: error: hash_size must be one of (16, 32), got 20")
