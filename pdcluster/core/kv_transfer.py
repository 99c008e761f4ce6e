"""KV-transfer contract shared by the engine, the KV connector and the nodes (torch-free).

- Transfer parameters a request carries: `RemotePrefill` on the decode node D (its KV comes
  from prefill node P) and `RemoteDecode` on P (its KV goes to a decode node, which contacts P).
  Independently of those, `PrefixPull` (global prefix reuse): the leading blocks of the prompt
  may be fetched from a holder node H instead of computed.
- Side-channel messages (ZMQ + msgpack), versioned and typed:
  `XferRequest` (D -> P: "transfer T for request R: write your blocks [skip:] into these byte
  ranges of my registered region"), `PrefixPullRequest` (requester -> H: "write the leading
  run you hold of these blocks into these byte ranges"; the blocks are named by the prompt's
  tokens and cache salt, never by hash, so that only a requester who knows both can read
  them: hashes are visible to anyone who watches the index; and the router's signed
  `PullTicket` for exactly that chain, core.pull_ticket), `XferAbort`
  ("forget T") and `XferDone` ("T done" with the first token or the number of blocks written,
  or "T failed: reason").
  `encode` / `decode` (the shared codec of `core.wire`) raise `WireError` for anything
  malformed, of an unknown type or of another version. Never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from pdcluster.core.pull_ticket import PullTicket
from pdcluster.core.types import MAX_ADDRESS_CHARS, MAX_ID_CHARS
from pdcluster.core.wire import MaxLen, Protocol, WireError

TransferId = str
# 2: PrefixPullRequest names blocks by tokens + salt; 3: requests carry the requester's
# tensor-parallel group (`dest_group`); 4: PrefixPullRequest carries the router's `ticket`;
# 5: a group carries each rank's segment offsets (vLLM's per-layer segments at TP > 1)
WIRE_VERSION = 5
# The largest message the caps allow (a pull of 1M tokens: ~5 MiB of ids, 1.2 MiB of
# addresses) fits; a side channel's ZMQ socket drops a larger frame before decrypting it.
MAX_MESSAGE_BYTES = 8 << 20
MAX_TRANSFER_BLOCKS = 1 << 17  # destinations of one transfer or pull
MAX_PULL_TOKENS = 1 << 20
MAX_ERROR_CHARS = 4096
# How a node words a receive it gives up because its source died (PrefillLost). A vLLM node
# tells its connector's scheduler side, in vLLM's engine core, as an `XferDone` that fails
# with it (vllm_backend/lost.py).
SOURCE_LOST = "prefill node lost"
# A KV layout has one segment per layer at most twice over (K and V apart): far below this.
MAX_SEGMENTS = 4096
MAX_TP_RANKS = 256  # ranks of one tensor-parallel group
Id = Annotated[str, MaxLen(MAX_ID_CHARS)]
Address = Annotated[str, MaxLen(MAX_ADDRESS_CHARS)]
Addresses = Annotated[list[int], MaxLen(MAX_TRANSFER_BLOCKS)]
Segments = Annotated[list[int], MaxLen(MAX_SEGMENTS)]


def _one_segment() -> list[int]:
    return [0]


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
class PrefixPull:
    """The node whose KV side channel is `source_addr` holds (per the metadata service) the
    first `num_blocks` blocks of this prompt: fetch the ones missing locally from there rather
    than compute them, if that saves enough blocks. A hint: a stale one only costs compute.
    `ticket`: the router's permission (core.pull_ticket), forwarded to the holder."""

    source_addr: str
    num_blocks: int
    ticket: PullTicket | None = None

    def __post_init__(self) -> None:
        if not self.source_addr or self.num_blocks < 1:
            raise ValueError("a PrefixPull needs source_addr and num_blocks >= 1")


@dataclass(frozen=True, slots=True)
class KVGroup:
    """The requester's tensor-parallel group, so that a writer whose ranks split the KV heads
    differently can map them (transfer/head_map.py): the model's `num_kv_heads` (MLA: 1),
    and for each rank, rank 0 first, its transfer-engine session and its KV region's base
    address. The request's `dest_block_addrs` are rank 0's; rank r's copy of a block lies at
    the same offset from `bases[r]`, holding rank r's heads (core.kv_ranks.rank_heads).
    `segment_offsets`: for a layout of several segments (vLLM's, one per layer), each rank's
    own offsets of its segments from its base, rank 0 first (every rank allocated its layers
    itself, so they differ); empty: one segment."""

    num_kv_heads: int
    sessions: Annotated[list[Address], MaxLen(MAX_TP_RANKS)]
    bases: Annotated[list[int], MaxLen(MAX_TP_RANKS)]
    segment_offsets: Annotated[list[Segments], MaxLen(MAX_TP_RANKS)] = field(
        default_factory=list)

    def rank_segments(self, rank: int) -> list[int]:
        """Rank `rank`'s segment offsets from its base."""
        return list(self.segment_offsets[rank]) if self.segment_offsets else [0]

    @property
    def tp_size(self) -> int:
        return len(self.sessions)


@dataclass(frozen=True, slots=True)
class XferRequest:
    transfer_id: Id
    request_id: Id  # D's request id, echoed back for logging
    reply_addr: Address  # D's side channel, where XferDone goes
    dest_session: Address  # D's transfer-engine session ("127.0.0.1:<rpc port>")
    block_nbytes: int  # must equal P's: same model, dtype and block size
    num_blocks: int  # blocks of the whole prompt
    skip_blocks: int  # leading blocks D already holds (its own prefix hit)
    dest_block_addrs: Addresses  # address of D's block i for i in [skip_blocks, num_blocks)
    # Where each segment of D's layout lies relative to segment 0 (core.kv_connector.KVRegion):
    # one segment ([0]) for the own engine, one per layer for vLLM. Both sides must agree on
    # the count and on block_nbytes (bytes of one block in one segment).
    dest_segment_offsets: Segments = field(default_factory=_one_segment)
    # D's tensor-parallel group (one rank: itself); None: a layout without addressable heads
    # (vLLM's), which only a writer of the very same layout serves
    dest_group: KVGroup | None = None


@dataclass(frozen=True, slots=True)
class PrefixPullRequest:
    """Requester -> holder H: H hashes `token_ids` (whole blocks of `block_size`) with the
    extra keys `cache_salt` / `lora_id` itself, and writes the leading run it still caches of
    blocks [first_block, first_block + len(dest_block_addrs)) into `dest_block_addrs` (same
    order), then answers `XferDone(num_blocks_sent=n)`."""

    transfer_id: Id
    request_id: Id  # the requester's request id, for logging
    reply_addr: Address
    dest_session: Address
    block_nbytes: int
    block_size: int
    first_block: int
    # blocks [0, first_block + len(dest_block_addrs)) of the prompt
    token_ids: Annotated[list[int], MaxLen(MAX_PULL_TOKENS)]
    dest_block_addrs: Addresses
    cache_salt: Annotated[str, MaxLen(4096)] | None = None
    lora_id: int | None = None
    dest_segment_offsets: Segments = field(default_factory=_one_segment)
    dest_group: KVGroup | None = None  # as XferRequest's
    # the router's permission for this pull (core.pull_ticket): a holder serves none without
    ticket: PullTicket | None = None


@dataclass(frozen=True, slots=True)
class XferAbort:
    transfer_id: Id
    # why the requester gave up, when it timed out waiting: the source logs what it lacked
    reason: Annotated[str, MaxLen(MAX_ERROR_CHARS)] | None = None


@dataclass(frozen=True, slots=True)
class XferDone:
    transfer_id: Id
    ok: bool
    first_token: int | None = None
    first_logprob: float | None = None
    error: Annotated[str, MaxLen(MAX_ERROR_CHARS)] | None = None
    num_blocks_sent: int = 0
    num_descriptors: int = 0


SideChannelMessage = XferRequest | PrefixPullRequest | XferAbort | XferDone
_PROTOCOL = Protocol(WIRE_VERSION, (XferRequest, PrefixPullRequest, XferAbort, XferDone),
                     MAX_MESSAGE_BYTES)


def encode(msg: SideChannelMessage) -> bytes:
    return _PROTOCOL.encode(msg)


def decode(data: bytes) -> SideChannelMessage:
    msg: SideChannelMessage = _PROTOCOL.decode(data)
    if isinstance(msg, XferRequest):
        _check_request(msg)
    elif isinstance(msg, PrefixPullRequest):
        _check_pull(msg)
    return msg


def _check_segments(offsets: list[int], where: str) -> None:
    if not 1 <= len(offsets) <= MAX_SEGMENTS or offsets[0] != 0:
        raise WireError(f"{where}.dest_segment_offsets must hold 1 to {MAX_SEGMENTS} offsets, "
                        "the first 0")


def _check_group(group: KVGroup | None, where: str) -> None:
    if group is None:
        return
    heads, size = group.num_kv_heads, group.tp_size
    if not size or len(group.bases) != size or not all(b > 0 for b in group.bases):
        raise WireError(f"{where}.dest_group needs a positive base address per session")
    if heads < 1 or (heads % size if heads >= size else size % heads):
        raise WireError(f"{where}.dest_group: {heads} KV heads cannot be split over {size} "
                        "ranks")
    offsets = group.segment_offsets
    if offsets and (len(offsets) != size or len({len(o) for o in offsets}) != 1):
        raise WireError(f"{where}.dest_group needs as many segment offsets for every rank")
    for rank_offsets in offsets:
        _check_segments(rank_offsets, f"{where}.dest_group")


def _check_request(msg: XferRequest) -> None:
    _check_segments(msg.dest_segment_offsets, "XferRequest")
    _check_group(msg.dest_group, "XferRequest")
    if not all(a > 0 for a in msg.dest_block_addrs):
        raise WireError("XferRequest.dest_block_addrs must be positive integers")
    if not 0 <= msg.skip_blocks <= msg.num_blocks:
        raise WireError("XferRequest.skip_blocks must be in [0, num_blocks]")
    if len(msg.dest_block_addrs) != msg.num_blocks - msg.skip_blocks:
        raise WireError("XferRequest needs one destination address per block past skip_blocks")
    if msg.block_nbytes <= 0:
        raise WireError("XferRequest.block_nbytes must be positive")


def _check_pull(msg: PrefixPullRequest) -> None:
    _check_segments(msg.dest_segment_offsets, "PrefixPullRequest")
    _check_group(msg.dest_group, "PrefixPullRequest")
    if msg.block_size <= 0 or msg.first_block < 0 or not msg.dest_block_addrs:
        raise WireError("PrefixPullRequest needs block_size > 0, first_block >= 0 and at "
                        "least one destination")
    if len(msg.token_ids) != (msg.first_block + len(msg.dest_block_addrs)) * msg.block_size:
        raise WireError("PrefixPullRequest.token_ids must hold exactly the blocks up to the "
                        "last one asked for")
    if not all(a > 0 for a in msg.dest_block_addrs):
        raise WireError("PrefixPullRequest.dest_block_addrs must be positive integers")
    if msg.block_nbytes <= 0:
        raise WireError("PrefixPullRequest.block_nbytes must be positive")
