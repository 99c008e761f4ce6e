"""The price of ZMQ CURVE on the cluster's sockets: `pdcluster bench curve [--json] [--quick]`.

Every node request socket and KV side channel speaks CURVE (core.curve), and checks each
message against its sender's principal (core.identity). This measures what that costs against
the same sockets in plaintext, in one run, between two processes on 127.0.0.1: a child serves
a ROUTER socket three times — "plain"; "curve", one key pair for everyone through the ZAP
handler (the shared-key mode); "identity", the server's own key pair, a key directory naming
the client's key (a router's for generate requests, a node's for KV requests) and, per
message, what a node does: read the sender's key back from the frame, map it to a principal
(noting the connection, core.connections) and authorise the message (node/server.py's rule,
transfer/peer_rules.py's) — decoding each frame with the wire codec in every mode, and
answering it with the node's reply; the parent drives a DEALER at each.

- `handshake_ms_{curve,plain}`: a new connection's first round trip (connect, the CURVE
  handshake with its ZAP check, one request and its reply), median of fresh connections;
- `rtt_us_{curve,plain}` (p50 / p99): round trip of a `GenerateRequest` of 200 prompt tokens
  and its `TokenDelta`, on a warm connection — what the router pays per request to a node;
- `side_channel_rtt_us_{curve,plain}`: the same for an `XferRequest` naming 128 blocks
  (a 2,048-token prompt's KV request) answered by an `XferDone` — the side channel's price;
- `bulk_mbps_{curve,plain}`: 1 MiB frames one way (encryption throughput; nothing in the
  cluster sends frames that large, the bulk KV goes over Mooncake, not ZMQ).
Ratios `*_ratio` are CURVE / plaintext; `*_identity_ratio` are identity / CURVE: what the
per-principal checks add to CURVE. The kinds take turns, one round trip (or one fresh
connection) each in a rotating order, on one warm socket per kind: a neighbour's burst slows
all three alike instead of whichever kind ran during it (measured back to back, the p50
identity ratio swung 0.7-1.55 between runs on a shared machine; taking turns, 1.06-1.07).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

from pdcluster.core.credentials import ClusterSecret, CurveKeys
from pdcluster.core.identity import Directory, Peer, is_router
from pdcluster.core.kv_transfer import XferDone, XferRequest
from pdcluster.core.kv_transfer import decode as decode_xfer
from pdcluster.core.kv_transfer import encode as encode_xfer
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TokenDelta
from pdcluster.core.node_wire import decode as decode_node
from pdcluster.core.node_wire import encode as encode_node
from pdcluster.transfer.peer_rules import PeerRules
from pdcluster.transfer.worker_state import WorkerState


@dataclass(frozen=True, slots=True)
class Sizes:
    handshakes: int = 30
    round_trips: int = 2000
    bulk_frames: int = 200


QUICK = Sizes(handshakes=5, round_trips=200, bulk_frames=20)
_REPLIES = {b"g": encode_node(TokenDelta("r", [7], True, "length", None, 200, 0)),
            b"x": encode_xfer(XferDone("t", True, first_token=7, num_blocks_sent=128))}


KINDS = ("plain", "curve", "identity")
_KV = ("tcp://127.0.0.1:1", "127.0.0.1:2")  # the KV address and session the client registered


def _serve(conn, secret_text: str, client_keys: dict[str, bytes]) -> None:
    """Child: a plaintext, a shared-key and an identity ROUTER, each answering request frames
    with a reply, the identity one after the node's per-message checks."""
    import zmq

    from pdcluster.core.connections import PeerConnections
    from pdcluster.core.curve import secure_server

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    own = CurveKeys.generate()
    directory = Directory()
    directory.grant(Peer("router/bench", client_keys["g"]))
    directory.grant(Peer("node/bench", client_keys["x"], "", *_KV))
    rules = PeerRules(directory, WorkerState(None, 1.0, time.monotonic),  # type: ignore[arg-type]
                      lambda tid: None)
    sockets, connections = {}, None
    for kind in KINDS:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if kind != "plain":
            secure_server(sock, ClusterSecret.from_text(secret_text).curve_keys()
                          if kind == "curve" else own, directory if kind == "identity" else None)
        if kind == "identity":
            connections = PeerConnections(sock, directory)
        sockets[sock] = kind
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        conn.send((kind, f"tcp://127.0.0.1:{port}"))
    conn.send(("server_key", own.public))
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    while not conn.poll():
        for sock, _ in poller.poll(50):
            identity, tag, body = sock.recv_multipart(copy=False)
            if tag.bytes == b"b":
                continue  # bulk frames get no answer
            msg = (decode_node if tag.bytes == b"g" else decode_xfer)(body.bytes)
            if sockets[sock] == "identity" and not _allowed(connections, body, msg, rules):
                continue
            sock.send_multipart([identity.bytes, _REPLIES[tag.bytes]])


def _allowed(connections, frame, msg, rules: PeerRules) -> bool:
    """What a node checks per message: who sent it (noting its connection, to close it if
    the key departs: core.connections), and may that principal send it."""
    principal = connections.principal(frame)
    if isinstance(msg, GenerateRequest):
        return is_router(principal)
    return rules(msg, principal) is None


class _Peer:
    def __init__(self, secret: ClusterSecret) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.shared = secret.curve_keys()
        self.clients = {b"g": CurveKeys.generate(), b"x": CurveKeys.generate()}
        public = {tag.decode(): keys.public for tag, keys in self.clients.items()}
        self.child = ctx.Process(target=_serve, args=(child, secret.to_text(), public),
                                 daemon=True)
        self.child.start()
        self.addresses = dict(self.conn.recv() for _ in range(len(KINDS) + 1))
        self.server_key = self.addresses.pop("server_key")

    def socket(self, kind: str, tag: bytes = b"g"):
        import zmq

        from pdcluster.core.curve import secure_client

        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == "curve":
            secure_client(sock, self.shared)
        elif kind == "identity":
            secure_client(sock, self.clients[tag], self.server_key)
        sock.connect(self.addresses[kind])
        return sock

    def close(self) -> None:
        self.conn.send("stop")
        self.child.join(10)


def _round_trip(sock, frame: tuple[bytes, bytes]) -> float:
    start = time.perf_counter()
    sock.send_multipart(frame)
    if not sock.poll(10_000):
        raise TimeoutError("no reply: the handshake failed")
    sock.recv()
    return time.perf_counter() - start


def _handshakes(peer: _Peer, frame: tuple[bytes, bytes], n: int) -> dict[str, list[float]]:
    """Connect + handshake + first round trip, the kinds taking turns (a noisy neighbour
    slows every kind alike)."""
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for i in range(n):
        for kind in _turn(i):
            sock = peer.socket(kind, frame[0])
            out[kind].append(_round_trip(sock, frame))
            sock.close()
    return out


def _warm(peer: _Peer, frame: tuple[bytes, bytes], n: int) -> dict[str, list[float]]:
    """Round trips on one warm socket per kind, the kinds taking turns."""
    socks = {kind: peer.socket(kind, frame[0]) for kind in KINDS}
    for sock in socks.values():
        for _ in range(50):
            _round_trip(sock, frame)
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for i in range(n):
        for kind in _turn(i):
            out[kind].append(_round_trip(socks[kind], frame))
    for sock in socks.values():
        sock.close()
    return out


def _turn(i: int) -> tuple[str, ...]:
    """The kinds in a rotating order: none always runs first (or right after another)."""
    k = i % len(KINDS)
    return KINDS[k:] + KINDS[:k]


def _bulk_mbps(peer: _Peer, kind: str, n: int) -> float:
    sock, payload = peer.socket(kind), bytes(1 << 20)
    _round_trip(sock, _generate_frame())  # connected and handshaken
    start = time.perf_counter()
    for _ in range(n):
        sock.send_multipart([b"b", payload], copy=False)
    _round_trip(sock, _generate_frame())  # ordered after every bulk frame: all arrived
    elapsed = time.perf_counter() - start
    sock.close()
    return n * len(payload) / elapsed / 1e6


# (tag, payload): the tag tells the child which reply to send.
def _generate_frame() -> tuple[bytes, bytes]:
    request = GenerateRequest("r", list(range(3, 203)), SamplingSpec(max_tokens=1))
    return b"g", encode_node(request)


def _xfer_frame() -> tuple[bytes, bytes]:
    return b"x", encode_xfer(XferRequest("t", "r", *_KV, 262144, 128, 0,
                                         [4096 * (i + 1) for i in range(128)]))


def run(args: argparse.Namespace) -> dict:
    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    peer = _Peer(ClusterSecret.generate())
    try:
        return _measure(peer, sizes)
    finally:
        peer.close()


def _measure(peer: _Peer, sizes: Sizes) -> dict:
    generate, xfer = _generate_frame(), _xfer_frame()
    out: dict = {"round_trips": sizes.round_trips}
    shakes = _handshakes(peer, generate, sizes.handshakes)
    rtts, side = _warm(peer, generate, sizes.round_trips), _warm(peer, xfer, sizes.round_trips)
    for kind in KINDS:
        out[f"handshake_ms_{kind}"] = round(statistics.median(shakes[kind]) * 1e3, 3)
        out[f"rtt_us_p50_{kind}"] = round(_pct(rtts[kind], 50) * 1e6, 1)
        out[f"rtt_us_p99_{kind}"] = round(_pct(rtts[kind], 99) * 1e6, 1)
        out[f"side_channel_rtt_us_p50_{kind}"] = round(_pct(side[kind], 50) * 1e6, 1)
        if kind != "identity":  # the checks are per message, not per byte
            out[f"bulk_mbps_{kind}"] = round(_bulk_mbps(peer, kind, sizes.bulk_frames), 1)
    for name in ("handshake_ms", "rtt_us_p50", "rtt_us_p99", "side_channel_rtt_us_p50"):
        out[f"{name}_ratio"] = round(out[f"{name}_curve"] / out[f"{name}_plain"], 3)
        out[f"{name}_identity_ratio"] = round(out[f"{name}_identity"] / out[f"{name}_curve"], 3)
    out["bulk_mbps_ratio"] = round(out["bulk_mbps_curve"] / out["bulk_mbps_plain"], 3)
    return out


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q != 50 else statistics.median(values)
