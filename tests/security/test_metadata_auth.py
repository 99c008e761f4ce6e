"""Calls without a valid token, against real processes: the metadata service a standalone
`pdcluster metadata serve` runs, and the one the cluster code embeds (`RayCluster`, what
`pdcluster serve` starts, with real node actors registered in it). The attacker speaks raw
gRPC, so no client-side check hides anything:

- without a token, or with a wrong one (garbage, another cluster's, a tampered one), no RPC
  answers: not Register, Deregister, Heartbeat, Publish, Snapshot, ListNodes, WatchNodes,
  WatchBlocks, Query, Stats or Ping (UNAUTHENTICATED), and nothing changes;
- the SERVICE credential (the router's) lists, queries and watches, but cannot register,
  heartbeat, publish, snapshot or deregister as a node (PERMISSION_DENIED): a stolen router
  credential cannot re-register d0 at the attacker's address;
- node p0's credential cannot act as d0, but can act as p0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SERVICE,
    ClusterSecret,
    node_principal,
    write_secret_file,
)
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc
from tests.metadata_service.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
ATTACKER = "tcp://127.0.0.1:6666"
NODE_RPCS = ("Register", "Heartbeat", "Publish", "Snapshot", "Deregister")
READ_RPCS = ("ListNodes", "WatchNodes", "WatchBlocks", "Query", "Stats", "Ping")
Code = grpc.StatusCode


@dataclass
class Target:
    """A running metadata service and the secret of its cluster."""

    address: str
    secret: ClusterSecret
    epochs: dict[str, int]  # node id -> the epoch it registered with (as a member knows it)

    def token(self, principal: str) -> str:
        return self.secret.metadata_token(principal)

    def nodes(self) -> dict[str, pb.NodeInfo]:
        channel, stub = _stub(self.address)
        with channel:
            reply = stub.ListNodes(pb.ListNodesRequest(), timeout=5,
                                   metadata=_auth(self.token(SERVICE)))
        return {n.node_id: n for n in reply.nodes}


# -- the two services under attack ---------------------------------------------------------


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> Iterator[Target]:
    """`pdcluster metadata serve` with the secret in a 0600 file, and a node d0 registered
    with its own credential."""
    secret = ClusterSecret.generate()
    secret_file = write_secret_file(secret, tmp_path_factory.mktemp("secret") / "cluster")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port)],
        cwd=ROOT, env={**env, SECRET_FILE_ENV: str(secret_file)}, stdout=subprocess.PIPE,
        text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        target = Target(f"127.0.0.1:{port}", secret, {"d0": 4242})
        d0 = pb.NodeInfo(node_id="d0", role=pb.DECODE, request_address="tcp://127.0.0.1:5555",
                         kv_address="tcp://127.0.0.1:5556", epoch=4242)
        register = pb.RegisterRequest(node=d0, lease_ttl_s=300)  # outlives the module's tests
        assert _code(target, "Register", target.token(node_principal("d0")), register) == Code.OK
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.fixture(scope="module")
def embedded(model_dirs) -> Iterator[Target]:
    """The cluster code's own service (`RayCluster`, as `pdcluster serve` runs it), with the
    real node actors p0 and d0 registered in it."""
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.ray_cluster import RayCluster

    secret = ClusterSecret.generate()
    config = ClusterConfig(model=model_dirs["llama-gqa"], num_prefill=1, num_decode=1,
                           engine={"num_kv_blocks": 64, "block_size": 8}, node_cpus=0.5)
    cluster = RayCluster(config, cluster_secret=secret).start()
    try:
        target = Target(cluster.metadata_address, secret, {})
        wait_until(lambda: set(target.nodes()) == {"p0", "d0"}, timeout_s=60,
                   what="both node actors registered with their own credentials")
        target.epochs = {n.node_id: n.epoch for n in target.nodes().values()}
        yield target
    finally:
        cluster.stop(drain_timeout_s=10)


@pytest.fixture(params=["standalone", "embedded"])
def target(request) -> Target:
    return request.getfixturevalue(request.param)


# -- raw gRPC --------------------------------------------------------------------------------


def _stub(address: str) -> tuple[grpc.Channel, pb_grpc.MetadataServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.MetadataServiceStub(channel)


def _auth(token: str | None):
    return None if token is None else (("authorization", f"Bearer {token}"),)


def _requests(node_id: str, epoch: int, info: pb.NodeInfo | None = None) -> dict[str, object]:
    info = info or pb.NodeInfo(node_id=node_id, role=pb.DECODE, request_address=ATTACKER,
                               kv_address=ATTACKER, epoch=epoch)
    return {
        "Register": pb.RegisterRequest(node=info, lease_ttl_s=30),
        "Heartbeat": pb.HeartbeatRequest(node_id=node_id, epoch=epoch),
        "Publish": pb.PublishRequest(node_id=node_id, epoch=epoch, seq=1),
        "Snapshot": pb.SnapshotRequest(node_id=node_id, epoch=epoch, seq=1),
        "Deregister": pb.DeregisterRequest(node_id=node_id),
        "ListNodes": pb.ListNodesRequest(),
        "WatchNodes": pb.ListNodesRequest(),
        "WatchBlocks": pb.WatchBlocksRequest(),
        "Query": pb.QueryRequest(block_hashes=bytes(32)),
        "Stats": pb.Empty(),
        "Ping": pb.Empty(),
    }


def _code(target: Target, rpc: str, token: str | None, request: object) -> Code:
    """The status of one raw call (a stream: of its first message)."""
    channel, stub = _stub(target.address)
    with channel:
        call: Callable = getattr(stub, rpc)
        try:
            if rpc.startswith("Watch"):
                stream = call(request, timeout=5, metadata=_auth(token))
                next(iter(stream))
                stream.cancel()
            else:
                call(request, timeout=5, metadata=_auth(token))
        except grpc.RpcError as exc:
            return exc.code()
    return Code.OK


def _assert_d0_untouched(target: Target, before: pb.NodeInfo) -> None:
    after = target.nodes()["d0"]
    assert (after.request_address, after.kv_address, after.epoch) == (
        before.request_address, before.kv_address, before.epoch), "d0 was hijacked"


def _wrong_tokens(secret: ClusterSecret) -> dict[str, str | None]:
    other = ClusterSecret.generate()
    genuine = secret.metadata_token(node_principal("d0"))
    return {"none": None, "garbage": "hunter2", "empty principal": ":" + "0" * 64,
            "another cluster's": other.metadata_token(node_principal("d0")),
            "another cluster's service": other.metadata_token(SERVICE),
            "tampered": genuine[:-1] + ("0" if genuine[-1] != "0" else "1"),
            "principal swapped": "node/p0:" + genuine.partition(":")[2]}


# -- the attacks -------------------------------------------------------------------------------


def test_without_a_valid_token_nothing_answers(target: Target) -> None:
    before = target.nodes()["d0"]
    requests = _requests("d0", before.epoch)
    for label, token in _wrong_tokens(target.secret).items():
        for rpc in NODE_RPCS + READ_RPCS:
            assert _code(target, rpc, token, requests[rpc]) == Code.UNAUTHENTICATED, (
                f"{rpc} with {label} token")
    _assert_d0_untouched(target, before)


def test_a_token_in_another_scheme_is_refused(target: Target) -> None:
    channel, stub = _stub(target.address)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.ListNodes(pb.ListNodesRequest(), timeout=5,
                       metadata=(("authorization", f"Basic {target.token(SERVICE)}"),))
    assert info.value.code() == Code.UNAUTHENTICATED


def test_the_service_credential_reads_but_cannot_act_as_a_node(target: Target) -> None:
    before = target.nodes()["d0"]
    token = target.token(SERVICE)
    requests = _requests("d0", before.epoch)
    for rpc in READ_RPCS:
        assert _code(target, rpc, token, requests[rpc]) == Code.OK, rpc
    for rpc in NODE_RPCS:
        assert _code(target, rpc, token, requests[rpc]) == Code.PERMISSION_DENIED, rpc
    _assert_d0_untouched(target, before)


def test_the_permission_error_names_the_principal_and_the_node(target: Target) -> None:
    channel, stub = _stub(target.address)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.Register(_requests("d0", 1)["Register"], timeout=5,
                      metadata=_auth(target.token(node_principal("p0"))))
    assert info.value.code() == Code.PERMISSION_DENIED
    assert "'node/p0' may not act as node 'd0'" in info.value.details()


def test_node_p0_cannot_act_as_d0_but_can_as_itself(target: Target) -> None:
    before = target.nodes()["d0"]
    token = target.token(node_principal("p0"))
    requests = _requests("d0", before.epoch)
    for rpc in NODE_RPCS:
        assert _code(target, rpc, token, requests[rpc]) == Code.PERMISSION_DENIED, rpc
    for rpc in READ_RPCS:  # a member may read the index
        assert _code(target, rpc, token, requests[rpc]) == Code.OK, rpc
    _assert_d0_untouched(target, before)
    if "p0" in target.epochs:  # the real node p0 runs here: act as it without disturbing it
        own = {"Heartbeat": _requests("p0", target.epochs["p0"])["Heartbeat"]}
    else:  # register, heartbeat, publish, snapshot, deregister: all its own
        own = {rpc: _requests("p0", 77)[rpc] for rpc in NODE_RPCS}
    for rpc, request in own.items():
        assert _code(target, rpc, token, request) == Code.OK, rpc
    _assert_d0_untouched(target, before)


def test_the_embedded_nodes_present_their_own_credentials(embedded: Target) -> None:
    """The real p0 heartbeats as itself (known) under its own credential; the service's
    node-identity check is what it passes, not a bypass."""
    token = embedded.token(node_principal("p0"))
    channel, stub = _stub(embedded.address)
    with channel:
        reply = stub.Heartbeat(pb.HeartbeatRequest(node_id="p0", epoch=embedded.epochs["p0"]),
                               timeout=5, metadata=_auth(token))
    assert reply.known
    assert {n.node_id for n in embedded.nodes().values()} == {"p0", "d0"}
