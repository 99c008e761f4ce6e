"""Deciding and sending, kept apart: `Dispatcher` owns the node clients, the metadata link and
the load loop; `place` asks the policy where a request goes (pure decision), `execute` sends
it there and yields the decode node's token deltas.

Nodes: the static ones of the config, and those the metadata service lists whose KV identity
is the cluster's (`router.routing.identity.ClusterIdentity`, which also names the block size
and hash scheme prompts are hashed with); the others are quarantined and sent nothing.

Work accounting: the dispatcher keeps `work` (`router.routing.load_decay.DecayedWork`, advanced by
the injected `clock`) and charges each node what it computes for it: the prompt tokens the
prefilling node neither holds nor pulls, once the request is sent, and `output_token_weight` per
token as D streams them. The policy sees each node's decayed total as `NodeView.recent_work`,
through `views` (`router.routing.node_views.NodeViews`: one view per node, kept current by events
rather than rebuilt per request). A node that appears later starts at the others' mean.

Disaggregated requests: D gets the request with transfer kind "remote_prefill" and P's KV
side-channel address; P gets it with kind "remote_decode" and max_tokens=1; both carry the
same fresh transfer id and are sent together. Tokens stream from D; P's own reply is drained
in the background. A P whose connection closed (its process died), or that refused the
request for a reason of its own (overloaded, draining, an internal error), is reported to D at
once (`PrefillLost`), and D computes the prompt itself instead of waiting out its KV timeout;
so is a P whose connection closes after it finished its part but before D streamed a token
(its KV leaves only when D asks for it). A P that only stopped answering (it may be hung, and
could still write the KV) is left to D's timeout, unless its connection then closes. P
refusing the request as invalid fails it (D would refuse it too).
Whatever ends the stream early (client gone, stop string, error), `execute`'s cleanup aborts
the request on both nodes. `execute` is one attempt; router.routing.migration moves a request whose
D is lost to another node.

API: `Dispatcher`, `Placement` (failures: `router.errors`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace

import zmq.asyncio

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.hashing import BlockExtra, hash_block_tokens
from pdcluster.core.identity import ROUTER_PREFIX
from pdcluster.core.kv_identity import tokenizer_digest
from pdcluster.core.node_wire import (
    GenerateRequest,
    PrefixSource,
    RequestError,
    TokenDelta,
    TransferSpec,
)
from pdcluster.core.pull_ticket import TicketSigner
from pdcluster.core.throttle import Throttle
from pdcluster.core.types import BlockHash
from pdcluster.router.config import NodeSpec, RouterConfig
from pdcluster.router.errors import NodeFailure, NoHealthyNode
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.attestations import Attestations, output_blocks
from pdcluster.router.routing.baselines import RoundRobin, least_loaded_config
from pdcluster.router.routing.identity import ClusterIdentity
from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.metadata_link import MetadataLink
from pdcluster.router.routing.node_link import NodeLink, NodeStream
from pdcluster.router.routing.node_views import NodeViews
from pdcluster.router.routing.policy import (
    RouteDecision,
    request_work,
    route,
)

logger = logging.getLogger(__name__)
KEY_LEASE_S = 30  # the router's key stays registered this long without a renewal
# renewed often: a metadata service that restarted empty (memory backend) knows the key again
# within this, before the nodes' directories let it go (core.identity's grace)
KEY_RENEW_S = 3.0


@dataclass(frozen=True, slots=True)
class Placement:
    decision: RouteDecision
    load_only: bool
    chain: Sequence[BlockHash] = ()  # the prompt's block hashes (KV-aware routing only)


class Dispatcher:
    """Decides where a request goes and sends it there.

    `shared_keys`: one CURVE pair every member holds, instead of a key pair of the router's
    own registered with the metadata service: static nodes without one, as tests and
    benchmarks run them. Nothing builds it from a configuration."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 shared_keys: CurveKeys | None = None) -> None:
        if shared_keys is None and config.metadata_address is None:
            raise ValueError("a router needs a metadata service (nodes admit it once it has "
                             "registered its key there)")
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.rng = random.Random(config.seed)
        self.work = DecayedWork(config.policy.work_half_life_s)
        self.nodes: dict[str, NodeLink] = {}
        self._round_robin = RoundRobin() if config.routing == "round_robin" else None
        self._policy = (least_loaded_config(config.policy) if config.routing == "least_loaded"
                        else config.policy)
        # the cluster's KV identity: the block size and hash scheme prompts are hashed with
        self.identity = ClusterIdentity(tokenizer_digest(config.model_dir),
                                        config.cluster_identity, clock)
        self._bind_block_size()
        self.views = NodeViews(self.work, self._policy, clock)  # the policy's view of each node
        self.metadata: MetadataLink | None = None
        self._context = zmq.asyncio.Context()
        # the router's own key pair, registered with the metadata service (nodes admit the
        # keys it names), or the pair every member shares
        self._shared_keys = shared_keys is not None
        self._curve = shared_keys or CurveKeys.generate()
        self.client_id = secrets.token_hex(8)
        # signs a ticket for every pull this router arranges (core.pull_ticket); its public
        # half is registered beside the CURVE key, so holders serve only those pulls
        self.tickets = TicketSigner(ROUTER_PREFIX + self.client_id)
        self._key_renewed_at = float("-inf")
        self._loop_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task] = set()
        # the claims this router can vouch for (router.routing.attestations)
        self.attestations = (Attestations(on_unattested=self._unattested)
                             if config.attest_claims else None)
        self._unattested_log = Throttle(10.0)

    async def start(self) -> None:
        if self.config.metadata_address:
            self.metadata = MetadataLink(
                self.config.metadata_address, token=self.config.metadata_token,
                timeout_s=self.config.metadata_timeout_s, retry_s=self.config.metadata_retry_s,
                mirror=self.config.index_mirror, tls=self.config.metadata_tls,
                attestations=self.attestations)
        await self._renew_key()
        self._sync_nodes(list(self.config.nodes))
        await self.refresh()
        self._loop_task = asyncio.create_task(self._refresh_forever(), name="router-load")

    async def _renew_key(self) -> None:
        """Register this router's key (again, within a third of its lease)."""
        if self.metadata is None or self._shared_keys:
            return
        now = self.clock()
        if now - self._key_renewed_at < KEY_RENEW_S:
            return
        if await self.metadata.register_client(self.client_id, self._curve.public, KEY_LEASE_S,
                                               self.tickets.public_key):
            self._key_renewed_at = now
        else:
            logger.error("could not register the router's key with the metadata service (%s); "
                         "nodes will not admit this router until it can",
                         self.metadata.last_error)

    def _sync_nodes(self, specs: list[NodeSpec]) -> None:
        for spec in specs:
            if not spec.curve_public_key and not self._shared_keys:
                continue  # a node without a key of its own: this router cannot check it
            known = self.nodes.get(spec.node_id)
            if known is not None and known.spec == spec:
                continue
            if known is not None:
                self._spawn(known.close())
            self.work.join(spec.node_id, self.clock())
            self.nodes[spec.node_id] = NodeLink(spec, self._context, curve=self._curve)
            self.views.add(self.nodes[spec.node_id])

    def _discovered(self, specs: list[NodeSpec]) -> None:
        """The registry's nodes: those sharing the cluster's KV identity are routed to; the
        others are quarantined (router.routing.identity), and dropped if they were admitted
        before (an id that registered again with another identity)."""
        admitted = self.identity.admit(specs)
        for node_id in self.identity.quarantined.keys() & self.nodes.keys():
            self.views.remove(node_id)
            self._spawn(self.nodes.pop(node_id).close())
        self._bind_block_size()
        self._sync_nodes(admitted)
        self.metrics.show_quarantine(self.identity.quarantined)

    def _bind_block_size(self) -> None:
        identity = self.identity.current
        block_size = 0 if identity is None else identity.block_size
        if self._policy.block_size != block_size:
            self._policy = replace(self._policy, block_size=block_size)

    async def refresh(self) -> None:
        """Discover nodes (metadata service) and poll every node's load once."""
        await self._renew_key()
        if self.metadata is not None:
            discovered = await self.metadata.list_nodes()
            if discovered is not None:
                self._discovered(discovered)
        await asyncio.gather(*(n.poll_load(self.config.node_timeout_s)
                               for n in self.nodes.values()))
        self.metrics.healthy_nodes.set(sum(n.healthy for n in self.nodes.values()))
        for node_id, work in self.work.values(self.clock()).items():
            self.metrics.recent_work.labels(node_id).set(work)
        if self.metadata is not None:
            self.metrics.metadata_available.set(int(self.metadata.available))
            self.metrics.mirror_in_sync.set(int(self.metadata.mirror_in_sync))
            self.metrics.mirror_blocks.set(self.metadata.mirror_blocks)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            try:
                await self.refresh()
            except Exception:  # the loop must survive a bad round
                logger.exception("router load refresh failed")

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the cluster's identity (0 before there is one)."""
        return self._policy.block_size

    @property
    def prefix_aware(self) -> bool:
        return self.metadata is not None and self.metadata.answers_prefixes

    async def place(self, prompt_ids: list[int], cache_salt: str | None) -> Placement:
        if self.config.routing != "kv":  # a cache-blind baseline (router.routing.baselines)
            return Placement(self.decide({}, len(prompt_ids)), load_only=False)
        hits, chain = await self._prefix_hits(prompt_ids, cache_salt)
        return Placement(self.decide(hits or {}, len(prompt_ids)), load_only=hits is None,
                         chain=chain)

    def decide(self, hits: dict[str, int], num_prompt_tokens: int) -> RouteDecision:
        """The decision proper, no I/O: `hits` (leading blocks per node) and the nodes'
        state through the policy."""
        views = self.views.current(hits)
        if not views:
            raise NoHealthyNode("no healthy node")
        if self._round_robin is not None:
            return self._round_robin.route(views, num_prompt_tokens, self.config.policy)
        return route(views, num_prompt_tokens, self._policy, self.rng)

    async def _prefix_hits(self, prompt_ids: list[int], salt: str | None
                           ) -> tuple[dict | None, list[BlockHash]]:
        identity, hash_config = self.identity.current, self.identity.hash_config
        if self.metadata is None or identity is None or hash_config is None:
            return None, []  # no cluster identity yet: no node to route to either
        chain = hash_block_tokens(prompt_ids, identity.block_size,
                                  BlockExtra(cache_salt=salt), hash_config)
        started = time.perf_counter()
        hits = await self.metadata.prefix_hits(chain)
        self.metrics.metadata_latency.observe(time.perf_counter() - started)
        self.metrics.metadata_available.set(int(self.metadata.available))
        return hits, chain

    def _unattested(self, node_id: str, num_blocks: int) -> None:
        self.metrics.unattested_claims.labels(node_id).inc(num_blocks)
        if self._unattested_log.ready():
            logger.warning("node %s claimed %d blocks whose tokens this router never gave it: "
                           "not routed on (%d such lines suppressed)", node_id, num_blocks,
                           self._unattested_log.take_suppressed())

    def _fills_a_block(self, num_before: int, num_after: int) -> bool:
        identity = self.identity.current
        if identity is None:
            return False
        return num_after // identity.block_size > num_before // identity.block_size

    def _attest_output(self, node: NodeLink, chain: Sequence[BlockHash],
                       request: GenerateRequest, generated: list[int]) -> None:
        """The decode node also caches the blocks of the tokens it generated."""
        identity, hash_config = self.identity.current, self.identity.hash_config
        if (self.attestations is not None and self.metadata is not None and generated
                and self.config.routing == "kv" and identity is not None
                and hash_config is not None):  # `chain` is the prompt's (maybe empty)
            self.attestations.attest(node.node_id, output_blocks(
                chain, request.prompt_token_ids, generated, identity.block_size,
                BlockExtra(cache_salt=request.cache_salt), hash_config))

    async def execute(self, placement: Placement, request: GenerateRequest
                      ) -> AsyncGenerator[TokenDelta, None]:
        decision = placement.decision
        decode = self.nodes[decision.decode_node]
        prefill = self.nodes[decision.prefill_node] if decision.prefill_node else None
        d_request, p_request = request, None
        if prefill is not None:
            transfer_id = uuid.uuid4().hex
            d_request = replace(request, transfer=TransferSpec(
                "remote_prefill", transfer_id, prefill.spec.kv_address or None))
            p_request = replace(request, transfer=TransferSpec("remote_decode", transfer_id),
                                sampling=replace(request.sampling, max_tokens=1))
        holder = self.nodes.get(decision.prefix_source or "")
        source = None if holder is None else self.pull_source(
            request, decision.prefill_node or decision.decode_node, holder,
            decision.prefix_source_blocks)
        if source is not None:  # global prefix reuse: the prefilling node pulls the prefix
            self.metrics.prefix_pulls.inc()
            if p_request is not None:
                p_request = replace(p_request, prefix_source=source)
            else:
                d_request = replace(d_request, prefix_source=source)
        if self.attestations is not None:  # before they can claim them
            for node in {decode, prefill or decode}:
                self.attestations.attest(node.node_id, placement.chain)
        streams: list[tuple[NodeLink, NodeStream]] = []
        failure: asyncio.Future[NodeFailure] = asyncio.get_running_loop().create_future()
        generated: list[int] = []
        d_began = asyncio.Event()  # D streamed its first token (or the attempt ended)
        try:
            if prefill is not None and p_request is not None:  # set together, above
                p_stream = await prefill.generate(p_request)
                streams.append((prefill, p_stream))
            d_stream = await decode.generate(d_request)
            streams.append((decode, d_stream))
            if prefill is not None:  # drained once D has the request: it may be told P died
                self._spawn(self._drain_prefill(prefill, p_stream, decode, d_request, failure,
                                                d_began))
            self._charge(prefill or decode, self._tokens_to_compute(decision, request, source))
            async for msg in _race(d_stream, failure):
                d_began.set()
                self._charge(decode, 0, len(msg.token_ids))
                before = len(request.prompt_token_ids) + len(generated)
                generated.extend(msg.token_ids)
                if self._fills_a_block(before, before + len(msg.token_ids)):
                    # as the tokens arrive: the node announces a block it has filled as soon
                    # as it has, which can reach the claims mirror before the stream ends
                    self._attest_output(decode, placement.chain, request, generated)
                yield msg
        finally:
            d_began.set()
            self._attest_output(decode, placement.chain, request, generated)
            # D ended early (client gone, error): P's part may be finished, its blocks pinned
            # for a transfer that D, still queued, never asked for; the abort frees them now
            # rather than at P's pin timeout (a no-op once P has sent them)
            d_ended_early = any(node is decode and (stream.lost or not stream.finished)
                                for node, stream in streams)
            for node, stream in streams:
                # a lost node may come back (it hung, its connection dropped): the abort
                # waits in the socket's queue and stops the request there
                if stream.lost or not stream.finished or (node is prefill and d_ended_early):
                    self.metrics.aborts.inc()
                    await node.abort(stream.request_id)

    async def _drain_prefill(self, prefill: NodeLink, stream: NodeStream, decode: NodeLink,
                             d_request: GenerateRequest, failure: asyncio.Future,
                             d_began: asyncio.Event) -> None:
        assert d_request.transfer is not None  # a disaggregated request
        transfer_id = d_request.transfer.transfer_id
        async for msg in stream:
            if not isinstance(msg, RequestError):
                continue
            if not stream.lost and msg.code == "invalid_request":  # D would refuse it too
                if not failure.done():
                    failure.set_result(NodeFailure(msg.code, f"prefill node: {msg.message}"))
                return
            if not stream.lost or prefill.disconnected:
                # P died, or cannot take the request now (overloaded, draining): its KV is
                # not coming, so D computes the prompt itself
                self.metrics.prefill_lost.labels("refused" if not stream.lost else "lost").inc()
                await decode.prefill_lost(d_request.request_id, transfer_id,
                                          f"{prefill.node_id}: {msg.code}: {msg.message}")
                return
            break  # P stopped answering: it may still write the KV, unless it dies (below)
        # P finished its part (or hangs), but its KV leaves only when D asks for it (D may
        # still be queued): should P's connection close before D's first token, D is told
        gone = prefill.gone()
        began: asyncio.Future[object] = asyncio.ensure_future(d_began.wait())
        try:
            await asyncio.wait((gone, began), return_when=asyncio.FIRST_COMPLETED)
        finally:
            began.cancel()
        if gone.done() and not d_began.is_set():
            self.metrics.prefill_lost.labels("lost").inc()
            await decode.prefill_lost(d_request.request_id, transfer_id,
                                      f"{prefill.node_id}: disconnected before its KV arrived")

    def _tokens_to_compute(self, decision: RouteDecision, request: GenerateRequest,
                           source: PrefixSource | None) -> int:
        """Prompt tokens the prefilling node computes: not those it holds, nor those it pulls."""
        held = decision.cached_tokens
        if source is not None:
            held = max(held, source.num_blocks * self.block_size)
        return len(request.prompt_token_ids) - held

    def pull_source(self, request: GenerateRequest, puller: str, holder: NodeLink,
                    num_blocks: int) -> PrefixSource | None:
        """The hint that `puller` may pull the prompt's first `num_blocks` blocks from
        `holder`, with this router's ticket for it. A puller never pulls the block holding
        the last prompt token (it computes it: the rule of both engines, the connector
        scheduler's `num_pull_blocks`), so the hint and its ticket stop before it: the ticket
        names exactly the chain the puller will ask for."""
        num_blocks = min(num_blocks, (len(request.prompt_token_ids) - 1) // self.block_size)
        if not holder.spec.kv_address or num_blocks < 1:
            return None
        ticket = self.tickets.sign(request.request_id, puller, holder.node_id,
                                   request.prompt_token_ids, self.block_size, num_blocks,
                                   request.cache_salt)
        return PrefixSource(holder.spec.kv_address, num_blocks, ticket)

    def _charge(self, node: NodeLink, uncached: int, output_tokens: int = 0) -> None:
        work = request_work(uncached, output_tokens, self.config.policy)
        if work > 0:
            self.work.add(node.node_id, work, self.clock())
            self.views.charged(node.node_id)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        background = list(self._background)
        for task in background:
            task.cancel()
        # a replaced node's link may be closing in one of them: once they end, a close that
        # had started has closed its sockets (`NodeLink.close`); one cancelled before it ran
        # has not, which `destroy` below covers
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)
        if self.metadata is not None:
            await self.metadata.close()
        # `destroy` closes any socket still open, where `term` would block the event loop for
        # good waiting on it
        self._context.destroy(linger=0)


async def _race(stream: NodeStream, failure: asyncio.Future) -> AsyncGenerator[TokenDelta, None]:
    """D's deltas, until D finishes or either node fails."""
    iterator = stream.__aiter__()
    while True:
        next_msg = asyncio.ensure_future(iterator.__anext__())
        try:
            done, _ = await asyncio.wait({next_msg, failure},
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # e.g. one of n samples closed early (router.api.fanout)
            next_msg.cancel()
            raise
        if failure in done:
            next_msg.cancel()
            raise failure.result()
        try:
            msg = next_msg.result()
        except StopAsyncIteration:
            return
        if isinstance(msg, RequestError):
            raise NodeFailure(msg.code, msg.message, lost=stream.lost)
        yield msg


__all__ = ["Dispatcher", "Placement"]
