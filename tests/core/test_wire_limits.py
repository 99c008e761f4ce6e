"""Limits in bytes on the wire (core.wire): what a peer can make a receiver allocate before
any schema check is bounded by the schema, not by the frame's size."""

from __future__ import annotations

import contextlib
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Annotated

import msgpack
import pytest

from pdcluster.core import kv_transfer, node_wire
from pdcluster.core.kv_transfer import XferAbort
from pdcluster.core.node_wire import AbortRequest, GenerateRequest, SamplingSpec
from pdcluster.core.wire import MaxLen, Protocol, WireError


def frame(type_name: str, body, v: int) -> bytes:
    return msgpack.packb({"v": v, "type": type_name, "body": body})


def peak_bytes(fn) -> int:
    tracemalloc.start()
    with contextlib.suppress(WireError):
        fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_a_huge_transfer_id_is_refused_at_its_header():
    # (a 16 MiB one is dropped before that: by the frame size, see test_limits.py)
    data = frame("XferAbort", {"transfer_id": "x" * ((8 << 20) - 64)}, kv_transfer.WIRE_VERSION)
    started = time.perf_counter()
    with pytest.raises(WireError, match="max_str_len"):
        kv_transfer.decode(data)
    assert time.perf_counter() - started < 0.05
    assert peak_bytes(lambda: kv_transfer.decode(data)) < 1 << 20


def test_an_id_within_msgpack_limits_but_past_its_cap_is_refused():
    with pytest.raises(WireError, match=r"transfer_id holds 300 items, more than its cap of 256"):
        kv_transfer.decode(frame("XferAbort", {"transfer_id": "x" * 300},
                                 kv_transfer.WIRE_VERSION))
    with pytest.raises(WireError, match="request_id holds 257 items"):
        node_wire.encode(AbortRequest("r" * 257))  # the sender learns it first
    assert kv_transfer.decode(kv_transfer.encode(XferAbort("t" * 256))) == XferAbort("t" * 256)


@pytest.mark.parametrize("codec", [node_wire, kv_transfer], ids=["node", "side-channel"])
def test_a_msgpack_bomb_costs_what_the_schema_allows(codec):
    # 2M empty lists: 2 MiB on the wire, ~130 MiB of Python lists if msgpack built them all
    bomb = frame("TokenDelta", {"request_id": "r", "token_ids": [[]] * (2 << 20)},
                 node_wire.NODE_WIRE_VERSION)
    unbounded = (2 << 20) * (sys.getsizeof([]) + 8)  # what msgpack alone would build
    bounded = peak_bytes(lambda: codec.decode(bomb))
    assert unbounded > 100 << 20
    assert bounded < 16 << 20, bounded
    with pytest.raises(WireError, match="lists and maps|max_array_len"):
        codec.decode(bomb)


def test_deep_nesting_is_refused():
    with pytest.raises(WireError):
        node_wire.decode(b"\x91" * 100_000 + b"\xc0")


def test_a_long_prompt_within_its_cap_still_decodes():
    prompt = list(range(1000, 1000 + (1 << 20)))
    msg = GenerateRequest("r", prompt, SamplingSpec(stop=["x" * 1024] * 64))
    assert node_wire.decode(node_wire.encode(msg)) == msg


def test_a_message_class_with_an_uncapped_field_cannot_join_a_protocol():
    @dataclass(frozen=True)
    class Uncapped:
        name: str

    @dataclass(frozen=True)
    class Capped:
        name: Annotated[str, MaxLen(8)]
        values: Annotated[list[int], MaxLen(4)]

    with pytest.raises(TypeError, match="Uncapped.name: a str field on the wire needs a cap"):
        Protocol(1, (Uncapped,), 1 << 10)
    protocol = Protocol(1, (Capped,), 1 << 10)
    assert protocol.decode(protocol.encode(Capped("abc", [1, 2]))) == Capped("abc", [1, 2])
    with pytest.raises(WireError, match="max_array_len"):
        protocol.decode(frame("Capped", {"name": "a", "values": [1] * 5}, 1))
