"""KV-transfer contract shared by the engine, the KV connector and the nodes (torch-free).

- Transfer parameters a request carries: `RemotePrefill` on the decode node D (its KV comes
  from prefill node P) and `RemoteDecode` on P (its KV goes to a decode node, which contacts P).
- Side-channel messages (D <-> P, ZMQ + msgpack), versioned and typed:
  `XferRequest` (D -> P: "transfer T for request R: write your blocks [skip:] into these byte
  ranges of my registered region"), `XferAbort` (D -> P: "forget T") and `XferDone`
  (P -> D: "T done" with the first token, or "T failed: reason").
  `encode` / `decode` are the only (de)serialisers; `decode` raises `WireError` for anything
  malformed, of an unknown type or of another version. Never pickle.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

import msgpack

from core.types import ReqId

TransferId = str
WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20


class WireError(ValueError):
    """A side-channel message that cannot be accepted (malformed, unknown, wrong version)."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """On D: the prompt's KV arrives from the prefill node at `source_addr` (its side
    channel, e.g. "tcp://127.0.0.1:5600") under `transfer_id`."""

    transfer_id: TransferId
    source_addr: str


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """On P: after prefill, keep the blocks pinned until D's `XferRequest` for
    `transfer_id` has been served (or the transfer expires)."""

    transfer_id: TransferId


KVTransferParams = RemotePrefill | RemoteDecode


@dataclass(frozen=True, slots=True)
class XferRequest:
    transfer_id: TransferId
    request_id: ReqId  # D's request id, echoed back for logging
    reply_addr: str  # D's side channel, where XferDone goes
    dest_session: str  # D's transfer-engine session ("127.0.0.1:<rpc port>")
    block_nbytes: int  # must equal P's: same model, dtype and block size
    num_blocks: int  # blocks of the whole prompt
    skip_blocks: int  # leading blocks D already holds (its own prefix hit)
    dest_block_addrs: list[int]  # address of D's block i for i in [skip_blocks, num_blocks)


@dataclass(frozen=True, slots=True)
class XferAbort:
    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class XferDone:
    transfer_id: TransferId
    ok: bool
    first_token: int | None = None
    first_logprob: float | None = None
    error: str | None = None
    num_blocks_sent: int = 0
    num_descriptors: int = 0


SideChannelMessage = XferRequest | XferAbort | XferDone
_TYPES: dict[str, type] = {cls.__name__: cls for cls in (XferRequest, XferAbort, XferDone)}
_FIELD_TYPES = {
    XferRequest: {"transfer_id": str, "request_id": str, "reply_addr": str, "dest_session": str,
                  "block_nbytes": int, "num_blocks": int, "skip_blocks": int,
                  "dest_block_addrs": list},
    XferAbort: {"transfer_id": str},
    XferDone: {"transfer_id": str, "ok": bool, "first_token": (int, type(None)),
               "first_logprob": (float, int, type(None)), "error": (str, type(None)),
               "num_blocks_sent": int, "num_descriptors": int},
}


def encode(msg: SideChannelMessage) -> bytes:
    try:
        data = msgpack.packb({"v": WIRE_VERSION, "type": type(msg).__name__, "body": asdict(msg)})
    except (TypeError, ValueError) as exc:  # e.g. a numpy scalar in a field
        raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{type(msg).__name__} of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes) -> SideChannelMessage:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"not msgpack: {exc}") from exc
    if not isinstance(envelope, dict) or envelope.keys() != {"v", "type", "body"}:
        raise WireError("expected a {v, type, body} envelope")
    if envelope["v"] != WIRE_VERSION:
        raise WireError(f"unsupported wire version {envelope['v']!r}")
    cls = _TYPES.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if cls is None:
        raise WireError(f"unknown message type {envelope['type']!r}")
    return _build(cls, envelope["body"])


def _build(cls: type, body: object) -> SideChannelMessage:
    if not isinstance(body, dict):
        raise WireError(f"{cls.__name__} body must be a map")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    if not body.keys() <= names or not required <= body.keys():
        raise WireError(f"{cls.__name__} fields {sorted(body)} do not match {sorted(names)}")
    for name, value in body.items():
        expected = _FIELD_TYPES[cls][name]
        # bool is an int subclass: reject it where an int is meant, and vice versa.
        bad_bool = isinstance(value, bool) and expected in (int, (int, type(None)))
        if bad_bool or not isinstance(value, expected):
            raise WireError(f"{cls.__name__}.{name} has type {type(value).__name__}")
    if cls is XferRequest:
        _check_request(body)
    if cls is XferDone and isinstance(body.get("first_logprob"), int):
        body = {**body, "first_logprob": float(body["first_logprob"])}
    return cls(**body)


def _check_request(body: dict) -> None:
    addrs = body["dest_block_addrs"]
    if not all(isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in addrs):
        raise WireError("XferRequest.dest_block_addrs must be positive integers")
    if not 0 <= body["skip_blocks"] <= body["num_blocks"]:
        raise WireError("XferRequest.skip_blocks must be in [0, num_blocks]")
    if len(addrs) != body["num_blocks"] - body["skip_blocks"]:
        raise WireError("XferRequest needs one destination address per block past skip_blocks")
    if body["block_nbytes"] <= 0:
        raise WireError("XferRequest.block_nbytes must be positive")
