"""The price of ZMQ CURVE on the cluster's sockets: `pdcluster bench curve [--json] [--quick]`.

Every node request socket and KV side channel speaks CURVE (core.curve). This measures what
that costs against the same sockets in plaintext, in one run, between two processes on
127.0.0.1: a child serves a ROUTER socket twice (one CURVE server admitting the cluster key
pair through the ZAP handler, one plaintext), answering each frame with the node's reply to a
request; the parent drives a DEALER at each.

- `handshake_ms_{curve,plain}`: a new connection's first round trip (connect, the CURVE
  handshake with its ZAP check, one request and its reply), median of fresh connections;
- `rtt_us_{curve,plain}` (p50 / p99): round trip of a `GenerateRequest` of 200 prompt tokens
  and its `TokenDelta`, on a warm connection — what the router pays per request to a node;
- `side_channel_rtt_us_{curve,plain}`: the same for an `XferRequest` naming 128 blocks
  (a 2,048-token prompt's KV request) answered by an `XferDone` — the side channel's price;
- `bulk_mbps_{curve,plain}`: 1 MiB frames one way (encryption throughput; nothing in the
  cluster sends frames that large, the bulk KV goes over Mooncake, not ZMQ).
Ratios `*_ratio` are CURVE / plaintext.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

from pdcluster.core.credentials import ClusterSecret
from pdcluster.core.kv_transfer import XferDone, XferRequest
from pdcluster.core.kv_transfer import encode as encode_xfer
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TokenDelta
from pdcluster.core.node_wire import encode as encode_node


@dataclass(frozen=True, slots=True)
class Sizes:
    handshakes: int = 30
    round_trips: int = 2000
    bulk_frames: int = 200


QUICK = Sizes(handshakes=5, round_trips=200, bulk_frames=20)
_REPLIES = {b"g": encode_node(TokenDelta("r", [7], True, "length", None, 200, 0)),
            b"x": encode_xfer(XferDone("t", True, first_token=7, num_blocks_sent=128))}


def _serve(conn, secret_text: str) -> None:
    """Child: a CURVE and a plaintext ROUTER, each answering request frames with a reply."""
    import zmq

    from pdcluster.core.curve import secure_server

    keys = ClusterSecret.from_text(secret_text).curve_keys()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sockets = {}
    for kind in ("curve", "plain"):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == "curve":
            secure_server(sock, keys)
        sockets[kind] = sock
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        conn.send((kind, f"tcp://127.0.0.1:{port}"))
    poller = zmq.Poller()
    for sock in sockets.values():
        poller.register(sock, zmq.POLLIN)
    while not conn.poll():
        for sock, _ in poller.poll(50):
            identity, tag, _ = sock.recv_multipart()
            reply = _REPLIES.get(tag)  # bulk frames get no answer
            if reply is not None:
                sock.send_multipart([identity, reply])


class _Peer:
    def __init__(self, secret: ClusterSecret) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.child = ctx.Process(target=_serve, args=(child, secret.to_text()), daemon=True)
        self.child.start()
        self.addresses = dict(self.conn.recv() for _ in range(2))
        self.keys = secret.curve_keys()

    def socket(self, kind: str):
        import zmq

        from pdcluster.core.curve import secure_client

        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == "curve":
            secure_client(sock, self.keys)
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


def _handshakes(peer: _Peer, kind: str, frame: tuple[bytes, bytes], n: int) -> list[float]:
    out = []
    for _ in range(n):
        sock = peer.socket(kind)
        out.append(_round_trip(sock, frame))  # connect + handshake + first round trip
        sock.close()
    return out


def _warm(peer: _Peer, kind: str, frame: tuple[bytes, bytes], n: int) -> list[float]:
    sock = peer.socket(kind)
    for _ in range(50):
        _round_trip(sock, frame)
    out = [_round_trip(sock, frame) for _ in range(n)]
    sock.close()
    return out


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
    return b"x", encode_xfer(XferRequest("t", "r", "tcp://127.0.0.1:1", "127.0.0.1:2", 262144,
                                         128, 0, [4096 * (i + 1) for i in range(128)]))


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
    for kind in ("plain", "curve"):  # interleaving would not help: each is one warm socket
        shakes = _handshakes(peer, kind, generate, sizes.handshakes)
        rtts = _warm(peer, kind, generate, sizes.round_trips)
        side = _warm(peer, kind, xfer, sizes.round_trips)
        out[f"handshake_ms_{kind}"] = round(statistics.median(shakes) * 1e3, 3)
        out[f"rtt_us_p50_{kind}"] = round(_pct(rtts, 50) * 1e6, 1)
        out[f"rtt_us_p99_{kind}"] = round(_pct(rtts, 99) * 1e6, 1)
        out[f"side_channel_rtt_us_p50_{kind}"] = round(_pct(side, 50) * 1e6, 1)
        out[f"bulk_mbps_{kind}"] = round(_bulk_mbps(peer, kind, sizes.bulk_frames), 1)
    for name in ("handshake_ms", "rtt_us_p50", "rtt_us_p99", "side_channel_rtt_us_p50"):
        out[f"{name}_ratio"] = round(out[f"{name}_curve"] / out[f"{name}_plain"], 3)
    out["bulk_mbps_ratio"] = round(out["bulk_mbps_curve"] / out["bulk_mbps_plain"], 3)
    return out


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q != 50 else statistics.median(values)
