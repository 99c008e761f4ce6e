"""Scale-in that keeps the cache: when a node starts draining, the router hands the hottest
prefixes it sent that node to peers that stay, through the existing pull path.

`HotPrefixes` remembers, per node, the prompts the router sent it (the prefilling node and
the decode node both hold a prompt's blocks afterwards), each with a score that decays with a
half-life (recent use counts most). A prompt that extends one already remembered (a
conversation's next turn) takes that entry's place and score: the longer prompt covers it.
At most `max_entries` per node are kept (the lowest score leaves).

`DrainWatcher` follows the nodes' load reports (the router's existing poll): a node whose
report says `draining` gets no new requests (the link is unhealthy from that report on), and
once per drain its `max_prefixes` hottest prompts are sent to peers of the same role, the
least busy first and spread over them, as a one-token request whose `prefix_source` names the
draining node: the peer pulls the blocks over the KV connector (docs/transfer.md) instead of
recomputing them, caches them, and publishes them to the index. The router attests each
prompt for its peer before sending it, as it does for any request it dispatches, so it routes
on those blocks at once. A prompt that fails (no peer, a refusal, a timeout) is counted and
skipped: the hand-off is best effort, and the drain goes on either way. Its state per node is
in `status` (/health's `draining`).

API: `HotPrefixes`, `DrainWatcher`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pdcluster.core.node_wire import GenerateRequest, TokenDelta
from pdcluster.core.roles import Role
from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import BlockHash
from pdcluster.router.routing.dispatch import Dispatcher
from pdcluster.router.routing.node_link import NodeLink

logger = logging.getLogger(__name__)
REBASE_HALF_LIVES = 256


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    cache_salt: str | None
    chain: tuple[BlockHash, ...]
    score: float = 0.0  # scaled by 2 ** (t / half_life): comparable without decaying


class HotPrefixes:
    """The prompts the router sent each node, hottest first (module docstring)."""

    def __init__(self, half_life_s: float = 300.0, max_entries: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s, self.max_entries, self._clock = half_life_s, max_entries, clock
        self._epoch = clock()
        self._nodes: dict[str, dict[BlockHash, _Prompt]] = {}

    def record(self, node_id: str, token_ids: list[int], cache_salt: str | None,
               chain: Sequence[BlockHash]) -> None:
        if not chain:
            return  # shorter than a block: nothing a peer could reuse
        entries = self._nodes.setdefault(node_id, {})
        exponent = (self._clock() - self._epoch) / self.half_life_s
        if exponent > REBASE_HALF_LIVES:  # rescale long before a score could overflow
            self._rebase(2.0 ** -exponent)
            exponent = 0.0
        weight = 2.0 ** exponent
        score = weight
        for block_hash in chain[:-1]:  # an earlier turn this prompt extends
            earlier = entries.pop(block_hash, None)
            if earlier is not None:
                score += earlier.score
        last = chain[-1]
        known = entries.pop(last, None)
        if known is not None:
            score += known.score
        entries[last] = _Prompt(list(token_ids), cache_salt, tuple(chain), score)
        if len(entries) > self.max_entries:
            coldest = min(entries, key=lambda h: entries[h].score)
            del entries[coldest]

    def _rebase(self, factor: float) -> None:
        self._epoch = self._clock()
        for entries in self._nodes.values():
            for prompt in entries.values():
                prompt.score *= factor

    def hottest(self, node_id: str, count: int) -> list[_Prompt]:
        entries = self._nodes.get(node_id, {})
        return sorted(entries.values(), key=lambda p: -p.score)[:count]

    def forget(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)


@dataclass(slots=True)
class HandoffStatus:
    state: str = "running"  # running | done
    prefixes: int = 0  # sent to a peer and answered
    failed: int = 0
    peers: dict[str, int] = field(default_factory=dict)  # peer -> prompts it took

    def as_dict(self) -> dict:
        return {"handoff": self.state, "prefixes": self.prefixes, "failed": self.failed,
                "peers": dict(self.peers)}


class DrainWatcher:
    """Hands off a draining node's hottest prompts once per drain (module docstring)."""

    def __init__(self, dispatcher: Dispatcher, hot: HotPrefixes, max_prefixes: int = 16,
                 timeout_s: float = 30.0) -> None:
        self.dispatcher, self.hot = dispatcher, hot
        self.max_prefixes, self.timeout_s = max_prefixes, timeout_s
        self.status: dict[str, HandoffStatus] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self, interval_s: float) -> None:
        self._task = asyncio.create_task(self._watch_forever(interval_s), name="drain-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # the watch must survive a bad round
                logger.exception("drain watch failed")
            await asyncio.sleep(interval_s)

    async def check(self) -> None:
        """Start a hand-off for every node newly reporting `draining`; forget a node that
        no longer does (a restarted incarnation drains afresh)."""
        for node_id, link in list(self.dispatcher.nodes.items()):
            draining = link.report is not None and link.report.draining
            if draining and node_id not in self.status:
                self.status[node_id] = HandoffStatus()
                await self.hand_off(link)
            elif not draining and node_id in self.status and link.healthy:
                del self.status[node_id]

    async def hand_off(self, source: NodeLink) -> HandoffStatus:
        status = self.status.setdefault(source.node_id, HandoffStatus())
        prompts = self.hot.hottest(source.node_id, self.max_prefixes)
        peers = self._peers(source)
        if source.spec.kv_address and peers:
            results = await asyncio.gather(*(
                self._warm(peers[i % len(peers)], source, prompt, status)
                for i, prompt in enumerate(prompts)))
            status.prefixes = sum(results)
            status.failed = len(results) - status.prefixes
        else:
            status.failed = len(prompts)
        status.state = "done"
        self.hot.forget(source.node_id)
        logger.info("node %s draining: %d hot prompts handed to %s (%d failed)",
                    source.node_id, status.prefixes, sorted(status.peers), status.failed)
        return status

    def _peers(self, source: NodeLink) -> list[NodeLink]:
        """Healthy nodes that can take the draining node's role, the least busy first."""
        role = source.spec.role
        able = [n for n in self.dispatcher.nodes.values()
                if n is not source and n.healthy
                and (n.spec.role in (role, Role.BOTH) or role == Role.BOTH)]
        return sorted(able, key=lambda n: (n.num_inflight, n.pending_tokens, n.node_id))

    async def _warm(self, peer: NodeLink, source: NodeLink, prompt: _Prompt,
                    status: HandoffStatus) -> bool:
        request = GenerateRequest(
            f"handoff-{uuid.uuid4().hex}", prompt.token_ids,
            SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True), None,
            prompt.cache_salt)
        request = replace(request, prefix_source=self.dispatcher.pull_source(
            request, peer.node_id, source, len(prompt.chain)))
        if self.dispatcher.attestations is not None:  # before the peer can claim them
            self.dispatcher.attestations.attest(peer.node_id, prompt.chain)
        stream = await peer.generate(request)
        try:
            async with asyncio.timeout(self.timeout_s):
                async for msg in stream:
                    if not isinstance(msg, TokenDelta):
                        return False
        except TimeoutError:
            await peer.abort(request.request_id)
            return False
        status.peers[peer.node_id] = status.peers.get(peer.node_id, 0) + 1
        return True
