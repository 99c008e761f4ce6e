"""`pdcluster router serve` as its own process: with its metadata service unreachable it
knows no node, so /health is 503 with the reason while /tokenize, which needs no node,
still answers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

from pdcluster.benchmarks.ports import free_port
from tests.cluster_secret import SERVICE_TOKEN
from tests.serve_process import ROOT


def _get(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the router did not start listening")


def test_health_is_503_when_the_router_knows_no_decode_node(model_dir) -> None:
    port = free_port()
    env = {**os.environ, "PDCLUSTER_ROUTER_TOKEN": SERVICE_TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve", "--model",
         str(model_dir), "--port", str(port), "--metadata", f"127.0.0.1:{free_port()}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, proc)
        status, health = _get(port, "GET", "/health")
        assert status == 503 and health["status"] == "unavailable"
        assert "no node known" in health["reason"]
        status, error = _get(port, "POST", "/v1/completions",
                             json.dumps({"model": model_dir.name, "prompt": "x"}).encode())
        assert status == 503 and error["error"]["code"] == "no_healthy_node"
        status, out = _get(port, "POST", "/tokenize", b'{"prompt": "Hello world"}')
        assert status == 200 and out["count"] == len(out["tokens"]) > 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
