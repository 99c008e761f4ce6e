"""Floods for tests/security/test_limits.py, run in a process of their own (spawned: this
module imports nothing heavy, so the attacker's start costs the measured nodes little CPU).
Each speaks CURVE with a registered member's keys to a prefill node's side channel and
request socket."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import msgpack
import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_client
from pdcluster.core.kv_transfer import MAX_TRANSFER_BLOCKS, WIRE_VERSION, XferAbort, XferRequest
from pdcluster.core.kv_transfer import encode as encode_kv

LINGER_MS = 60_000
DEAD = "tcp://127.0.0.1:9"  # the member registers this as its KV address: nobody listens


def huge_transfer_id(target: SimpleNamespace) -> None:
    sock = target.dealer(target.kv_address)
    payload = msgpack.packb({"v": WIRE_VERSION, "type": "XferAbort",
                             "body": {"transfer_id": "x" * ((16 << 20) - 64)}})
    for _ in range(4):
        sock.send(payload)
    sock.close()


def bomb(target: SimpleNamespace) -> None:
    frame = msgpack.packb({"v": WIRE_VERSION, "type": "XferAbort",
                           "body": {"transfer_id": [[]] * (2 << 20)}})
    for address in (target.kv_address, target.request_address):
        sock = target.dealer(address)
        for _ in range(3):
            sock.send(frame)
        sock.close()


def reply_addresses(target: SimpleNamespace) -> None:
    sock = target.dealer(target.kv_address)
    for port in range(1, 10_001):
        sock.send(encode_kv(XferRequest(f"flood-{port}", "r", f"tcp://127.0.0.2:{port}",
                                        "127.0.0.1:1", 4096, 1, 0, [4096])))
        sock.send(encode_kv(XferAbort(f"flood-{port}")))
    sock.close()


def dead_reply_address(target: SimpleNamespace) -> None:
    sock = target.dealer(target.kv_address)
    for i in range(200):  # its own registered address: allowed, and dead
        sock.send(encode_kv(XferRequest(f"dead-{i}", "r", DEAD, "127.0.0.1:1", 4096, 1, 0,
                                        [4096])))
        sock.send(encode_kv(XferAbort(f"dead-{i}")))  # P answers the abort: to DEAD
    sock.close()


def held_requests(target: SimpleNamespace) -> None:
    """Transfer requests for made-up transfer ids, each naming the most blocks one may: P
    would hold each (~5 MB of Python ints) until its prefill comes, i.e. the timeout."""
    blocks = MAX_TRANSFER_BLOCKS
    sock = target.dealer(target.kv_address)
    for i in range(60):  # its own registered address and session: allowed by the rules
        sock.send(encode_kv(XferRequest(f"held-{i}", "r", DEAD, "127.0.0.1:1", 4096, blocks,
                                        0, [4096] * blocks)))
    sock.close()


ATTACKS: dict[str, Callable[[SimpleNamespace], None]] = {
    "16 MiB transfer id": huge_transfer_id, "msgpack bomb": bomb,
    "10,000 reply addresses": reply_addresses, "dead reply address": dead_reply_address,
    "60 held requests": held_requests}


def dealer(address: str, keys: CurveKeys, server_key: bytes):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    # deliver all that was queued before close: the node reads a flood more slowly than this
    # process queues it, and a short linger discarded the tail (1,140 of 20,000 messages in
    # a loaded CI run), which then counted as neither refused nor served
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    secure_client(sock, keys, server_key)
    sock.connect(address)
    return sock


def run(name: str, kv_address: str, request_address: str, public: bytes, secret: bytes,
        server_key: bytes, ready, go) -> None:
    """The attack `name`, once the parent says go (after this process has started)."""
    # Another pod's CPU is not the node's; on this 2-core machine the attacker's process
    # shares the node's cores, so it runs at the lowest priority: what is measured is what
    # the messages cost the node, not the attacker's own encryption.
    os.nice(19)
    keys = CurveKeys(public, secret)
    target = SimpleNamespace(kv_address=kv_address, request_address=request_address,
                             dealer=lambda address: dealer(address, keys, server_key))
    ready.set()
    go.wait(60)
    ATTACKS[name](target)
    zmq.Context.instance().term()  # returns once every closed socket delivered or lingered out
