"""The shared wire codec (core.wire) through both protocols that use it."""

from __future__ import annotations

import msgpack
import pytest

from pdcluster.core import kv_transfer, node_wire
from pdcluster.core.kv_transfer import XferAbort, XferDone, XferRequest
from pdcluster.core.node_wire import (
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    RequestError,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.core.wire import WireError

KV_MESSAGES = [XferRequest("t", "r", "tcp://a:1", "127.0.0.1:2", 4096, 3, 1, [8192, 16384]),
               XferAbort("t"), XferDone("t", True, 7, -0.25, None, 2, 1),
               XferDone("t", False, error="boom")]
NODE_MESSAGES = [
    GenerateRequest("r", [1, 2], SamplingSpec(max_tokens=3, stop=["x"], seed=4),
                    TransferSpec("remote_prefill", "t", "tcp://p:1"), "tenant"),
    GenerateRequest("r", [1], SamplingSpec()), AbortRequest("r"), LoadQuery(),
    TokenDelta("r", [5, 6], True, "stop", [-0.1, -0.2], 9, 8), RequestError("r", "draining", "m"),
    LoadReport("n", "decode", 1, 2, 3, 4, 5, True)]


@pytest.mark.parametrize("msg", KV_MESSAGES + NODE_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    codec = kv_transfer if type(msg) in (XferRequest, XferAbort, XferDone) else node_wire
    assert codec.decode(codec.encode(msg)) == msg


def frame(type_name: str, body, v: int = node_wire.NODE_WIRE_VERSION) -> bytes:
    return msgpack.packb({"v": v, "type": type_name, "body": body})


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "envelope"),
    (frame("TokenDelta", {"request_id": "r", "token_ids": [1]}, v=99), "version"),
    (frame("Pickle", {}), "unknown message type"),
    (frame("XferDone", {"transfer_id": "t", "ok": True}), "unknown message type"),  # other protocol
    (frame("TokenDelta", {"request_id": "r"}), "do not match"),  # missing token_ids
    (frame("TokenDelta", {"request_id": "r", "token_ids": [1], "evil": 1}), "do not match"),
    (frame("TokenDelta", {"request_id": "r", "token_ids": [True]}), "expected int"),
    (frame("TokenDelta", {"request_id": "r", "token_ids": "12"}), "must be a list"),
    (frame("TokenDelta", {"request_id": "r", "token_ids": [], "finished": 1}), "expected bool"),
    (frame("GenerateRequest", {"request_id": "r", "prompt_token_ids": [1],
                               "sampling": {"max_tokens": "5"}}), "sampling.max_tokens"),
    (frame("GenerateRequest", {"request_id": "r", "prompt_token_ids": [1], "sampling": {},
                               "transfer": {"kind": "teleport", "transfer_id": "t"}}),
     "transfer kind"),
    (frame("RequestError", {"request_id": "r", "code": "oops", "message": "m"}), "error code"),
])
def test_node_protocol_rejects(data, match):
    with pytest.raises(WireError, match=match):
        node_wire.decode(data)


@pytest.mark.parametrize("body, match", [
    ({"dest_block_addrs": [0]}, "positive"),
    ({"skip_blocks": 5}, "skip_blocks"),
    ({"dest_block_addrs": [4096]}, "one destination address"),
    ({"block_nbytes": 0}, "block_nbytes"),
])
def test_transfer_requests_are_checked_beyond_types(body, match):
    good = {"transfer_id": "t", "request_id": "r", "reply_addr": "a", "dest_session": "s",
            "block_nbytes": 4096, "num_blocks": 3, "skip_blocks": 1,
            "dest_block_addrs": [8192, 16384]}
    with pytest.raises(WireError, match=match):
        kv_transfer.decode(frame("XferRequest", {**good, **body}, v=kv_transfer.WIRE_VERSION))


def test_an_integer_logprob_decodes_as_float():
    msg = kv_transfer.decode(frame("XferDone", {"transfer_id": "t", "ok": True,
                                                "first_logprob": 0}, v=kv_transfer.WIRE_VERSION))
    assert msg.first_logprob == 0.0 and isinstance(msg.first_logprob, float)


def test_encode_refuses_what_the_wire_cannot_carry():
    import numpy
    with pytest.raises(WireError, match="cannot encode"):
        node_wire.encode(TokenDelta("r", [numpy.int64(3)]))
    with pytest.raises(WireError, match="XferDone.error holds 4097 items, more than its cap"):
        kv_transfer.encode(XferDone("t", False, error="x" * (kv_transfer.MAX_ERROR_CHARS + 1)))
