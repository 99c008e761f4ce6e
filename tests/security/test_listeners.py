"""Bind where told: with the host set to 127.0.0.1, nothing the cluster starts listens on a
wildcard address (0.0.0.0, ::), because a wildcard listener is reachable from every interface
of the machine or pod.

- A Mooncake engine and a KV side channel in a process of their own: every listener, Mooncake's
  handshake/RPC port and TCP data port included, is on the host.
- `pdcluster serve` as a real process tree: the serve process (router, metadata service, Ray
  driver) and the Ray workers that host node actors listen on 127.0.0.1 only, Ray's core-worker
  gRPC server included. Ray's own daemons (gcs_server, raylet, agents, monitor, dashboard) are
  exempt from the assertion but printed with what they bind (`pytest -s` shows them).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.security.listeners import Listener, listening_sockets, process_tree

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# A process of one of these names belongs to Ray, not to pdcluster (comm is cut at 15 chars).
RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardA", "ray::RuntimeEnv", "ray::IDLE")
RAY_DAEMON_SCRIPTS = ("ray/autoscaler/", "ray/dashboard/", "ray/_private/log_monitor.py")
NODE_ACTORS = ("ray::PrefillNod", "ray::DecodeNode")

ENGINE_CHILD = """
import sys
from pdcluster.core.credentials import ClusterSecret
from pdcluster.transfer.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from pdcluster.transfer.side_channel import SideChannelServer

host, with_side_channel = sys.argv[1], sys.argv[2] == "1"
engine = MooncakeTransferEngine(MooncakeConfig(hostname=host))
ports = [engine.rpc_port]
if with_side_channel:
    server = SideChannelServer(lambda msg: None, host=host,
                               curve=ClusterSecret.generate().curve_keys())
    ports.append(int(server.address.rsplit(":", 1)[1]))
print(*ports, flush=True)
sys.stdin.read()
"""


def not_on_host(listeners: list[Listener], host: str = HOST) -> list[str]:
    return [str(s) for s in listeners if s.address != host]


def engine_listeners(host: str, with_side_channel: bool) -> tuple[list[int], list[Listener]]:
    """Start the child, list its listeners, stop it: (the ports it reported, listeners)."""
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD, host,
                             "1" if with_side_channel else "0"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            proc.stdin.close()
            pytest.fail(f"the engine process exited ({proc.wait(10)}) before it was ready:\n"
                        + proc.stderr.read()[-3000:])
        listeners = listening_sockets(proc.pid)
    finally:
        if not proc.stdin.closed:
            proc.stdin.close()
        proc.wait(30)
    print("\n".join(str(s) for s in listeners))
    return [int(p) for p in line.split()], listeners


@pytest.mark.timeout(90)
def test_mooncake_engine_and_side_channel_listen_on_the_host_only() -> None:
    (rpc_port, side_channel_port), listeners = engine_listeners(HOST, with_side_channel=True)
    assert {rpc_port, side_channel_port} <= {s.port for s in listeners}, listeners
    # Mooncake's handshake/RPC port and its TCP data port, and the side channel
    assert len(listeners) >= 3, listeners
    assert not not_on_host(listeners), "listening beyond the host:\n" + "\n".join(
        not_on_host(listeners))


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
@pytest.mark.timeout(90)
def test_mooncake_engine_listens_on_an_ipv6_host_only() -> None:
    (rpc_port,), listeners = engine_listeners("::1", with_side_channel=False)
    assert rpc_port in {s.port for s in listeners} and len(listeners) >= 2, listeners
    assert not not_on_host(listeners, "::1"), "listening beyond the host:\n" + "\n".join(
        not_on_host(listeners, "::1"))


# ---- pdcluster serve ----------------------------------------------------------------------

def is_ray_daemon(listener: Listener) -> bool:
    return (listener.name in RAY_DAEMONS
            or any(script in listener.cmdline for script in RAY_DAEMON_SCRIPTS))


@pytest.mark.slow
@pytest.mark.timeout(900)  # on vLLM's cluster the first test waits for it to start
def test_serve_listens_on_the_host_only(served) -> None:
    """The serve process and the node actors (with vLLM: the engine-core and worker processes
    each actor starts, too) listen on 127.0.0.1 only; Ray's own daemons are exempt."""
    serve_pid = served.proc.pid  # the shared cluster of tests/security/conftest.py
    listeners = listening_sockets(serve_pid)
    ray_daemons = [s for s in listeners if is_ray_daemon(s)]
    checked = [s for s in listeners if not is_ray_daemon(s)]
    print("\nRay's own daemons (exempt):\n" + "\n".join(f"  {s}" for s in ray_daemons))
    print("checked:\n" + "\n".join(f"  {s}" for s in checked))
    actors = {s.pid for s in checked if s.name in NODE_ACTORS}
    assert len(actors) == 2, f"expected a prefill and a decode actor process: {checked}"
    assert any(s.pid == serve_pid for s in checked), "the serve process listens nowhere?"
    under_actors = {pid for actor in actors for pid in process_tree(actor)}
    if served.engine == "vllm":  # vLLM's engine core (and its worker) run under each actor
        for actor in actors:
            assert len(process_tree(actor)) >= 3, f"no vLLM processes under actor {actor}"
    unexpected = {s.pid for s in checked} - under_actors - {serve_pid}
    assert not unexpected, f"unclassified listening processes: {checked}"
    assert not not_on_host(checked), (
        "listening beyond the host (Mooncake's ports are 15000-17000; a Ray core-worker gRPC "
        "server on [::] or 0.0.0.0 means Ray was imported before "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set):\n"
        + "\n".join(not_on_host(checked)))
