"""The router's link to the metadata service, built on the service's client library
(`metadata_service.client.AsyncMetadataClient`, the one place each request is built; the
only part of that room the router may import).

`MetadataLink.prefix_hits(chain)`: which nodes hold how many leading blocks of the chain, and
(`PrefixHits.lower`) how many of those each holds only below its device, on its host or disk
(the KV tiers: the policy prices loading them back).
It answers from a **mirror** of the service's block index in the router's memory while the
mirror is in sync: a background task follows `WatchBlocks` (a snapshot of the whole index,
then every change in the order the service applied it) into a `core.block_index.BlockIndex`,
so a routing decision walks a local index (microseconds, no RPC). The mirror trails the
service by the time a change takes to arrive (milliseconds): fine for routing, whose answer is
a hint (a node sent a prefix it evicted a moment ago recomputes it).

While the mirror is not in sync (before the first snapshot completes; after the stream broke,
until a new snapshot completes) `prefix_hits` asks the service per request (`Query`). When
that fails too (unreachable, too slow), the link goes *degraded*: it answers from the last
mirror it had, stale as it may be (a metadata service that stalls or restarts must not turn
KV-aware routing off: a stale hit only costs a recompute; counted in `stale_answers`), or
returns None when it never had one (the policy routes on load alone); it stops asking for
`retry_s`, and recovers on the first successful query or completed snapshot after that.
The watch resubscribes after `backoff_s`, doubling up to `max_backoff_s`, back to
`backoff_s` once a snapshot completes; a subscriber the service cut off for falling behind
resubscribes the same way.

State for /health and /metrics: `available`, `failures`, `last_error` (the per-request path),
`mirror_in_sync`, `mirror_blocks`, `mirror_node_blocks()` (blocks per node), `mirror_syncs`
(snapshots loaded), `watch_error`, `bad_updates` (messages of a kind this router does not
know, skipped), `stale_answers`.
`attestations=` (a `router.routing.attestations.Attestations`, which the dispatcher feeds
with what it sends where) makes every answer count only the claims this router can vouch for:
each node's leading run stops at its first unattested block (whatever path answered: the
mirror, the service, the stale mirror), and the mirror tells the table what nodes claim and
release (a `ClaimsMirror`); the mirror's answers walk the table's index of attested claims.
`list_nodes()` is node discovery (each node with the KV identity it registered). `tls=` (a
`core.tls.ClientTLS`) opens a TLS channel (and presents a client certificate when the service
requires mTLS); without it, plaintext. A channel that cannot complete its handshake
(plaintext against a TLS service, a wrong CA, no client certificate under mTLS) fails calls
with UNAVAILABLE: the link goes degraded, as when the service is down. Construct the link
inside the running event loop (the gRPC channel needs one): the constructor starts the watch;
`close()` cancels it.

API: `MetadataLink`, `PrefixHits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from pdcluster.core.block_index import MEDIUM_BITS, BlockIndex
from pdcluster.core.events import DEVICE
from pdcluster.core.roles import Role
from pdcluster.core.tls import ClientTLS
from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.client import AsyncMetadataClient, medium_from_pb, node_identity
from pdcluster.metadata_service.errors import MetadataError
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.router.config import NodeSpec
from pdcluster.router.routing.attestations import Attestations, ClaimsMirror, cut_unattested

logger = logging.getLogger(__name__)

_ROLE_NAMES = {pb.PREFILL: Role.PREFILL, pb.DECODE: Role.DECODE}
_Update = pb.BlockUpdate


class PrefixHits(dict[NodeId, int]):
    """Leading blocks held per node; `lower` maps a node to how many of them it holds only on
    its host and only on disk (absent: all on its device)."""

    __slots__ = ("lower",)

    def __init__(self, hits=(), lower: dict[NodeId, tuple[int, int]] | None = None) -> None:
        super().__init__(hits)
        self.lower = lower or {}


def _index_hits(index: BlockIndex, chain: Sequence[BlockHash],
                attested: Attestations | None = None) -> PrefixHits:
    """Leading blocks per node: of the claims in `index`, or of those `attested` vouches for
    (its `held` index; the media are `index`'s)."""
    hits = PrefixHits((attested.held if attested is not None else index).query(chain))
    for node_id, num_blocks in hits.items():
        host, disk = index.lower_tiers(node_id, chain[:num_blocks])
        if host or disk:
            hits.lower[node_id] = (host, disk)
    return hits


class _BadUpdate(Exception):
    """A WatchBlocks message the mirror cannot apply: resubscribe for a fresh snapshot."""


class MetadataLink:
    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 0.5,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 mirror: bool = True, backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 keepalive_s: float = 10.0, tls: ClientTLS | None = None,
                 attestations: Attestations | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.available = True
        self.failures = 0
        self.last_error = ""
        self.mirror_in_sync = False
        self.mirror_syncs = 0
        self.watch_error = ""
        self.bad_updates = 0
        self.stale_answers = 0
        self.attestations = attestations
        self._identities: dict[NodeId, tuple] = {}  # as the last list_nodes saw each node
        self._synced_at = 0.0
        self._mirror: BlockIndex | None = None
        self._stale: BlockIndex | None = None  # the last mirror, kept while resyncing
        self._watch_task: asyncio.Task[None] | None = None
        self._clock = clock
        self._retry_at = 0.0
        # keepalive: a silently dead peer breaks the stream (the mirror would go stale)
        keepalive = [("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
                     ("grpc.keepalive_timeout_ms", int(max(1.0, keepalive_s / 2) * 1000))]
        self._client = AsyncMetadataClient(address, token=token, tls=tls,
                                           channel_options=keepalive, timeout_s=timeout_s)
        if mirror:
            self._watch_task = asyncio.create_task(self._watch_forever(), name="metadata-watch")

    @property
    def mirror_blocks(self) -> int:
        """Distinct blocks in the mirror (0 while it is not in sync)."""
        mirror = self._mirror
        return mirror.num_blocks if self.mirror_in_sync and mirror is not None else 0

    @property
    def answers_prefixes(self) -> bool:
        """Whether `prefix_hits` answers now (from the mirror, the service or the last mirror
        kept while resyncing) rather than returning None."""
        return self.mirror_in_sync or self.available or self._stale is not None

    async def prefix_hits(self, chain: Sequence[BlockHash]) -> PrefixHits | None:
        """Leading blocks held per node; None when degraded (route on load alone)."""
        if not chain:
            return PrefixHits()
        mirror = self._mirror
        if self.mirror_in_sync and mirror is not None:
            return _index_hits(mirror, chain, self.attestations)
        if not self.available and self._clock() < self._retry_at:
            return self._stale_hits(chain)
        try:
            matches = await self._client.query_tiers(chain)
        except MetadataError as exc:
            self._fail(exc)
            return self._stale_hits(chain)
        self._recover()
        return self._attested(
            PrefixHits({n: k for n, k, _, _ in matches},
                       {n: (host, disk) for n, _, host, disk in matches if host or disk}),
            chain, None)

    def _stale_hits(self, chain: Sequence[BlockHash]) -> PrefixHits | None:
        if self._stale is None:
            return None
        self.stale_answers += 1
        return self._attested(_index_hits(self._stale, chain), chain, self._stale)

    def _attested(self, hits: PrefixHits, chain: Sequence[BlockHash],
                  index: BlockIndex | None) -> PrefixHits:
        """An answer from elsewhere than the mirror, cut to the attested runs."""
        if self.attestations is not None:
            cut_unattested(self.attestations, hits, hits.lower, chain, index)
        return hits

    def mirror_node_hashes(self, node_id: NodeId) -> frozenset[BlockHash] | None:
        """The blocks the mirror says `node_id` holds; None while the mirror is not in sync."""
        mirror = self._mirror
        if not self.mirror_in_sync or mirror is None:
            return None
        return mirror.node_blocks(node_id) if mirror.has_node(node_id) else frozenset()

    def mirror_node_blocks(self) -> dict[NodeId, int]:
        """Blocks held per node in the mirror (empty while it is not in sync)."""
        mirror = self._mirror
        if not self.mirror_in_sync or mirror is None:
            return {}
        return {node_id: mirror.num_node_blocks(node_id) for node_id in mirror.node_ids}

    async def list_nodes(self) -> list[NodeSpec] | None:
        try:
            nodes = await self._client.list_nodes()
        except MetadataError as exc:
            self._fail(exc)
            return None
        self._recover()
        self._forget_changed(nodes)
        return [NodeSpec(n.node_id, _ROLE_NAMES.get(n.role, Role.BOTH), n.request_address,
                         n.kv_address, n.curve_public_key.encode(), node_identity(n))
                for n in nodes if n.request_address]

    def _forget_changed(self, nodes: Sequence[pb.NodeInfo]) -> None:
        """A node id that now names another incarnation (epoch, key or address) or left the
        list proves nothing its earlier one did: drop its attestations before the caller
        routes to it again (the mirror drops them too, when the service's removal arrives;
        this covers a change the watch did not show, e.g. while it resyncs)."""
        seen = {n.node_id: (n.epoch, n.curve_public_key, n.request_address, n.kv_address,
                            n.kv_session) for n in nodes}
        for node_id, identity in self._identities.items():
            if seen.get(node_id) != identity and self.attestations is not None:
                self.attestations.drop_node(node_id)
        self._identities = seen

    async def register_client(self, client_id: str, public_key: bytes, ttl_s: int,
                              ticket_public_key: bytes = b"") -> bool:
        """Register (or renew) this router's CURVE key and pull-ticket key; False if the
        service is unreachable or refused (logged: nodes will not admit this router until it
        succeeds)."""
        try:
            await self._client.register_client(client_id, public_key, ttl_s, ticket_public_key)
        except MetadataError as exc:
            self._fail(exc)
            return False
        self._recover()
        return True

    async def close(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.close()

    # -- the mirror ------------------------------------------------------------------------

    async def _watch_forever(self) -> None:
        backoff = self.backoff_s
        while True:
            try:
                await self._follow()
                reason = "the stream ended"
            except MetadataError as exc:
                reason = _reason(exc)
            except _BadUpdate as exc:
                reason = str(exc)
            except Exception as exc:  # the watch must outlive any one stream
                logger.exception("metadata watch failed")
                reason = repr(exc)
            if self.mirror_in_sync and self._clock() - self._synced_at > self.max_backoff_s:
                backoff = self.backoff_s  # a long-lived stream broke: retry soon
            self._lose_sync(reason)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.max_backoff_s)

    async def _follow(self) -> None:
        mirror = ClaimsMirror()  # told to the attestations once it is complete (_sync)
        async with contextlib.aclosing(self._client.watch_blocks()) as updates:
            async for update in updates:
                if update.kind == _Update.SNAPSHOT_COMPLETE:
                    self._sync(mirror)
                elif not _apply(mirror, update):
                    self.bad_updates += 1

    def _sync(self, mirror: ClaimsMirror) -> None:
        if self.attestations is not None:
            self.attestations.rebase(mirror)
            mirror.attestations = self.attestations
        self._mirror, self._stale = mirror, None
        self.mirror_in_sync = True
        self.mirror_syncs += 1
        self._synced_at = self._clock()
        self.watch_error = ""
        self._recover()
        logger.info("block index mirror in sync with %s: %d blocks on %d nodes",
                    self.address, mirror.num_blocks, len(mirror.node_ids))

    def _lose_sync(self, reason: str) -> None:
        if self.mirror_in_sync:
            logger.warning("block index mirror lost (%s): querying %s per request until it "
                           "resyncs", reason, self.address)
        self.mirror_in_sync = False
        if self.attestations is not None:  # no mirror says who holds what until a resync
            self.attestations.claims = None
        if self._mirror is not None:
            self._stale, self._mirror = self._mirror, None
        self.watch_error = reason

    # -- the per-request path --------------------------------------------------------------

    def _fail(self, exc: MetadataError) -> None:
        if self.available:
            logger.error("metadata service %s unreachable, routing on load only: %s",
                         self.address, exc.status or exc)
        self.available = False
        self.failures += 1
        self.last_error = _reason(exc)
        self._retry_at = self._clock() + self.retry_s

    def _recover(self) -> None:
        if not self.available:
            logger.warning("metadata service %s is back: prefix-aware routing", self.address)
        self.available = True
        self.last_error = ""


def _reason(exc: MetadataError) -> str:
    """"STATUS: details", as /health reports it."""
    return f"{exc.status}: {exc.details}" if exc.status else str(exc)


def _apply(mirror: BlockIndex, update: pb.BlockUpdate) -> bool:
    """One WatchBlocks message into the mirror (every change is an idempotent set operation);
    False for a kind this router does not know (a newer service), which is skipped."""
    kind, node_id = update.kind, update.node_id
    medium = _medium(update.medium)
    if kind in (_Update.SNAPSHOT, _Update.STORED, _Update.MOVED):
        if not mirror.has_node(node_id):
            mirror.add_node(node_id)
        if kind == _Update.SNAPSHOT:
            _apply_snapshot(mirror, node_id, _unpack(update), update.media)
        elif kind == _Update.STORED:
            mirror.add_blocks(node_id, _unpack(update), medium or DEVICE)
        else:
            src = _medium(update.src_medium)
            if src is None or medium is None:
                raise _BadUpdate("a MOVED update without both media")
            mirror.move_blocks(node_id, _unpack(update), src, medium)
    elif kind not in (_Update.REMOVED, _Update.CLEARED, _Update.NODE_REMOVED):
        return False
    elif not mirror.has_node(node_id):
        pass  # removing from a node the mirror does not know: nothing to do
    elif kind == _Update.REMOVED:
        mirror.remove_blocks(node_id, _unpack(update), medium)
    elif kind == _Update.CLEARED:
        mirror.clear_node(node_id)
    else:
        mirror.remove_node(node_id)
    return True


def _medium(value: int) -> str | None:
    try:
        return medium_from_pb(value, "BlockUpdate")
    except ValueError as exc:  # InvalidBatch: a medium this router does not know
        raise _BadUpdate(str(exc)) from exc


def _apply_snapshot(mirror: BlockIndex, node_id: NodeId, hashes: list[BlockHash],
                    media: bytes) -> None:
    """A SNAPSHOT chunk: its blocks, each on the media its mask names (none: the device)."""
    if not media:
        mirror.add_blocks(node_id, hashes)
        return
    if len(media) != len(hashes):
        raise _BadUpdate(f"a SNAPSHOT of {len(hashes)} hashes with {len(media)} media masks")
    for medium, bit in MEDIUM_BITS.items():
        on_medium = [h for h, mask in zip(hashes, media, strict=True) if mask & bit]
        if on_medium:
            mirror.add_blocks(node_id, on_medium, medium)


def _unpack(update: pb.BlockUpdate) -> list[BlockHash]:
    data, size = update.block_hashes, update.hash_size
    if size == 0 or len(data) % size:
        raise _BadUpdate(f"BlockUpdate with {len(data)} bytes of {size}-byte hashes")
    return [data[i:i + size] for i in range(0, len(data), size)]
