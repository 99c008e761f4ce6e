"""The request protocol between the router and the node servers (torch-free): ZMQ + msgpack,
versioned, typed. A node serves a ROUTER socket; a client (the router) talks through a DEALER.

Client -> node: `GenerateRequest` (tokens in, streamed tokens out), `AbortRequest`,
`LoadQuery`, `PrefillLost` (a decode node's prefill node died: stop waiting for its KV).
Node -> client: `TokenDelta` (every step that produced tokens; the last one has
`finished=True`), `RequestError` (the request was refused or failed, with an error code),
`LoadReport` (with `KVCosts`, what the node measured about KV it loads or pulls instead of
computing: the router prices its KV tiers with them). A request's sampling fields are
`core.sampling.SamplingSpec`, which this module also exports. Text is the client's business
(the router detokenizes); nodes deal in token ids.

`encode` / `decode` (the shared codec of `core.wire`) raise `WireError` for anything
malformed, unknown, or of another version. Never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pdcluster.core.pull_ticket import PullTicket
from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import MAX_ADDRESS_CHARS, MAX_ID_CHARS
from pdcluster.core.wire import MaxLen, Protocol, WireError

NODE_WIRE_VERSION = 2  # 2: PrefixSource.ticket
MAX_TRACEPARENT_CHARS = 64  # "00-<32 hex>-<16 hex>-<2 hex>" is 55
# Both ends' ZMQ sockets drop a larger frame before reading it (MAXMSGSIZE): a 1M-token
# prompt packs into about 5 MiB of msgpack.
MAX_FRAME_BYTES = 16 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_DELTA_TOKENS = 1 << 16  # tokens of one TokenDelta (one step's, or a first token)
MAX_TOP_LOGPROBS = 1024  # alternatives per token
MAX_TEXT_CHARS = 1 << 16  # error messages
MAX_CACHE_SALT_CHARS = 4096
Id = Annotated[str, MaxLen(MAX_ID_CHARS)]
Address = Annotated[str, MaxLen(MAX_ADDRESS_CHARS)]
Name = Annotated[str, MaxLen(32)]  # kinds, codes, roles, finish reasons
Text = Annotated[str, MaxLen(MAX_TEXT_CHARS)]
ERROR_CODES = ("invalid_request", "overloaded", "draining", "internal", "transfer_failed",
               "forbidden")
__all__ = ["ERROR_CODES", "MAX_FRAME_BYTES", "NODE_WIRE_VERSION", "AbortRequest",
           "GenerateRequest", "KVCosts", "LoadQuery", "LoadReport", "NodeMessage", "PrefillLost",
           "PrefixSource", "RequestError", "SamplingSpec", "TokenDelta", "TransferSpec",
           "decode", "encode"]


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """`kind` "remote_prefill" (this decode node receives the prompt's KV from the prefill
    node whose KV side channel is `source_addr`) or "remote_decode" (this prefill node sends
    it to whichever decode node asks for `transfer_id`)."""

    kind: Name
    transfer_id: Id
    source_addr: Address | None = None


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Global prefix reuse: the node whose KV side channel is `kv_address` holds the first
    `num_blocks` blocks of this prompt (per the metadata service when the router looked).
    The receiving node pulls the blocks it lacks from there instead of recomputing them; a
    stale hint (blocks evicted since) only means it computes more itself. `ticket`: the
    router's signed permission for the pull (core.pull_ticket), which the node forwards to
    the holder; a holder serves no pull without one."""

    kv_address: Address
    num_blocks: int
    ticket: PullTicket | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: Id
    prompt_token_ids: Annotated[list[int], MaxLen(MAX_PROMPT_TOKENS)]
    sampling: SamplingSpec
    transfer: TransferSpec | None = None
    cache_salt: Annotated[str, MaxLen(MAX_CACHE_SALT_CHARS)] | None = None
    prefix_source: PrefixSource | None = None
    # W3C trace context of the router's span (core.tracing): the node's spans join its trace
    traceparent: Annotated[str, MaxLen(MAX_TRACEPARENT_CHARS)] | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: Id


@dataclass(frozen=True, slots=True)
class PrefillLost:
    """Router -> decode node: the prefill node that was to send request `request_id`'s KV
    under `transfer_id` is gone (its connection closed). The node stops waiting for that KV
    at once and recomputes the prompt (or fails the request, by its policy) instead of
    waiting out its KV timeout."""

    request_id: Id
    transfer_id: Id
    reason: Text


@dataclass(frozen=True, slots=True)
class LoadQuery:
    pass


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: Id
    token_ids: Annotated[list[int], MaxLen(MAX_DELTA_TOKENS)]
    finished: bool = False
    finish_reason: Name | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: Annotated[list[float], MaxLen(MAX_DELTA_TOKENS)] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: Text | None = None
    # per new token, the top-k alternatives (sampling.logprobs = k > 0): their ids and
    # logprobs, best first; a token whose alternatives the node does not know has []
    top_token_ids: Annotated[list[Annotated[list[int], MaxLen(MAX_TOP_LOGPROBS)]],
                             MaxLen(MAX_DELTA_TOKENS)] | None = None
    top_logprobs: Annotated[list[Annotated[list[float], MaxLen(MAX_TOP_LOGPROBS)]],
                            MaxLen(MAX_DELTA_TOKENS)] | None = None


@dataclass(frozen=True, slots=True)
class RequestError:
    request_id: Id
    code: Name  # one of ERROR_CODES
    message: Text


@dataclass(frozen=True, slots=True)
class KVCosts:
    """What a node measured about KV it does not compute: its prefill rate (tokens/s, which
    turns seconds into prompt tokens), its KV bytes per token, and per source (its host tier,
    its disk tier, a pull from a peer) the bandwidth in bytes/s (0: not measured, or no such
    tier) and the fixed latency of one load."""

    prefill_tokens_per_s: float
    kv_bytes_per_token: float
    host_bytes_per_s: float = 0.0
    host_latency_s: float = 0.0
    disk_bytes_per_s: float = 0.0
    disk_latency_s: float = 0.0
    pull_bytes_per_s: float = 0.0
    pull_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.kv_bytes_per_token > 0):
            raise WireError("KVCosts needs prefill_tokens_per_s and kv_bytes_per_token > 0")
        for name in ("host_bytes_per_s", "host_latency_s", "disk_bytes_per_s",
                     "disk_latency_s", "pull_bytes_per_s", "pull_latency_s"):
            if not getattr(self, name) >= 0:
                raise WireError(f"KVCosts.{name} must be >= 0, got {getattr(self, name)}")

    def tokens(self, num_tokens: int, bytes_per_s: float, latency_s: float) -> float:
        """Loading `num_tokens` tokens' KV at this bandwidth, in prompt tokens of this node's
        prefill time."""
        seconds = latency_s + num_tokens * self.kv_bytes_per_token / bytes_per_s
        return seconds * self.prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class LoadReport:
    node_id: Id
    role: Name  # a core.roles.Role value
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    draining: bool = False
    kv_costs: KVCosts | None = None  # None: nothing measured yet


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
