"""The vLLM handshake never leaves the node's CURVE private key on disk. A real node-side
process (`Handshake`, as `vllm_backend.engine` uses it) hands its keys to a connector worker
in another process; the node is then stopped, exits without stopping its engine, or is
SIGKILLed before any worker took the keys. Afterwards no file anywhere under its handshake
folder holds the secret (before: `pdv-*/curve` held the key pair in the clear until a worker
took it, and a node killed first left it there for good)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.vllm_backend.handshake import take_curve

SECRET = "S" * 40
NODE = f"""
import sys, time
from pdcluster.core.credentials import CurveKeys
from pdcluster.vllm_backend.handshake import Handshake
handshake = Handshake()
handshake.write_curve(CurveKeys(public=b"P" * 40, secret=b"{SECRET}"))
print(handshake.dir, flush=True)
if sys.argv[1] == "close":
    handshake.close()
elif sys.argv[1] == "wait":
    time.sleep(60)
"""


def _start_node(how: str) -> tuple[subprocess.Popen, Path]:
    node = subprocess.Popen([sys.executable, "-c", NODE, how], stdout=subprocess.PIPE,
                            text=True)
    assert node.stdout is not None
    return node, Path(node.stdout.readline().strip())


def _files_holding_the_secret(folder: Path) -> list[Path]:
    if not folder.exists():
        return []
    return [p for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_stopped_node_leaves_no_key(how):
    node, folder = _start_node(how)
    assert node.wait(30) == 0
    assert not folder.exists()


def test_a_node_killed_before_the_worker_took_its_keys_leaves_none():
    node, folder = _start_node("wait")
    try:
        assert folder.is_dir()
        assert _files_holding_the_secret(folder) == []  # only in the node's memory
        os.kill(node.pid, signal.SIGKILL)
        node.wait(30)
        assert _files_holding_the_secret(folder) == []
        with pytest.raises(RuntimeError, match="gone"):
            take_curve(folder)  # never a silent fall back to plaintext
    finally:
        node.kill()
        node.wait(30)
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink()
        folder.rmdir()


def test_a_worker_in_another_process_takes_the_keys_once():
    node, folder = _start_node("wait")
    try:
        assert take_curve(folder) == CurveKeys(public=b"P" * 40, secret=SECRET.encode())
        with pytest.raises(RuntimeError, match="taken already"):
            take_curve(folder)
        assert _files_holding_the_secret(folder) == []
    finally:
        node.kill()
        node.wait(30)
    assert _files_holding_the_secret(folder) == []
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
