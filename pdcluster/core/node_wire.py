"""The request protocol between the router and the node servers (torch-free): ZMQ + msgpack,
versioned, typed. A node serves a ROUTER socket; a client (the router) talks through a DEALER.

Client -> node: `GenerateRequest` (tokens in, streamed tokens out), `AbortRequest`,
`LoadQuery`, `PrefillLost` (a decode node's prefill node died: stop waiting for its KV).
Node -> client: `TokenDelta` (every step that produced tokens; the last one has
`finished=True`), `RequestError` (the request was refused or failed, with an error code),
`LoadReport`. A request's sampling fields are `core.sampling.SamplingSpec`, which this
module also exports. Text is the client's business (the router detokenizes); nodes deal in
token ids.

`encode` / `decode` (the shared codec of `core.wire`) raise `WireError` for anything
malformed, unknown, or of another version. Never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import ReqId
from pdcluster.core.wire import Protocol, WireError

NODE_WIRE_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
ERROR_CODES = ("invalid_request", "overloaded", "draining", "internal", "transfer_failed")
__all__ = ["ERROR_CODES", "MAX_FRAME_BYTES", "NODE_WIRE_VERSION", "AbortRequest",
           "GenerateRequest", "LoadQuery", "LoadReport", "NodeMessage", "PrefillLost",
           "PrefixSource", "RequestError", "SamplingSpec", "TokenDelta", "TransferSpec",
           "decode", "encode"]


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """`kind` "remote_prefill" (this decode node receives the prompt's KV from the prefill
    node whose KV side channel is `source_addr`) or "remote_decode" (this prefill node sends
    it to whichever decode node asks for `transfer_id`)."""

    kind: str
    transfer_id: str
    source_addr: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Global prefix reuse: the node whose KV side channel is `kv_address` holds the first
    `num_blocks` blocks of this prompt (per the metadata service when the router looked).
    The receiving node pulls the blocks it lacks from there instead of recomputing them; a
    stale hint (blocks evicted since) only means it computes more itself."""

    kv_address: str
    num_blocks: int


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: ReqId
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    transfer: TransferSpec | None = None
    cache_salt: str | None = None
    prefix_source: PrefixSource | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: ReqId


@dataclass(frozen=True, slots=True)
class PrefillLost:
    """Router -> decode node: the prefill node that was to send request `request_id`'s KV
    under `transfer_id` is gone (its connection closed). The node stops waiting for that KV
    at once and recomputes the prompt (or fails the request, by its policy) instead of
    waiting out its KV timeout."""

    request_id: ReqId
    transfer_id: str
    reason: str


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
    # per new token, the top-k alternatives (sampling.logprobs = k > 0): their ids and
    # logprobs, best first; a token whose alternatives the node does not know has []
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(frozen=True, slots=True)
class RequestError:
    request_id: ReqId
    code: str  # one of ERROR_CODES
    message: str


@dataclass(frozen=True, slots=True)
class LoadReport:
    node_id: str
    role: str  # a core.roles.Role value
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    draining: bool = False


NodeMessage = (GenerateRequest | AbortRequest | LoadQuery | TokenDelta | RequestError
               | LoadReport | PrefillLost)
_PROTOCOL = Protocol(NODE_WIRE_VERSION, (GenerateRequest, AbortRequest, LoadQuery, TokenDelta,
                                         RequestError, LoadReport, PrefillLost),
                     MAX_FRAME_BYTES)


def encode(msg: NodeMessage) -> bytes:
    return _PROTOCOL.encode(msg)


def decode(data: bytes) -> NodeMessage:
    msg: NodeMessage = _PROTOCOL.decode(data)
    _check(msg)
    return msg


def _check(msg: NodeMessage) -> None:
    if isinstance(msg, GenerateRequest) and msg.transfer is not None:
        if msg.transfer.kind not in ("remote_prefill", "remote_decode"):
            raise WireError(f"unknown transfer kind {msg.transfer.kind!r}")
        if msg.transfer.kind == "remote_prefill" and not msg.transfer.source_addr:
            raise WireError("a remote_prefill transfer needs source_addr")
    source = msg.prefix_source if isinstance(msg, GenerateRequest) else None
    if source is not None and (not source.kv_address or source.num_blocks < 1):
        raise WireError("a prefix_source needs kv_address and num_blocks >= 1")
    if isinstance(msg, RequestError) and msg.code not in ERROR_CODES:
        raise WireError(f"unknown error code {msg.code!r}")
