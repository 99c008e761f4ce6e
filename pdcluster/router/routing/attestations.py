"""Which of the nodes' block claims this router can vouch for: a node's claim is routed on only
when the router itself gave the node the tokens of that block.

Why: a node publishes `BlockStored` for any hash it likes, and the metadata service takes the
claim at its word. Block hashes are public enough (the index, the WatchBlocks stream, a prompt
a member has seen), so without this a member could claim another tenant's salted prefix and
have that tenant's requests routed to it, or have peers told to pull that prefix from it.

The evidence is the router's own (docs/security.md, "Attested claims"): it hashes every prompt
(chained, salted per tenant) before routing and knows where it sends each request. A node's
claim on hash H is *attested* when this router

- dispatched to the node a request whose prompt's block chain contains H (the prefilling node
  and the decode node both get the prompt; `Dispatcher.execute`), or whose prompt plus the
  tokens the node generated for it does (the decode node caches its output's blocks too); or
- directed a pull of H into the node: the pulling node is always one the request was
  dispatched to, and the holder named is one whose claim was attested (routing only sees
  attested claims), so this case is the first one.

A host-tier move keeps the claim (same hash, same node): only a block leaving the node entirely
releases it.

State: `held`, the attested claims (a `BlockIndex` of the hashes the claims mirror says each
node holds and this router gave it: bounded by the mirror itself, released with the block;
routing walks it instead of the mirror: one walk for all nodes, as before), and per node
`pending`, attested hashes the node does
not hold now (dispatched, not stored yet; or stored, then evicted, and perhaps stored again by
the request that was sent for it: a REMOVED can overtake the STORED of a request in flight),
an LRU of at most `max_pending` hashes per node. A claim that neither names is *unattested*:
counted per node (`unattested_claims`, through `on_unattested`) and ignored for routing.
Answers that do not come from the mirror (the service's `Query` while it resyncs, the last
mirror while the service is down) are cut node by node at the first block that neither
`held` nor `pending` names (`cap`, `cut_unattested`).

Restarts and resyncs: the table lives in the router's memory, apart from the mirror (which is
rebuilt on every resync): a resync re-sorts the table against the new snapshot (`rebase`), so
attestations survive a metadata-service restart or a broken watch; a restarted router starts
with none (conservative: until its own dispatches attest them, it routes on load). Several
routers each keep their own table (see docs/router.md for what that costs in reuse).

API: `Attestations` (`held`, `attest`, `attested`, `cap`, `claimed`, `released`, `drop_node`,
`rebase`, `num_held`, `num_pending`, `unattested_claims`), `cut_unattested` (prefix hits
cut to their attested runs), `output_blocks` (the hashes of a request's generated
blocks), `ClaimsMirror` (a
`core.block_index.BlockIndex` that tells a table what nodes claim and release),
`MAX_PENDING_PER_NODE`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdcluster.core.block_index import BlockIndex
from pdcluster.core.hashing import BlockExtra, HashConfig, hash_block, root_hash
from pdcluster.core.types import BlockHash, NodeId

# per node: a few hundred long prompts in flight or recently evicted (~100 bytes a hash)
MAX_PENDING_PER_NODE = 65_536


class Attestations:
    def __init__(self, max_pending: int = MAX_PENDING_PER_NODE,
                 on_unattested: Callable[[NodeId, int], None] | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.on_unattested = on_unattested
        self.unattested_claims: dict[NodeId, int] = {}
        self.claims: BlockIndex | None = None  # the mirror in sync, if any: who holds what
        # attested claims: a BlockIndex, so a prefix lookup is one walk for all nodes, as in
        # the claims mirror (membership only: the media are the mirror's)
        self.held = BlockIndex()
        self._pending: dict[NodeId, OrderedDict[BlockHash, None]] = {}

    def num_held(self, node_id: NodeId) -> int:
        return self.held.num_node_blocks(node_id) if self.held.has_node(node_id) else 0

    def num_pending(self, node_id: NodeId) -> int:
        return len(self._pending.get(node_id, ()))

    def attested(self, node_id: NodeId, block_hash: BlockHash) -> bool:
        return ((self.held.has_node(node_id) and self.held.holds(node_id, block_hash))
                or block_hash in self._pending.get(node_id, ()))

    def attest(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        """The router gave `node_id` the tokens of these blocks."""
        claims = self.claims
        holds = claims.holds if claims is not None and claims.has_node(node_id) else None
        self.held.add_node(node_id)
        already = self.held.holds
        pending = self._pending.setdefault(node_id, OrderedDict())
        now_held = []
        for block_hash in block_hashes:
            if already(node_id, block_hash):  # the common case: the prefix it was routed for
                continue
            if holds is not None and holds(node_id, block_hash):
                now_held.append(block_hash)
                pending.pop(block_hash, None)
            else:
                pending[block_hash] = None
                pending.move_to_end(block_hash)
        self.held.add_blocks(node_id, now_held)
        self._trim(pending)

    def cap(self, node_id: NodeId, chain: Sequence[BlockHash], num_claimed: int) -> int:
        """How many of the node's `num_claimed` leading blocks of `chain` are attested (the
        walk for answers that did not come from the mirror: held or pending)."""
        pending = self._pending.get(node_id, ())
        held = self.held.holds if self.held.has_node(node_id) else None
        for i in range(num_claimed):
            block_hash = chain[i]
            if block_hash not in pending and (held is None or not held(node_id, block_hash)):
                return i
        return num_claimed

    # -- fed by the claims mirror (ClaimsMirror) --------------------------------------------

    def claimed(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        """The node now holds these blocks (it did not a moment ago)."""
        pending: dict[BlockHash, None] = self._pending.get(node_id) or {}
        self.held.add_node(node_id)
        now_held, num_unattested = [], 0
        for block_hash in block_hashes:
            if block_hash in pending:
                del pending[block_hash]
                now_held.append(block_hash)
            elif not self.held.holds(node_id, block_hash):
                num_unattested += 1
        self.held.add_blocks(node_id, now_held)
        if num_unattested:
            self.unattested_claims[node_id] = (self.unattested_claims.get(node_id, 0)
                                               + num_unattested)
            if self.on_unattested is not None:
                self.on_unattested(node_id, num_unattested)

    def released(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        """The node no longer holds these blocks: their attestations wait, bounded, in case
        a request in flight stores them again."""
        if not self.held.has_node(node_id) or not self.held.num_node_blocks(node_id):
            return
        gone = [h for h in block_hashes if self.held.holds(node_id, h)]
        self.held.remove_blocks(node_id, gone)
        pending = self._pending.setdefault(node_id, OrderedDict())
        pending.update(dict.fromkeys(gone))
        self._trim(pending)

    def drop_node(self, node_id: NodeId) -> None:
        """The node left the cluster: its next registration proves nothing it held."""
        self.held.remove_node(node_id)
        self._pending.pop(node_id, None)

    def rebase(self, claims: BlockIndex) -> None:
        """Re-sort every attestation against a fresh snapshot (a resync): held where the
        snapshot says the node holds it, pending (bounded) where not."""
        for node_id in set(self.held.node_ids) | set(self._pending):
            everything = list(self.held.node_blocks(node_id) if self.held.has_node(node_id)
                              else ()) + list(self._pending.get(node_id, ()))
            listed = claims.has_node(node_id)
            self.held.add_node(node_id)
            self.held.replace_node_blocks(
                node_id, [h for h in everything if listed and claims.holds(node_id, h)])
            self._pending[node_id] = OrderedDict.fromkeys(
                h for h in everything if not (listed and claims.holds(node_id, h)))
            self._trim(self._pending[node_id])
        self.claims = claims

    def _trim(self, pending: OrderedDict[BlockHash, None]) -> None:
        while len(pending) > self.max_pending:
            pending.popitem(last=False)


def output_blocks(chain: Sequence[BlockHash], prompt: Sequence[int], generated: Sequence[int],
                  block_size: int, extra: BlockExtra, config: HashConfig) -> list[BlockHash]:
    """The hashes of the full blocks past the prompt's `chain` that `prompt + generated`
    completes (the prompt's own are not hashed again)."""
    tail = list(prompt[len(chain) * block_size:]) + list(generated)
    parent = chain[-1] if chain else root_hash(config)
    hashes = []
    for start in range(0, len(tail) - block_size + 1, block_size):
        parent = hash_block(parent, tail[start:start + block_size], extra, config)
        hashes.append(parent)
    return hashes


def cut_unattested(table: Attestations, hits: dict[NodeId, int],
                   lower: dict[NodeId, tuple[int, int]], chain: Sequence[BlockHash],
                   index: BlockIndex | None) -> int:
    """Cut each node's run of leading blocks in `hits` (and its host / disk part in `lower`)
    at its first block `table` does not attest, in place; returns how many nodes were cut.
    `index` recounts a cut run's tiers; None (the service answered): they are scaled."""
    num_cut = 0
    for node_id, num_blocks in list(hits.items()):
        kept = table.cap(node_id, chain, num_blocks)
        if kept == num_blocks:
            continue
        num_cut += 1
        whole = lower.pop(node_id, None)
        if kept == 0:
            del hits[node_id]
            continue
        hits[node_id] = kept
        if index is not None:
            host, disk = index.lower_tiers(node_id, chain[:kept])
        elif whole is not None:  # at most `kept` in all, the host's first
            host = min(whole[0], kept)
            disk = min(whole[1], kept - host)
        else:
            host = disk = 0
        if host or disk:
            lower[node_id] = (host, disk)
    return num_cut


class ClaimsMirror(BlockIndex):
    """The claims mirror: a `BlockIndex` that reports to `attestations` (when set) every
    block a node starts or stops holding (a move between tiers is neither)."""

    __slots__ = ("attestations",)

    def __init__(self) -> None:
        super().__init__()
        self.attestations: Attestations | None = None

    def add_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                   medium: str = "device") -> int:
        table = self.attestations
        if table is None:
            return super().add_blocks(node_id, block_hashes, medium)
        hashes = list(block_hashes)
        new = [h for h in hashes if not self.holds(node_id, h)]
        num_new = super().add_blocks(node_id, hashes, medium)
        table.claimed(node_id, new)
        return num_new

    def move_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash], src: str,
                    dst: str) -> int:
        table = self.attestations
        hashes = list(block_hashes)
        new = [] if table is None else [h for h in hashes if not self.holds(node_id, h)]
        num_new = super().move_blocks(node_id, hashes, src, dst)
        if table is not None:
            table.claimed(node_id, new)
        return num_new

    def remove_blocks(self, node_id: NodeId, block_hashes: Iterable[BlockHash],
                      medium: str | None = None) -> int:
        hashes = list(block_hashes)
        num_gone = super().remove_blocks(node_id, hashes, medium)
        if self.attestations is not None and num_gone:
            self.attestations.released(node_id,
                                       [h for h in hashes if not self.holds(node_id, h)])
        return num_gone

    def clear_node(self, node_id: NodeId) -> int:
        gone = self.node_blocks(node_id) if self.attestations is not None else ()
        num_gone = super().clear_node(node_id)
        if self.attestations is not None:
            self.attestations.released(node_id, gone)
        return num_gone

    def remove_node(self, node_id: NodeId) -> int:
        num_gone = super().remove_node(node_id)
        if self.attestations is not None:
            self.attestations.drop_node(node_id)
        return num_gone

    def replace_node_blocks(
        self, node_id: NodeId, block_hashes: Iterable[BlockHash],
        media: Mapping[BlockHash, int] | None = None,
    ) -> tuple[set[BlockHash], set[BlockHash]]:
        removed, added = super().replace_node_blocks(node_id, block_hashes, media)
        if self.attestations is not None:
            self.attestations.released(node_id, removed)
            self.attestations.claimed(node_id, added)
        return removed, added
