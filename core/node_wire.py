"""The request protocol between the router and the node servers (torch-free): ZMQ + msgpack,
versioned, typed. A node serves a ROUTER socket; a client (the router) talks through a DEALER.

Client -> node: `GenerateRequest` (tokens in, streamed tokens out), `AbortRequest`,
`LoadQuery`. Node -> client: `TokenDelta` (every step that produced tokens; the last one has
`finished=True`), `RequestError` (the request was refused or failed, with an error code),
`LoadReport`. Text is the client's business (the router detokenizes); nodes deal in token ids.

`encode` / `decode` are the only (de)serialisers; `decode` raises `WireError` for anything
malformed, unknown, or of another version. Never pickle.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields

import msgpack

from core.kv_transfer import WireError
from core.types import ReqId

NODE_WIRE_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
ERROR_CODES = ("invalid_request", "overloaded", "draining", "internal", "transfer_failed")


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The sampling parameters a node accepts (mirrors engine.SamplingParams, minus text
    options the router handles)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """`kind` "remote_prefill" (this decode node receives the prompt's KV from the prefill
    node whose KV side channel is `source_addr`) or "remote_decode" (this prefill node sends
    it to whichever decode node asks for `transfer_id`)."""

    kind: str
    transfer_id: str
    source_addr: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: ReqId
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    transfer: TransferSpec | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: ReqId


@dataclass(frozen=True, slots=True)
class LoadQuery:
    pass


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: ReqId
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[float] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestError:
    request_id: ReqId
    code: str  # one of ERROR_CODES
    message: str


@dataclass(frozen=True, slots=True)
class LoadReport:
    node_id: str
    role: str  # "prefill" | "decode" | "both"
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    draining: bool = False


NodeMessage = (GenerateRequest | AbortRequest | LoadQuery | TokenDelta | RequestError
               | LoadReport)
_TOP_LEVEL = {cls.__name__: cls for cls in (GenerateRequest, AbortRequest, LoadQuery,
                                             TokenDelta, RequestError, LoadReport)}


def encode(msg: NodeMessage) -> bytes:
    try:
        data = msgpack.packb({"v": NODE_WIRE_VERSION, "type": type(msg).__name__,
                              "body": asdict(msg)})
    except (TypeError, ValueError) as exc:
        raise WireError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"{type(msg).__name__} of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def decode(data: bytes) -> NodeMessage:
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireError(f"not msgpack: {exc}") from exc
    if not isinstance(envelope, dict) or envelope.keys() != {"v", "type", "body"}:
        raise WireError("expected a {v, type, body} envelope")
    if envelope["v"] != NODE_WIRE_VERSION:
        raise WireError(f"unsupported node wire version {envelope['v']!r}")
    cls = _TOP_LEVEL.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if cls is None:
        raise WireError(f"unknown message type {envelope['type']!r}")
    msg = _build(cls, envelope["body"], cls.__name__)
    _check(msg)
    return msg


def _build(cls: type, body: object, where: str):
    if not isinstance(body, dict):
        raise WireError(f"{where} must be a map")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING}
    if not body.keys() <= names or not required <= body.keys():
        raise WireError(f"{where} fields {sorted(body)} do not match {sorted(names)}")
    return cls(**{k: _value(hints[k], v, f"{where}.{k}") for k, v in body.items()})


def _value(hint, value, where: str):
    """Check (and build nested dataclasses for) one field against its type hint."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise WireError(f"{where} must be a list")
        return [_value(args[0], v, f"{where}[]") for v in value]
    if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
        return _build(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise WireError(f"{where} has type {type(value).__name__}, expected {hint.__name__}")
    return value


def _check(msg: NodeMessage) -> None:
    if isinstance(msg, GenerateRequest):
        if msg.transfer is not None and msg.transfer.kind not in ("remote_prefill",
                                                                  "remote_decode"):
            raise WireError(f"unknown transfer kind {msg.transfer.kind!r}")
        if msg.transfer is not None and msg.transfer.kind == "remote_prefill" \
                and not msg.transfer.source_addr:
            raise WireError("a remote_prefill transfer needs source_addr")
    if isinstance(msg, RequestError) and msg.code not in ERROR_CODES:
        raise WireError(f"unknown error code {msg.code!r}")
