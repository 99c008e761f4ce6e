"""A disaggregated cluster simulated for the planner's replay (router/sim/planner_replay.py):
prefill nodes and decode nodes that can be added (after a start-up) and drained while a
trace runs, with each request's TTFT and inter-token latency.

Service model (`PDConfig`; defaults: an 8B GQA model on one H100 per node):

- Reuse: a request's uncached prompt tokens come from one LRU prefix pool of
  `cache_blocks` trace blocks for the whole cluster (the KV-aware router with global prefix
  reuse reaches ~1.0x the ideal reuse, docs/router.md: placement is not what this replay
  studies); so a node leaving takes no cache with it, as the live planner's hand-off intends.
- Prefill: a FIFO server per node; a request waits behind the node's queue and takes
  `prefill_fixed_s + uncached / prefill_tokens_per_s`; the router sends it at arrival to
  the ready node whose queue ends first (the live load term). Its KV then moves to a decode
  node in `input_tokens * kv_bytes_per_token / transfer_bytes_per_s`.
- Decode: one continuous batch per node; a step takes `step_base_s + step_per_seq_s * B +
  step_per_ctx_token_s * ctx` (B sequences holding ctx tokens: prompt + half the output
  each, the mean over a life) and gives each sequence a token. A sequence joins the node
  with the fewest sequences when its KV arrives, if the batch has room (`max_batch`, KV
  memory `kv_tokens_per_node`), else it waits on that node. TTFT = arrival to the first step
  after it joins; its ITL = the mean step time over its output. Simulated as a fluid: a
  node counts steps done (a virtual clock advancing at 1 / step time), a sequence of O tokens
  joining at step v finishes at step v + O, so each join or finish costs a heap operation.
- Scaling: a node added at t serves from t + `startup_s`; a node removed drains (no new
  requests, it finishes what it holds) and is released when empty. Node-seconds count from
  the request to start to the release.

A request meets the SLOs when TTFT <= `slo_ttft_s` and its ITL <= `slo_itl_s`.

API: `PDConfig`, `SimRequest`, `sim_requests`, `PDCluster`, `Outcome`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

from pdcluster.router.sim.replay_config import TraceRequest
from pdcluster.router.sim.sim_nodes import TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class PDConfig:
    prefill_tokens_per_s: float = 10_000.0
    prefill_fixed_s: float = 0.005
    step_base_s: float = 0.012
    step_per_seq_s: float = 0.0002
    step_per_ctx_token_s: float = 4e-8  # 131 KB of KV read per token at ~3 TB/s
    max_batch: int = 256
    kv_tokens_per_node: int = 450_000  # ~60 GB of KV at 131 KB a token
    kv_bytes_per_token: int = 131_072
    transfer_bytes_per_s: float = 25e9
    startup_s: float = 30.0
    cache_blocks: int = 100_000  # trace blocks (512 tokens) in the cluster's prefix pool
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "transfer_bytes_per_s", "slo_ttft_s",
                     "slo_itl_s", "kv_tokens_per_node", "kv_bytes_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_fixed_s", "step_base_s", "step_per_seq_s",
                     "step_per_ctx_token_s", "startup_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_batch < 1 or self.cache_blocks < 1:
            raise ValueError("max_batch and cache_blocks must be >= 1")


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    input_tokens: int
    uncached_tokens: int
    output_tokens: int


def sim_requests(trace: list[TraceRequest], cache_blocks: int) -> list[SimRequest]:
    """The trace with each request's uncached prompt tokens from one LRU prefix pool."""
    pool: OrderedDict[object, None] = OrderedDict()
    out = []
    for req in trace:
        hits = 0
        for block_hash in req.block_hashes:
            if block_hash not in pool:
                break
            hits += 1
        for block_hash in reversed(req.block_hashes):  # the tail goes first
            pool[block_hash] = None
            pool.move_to_end(block_hash)
        while len(pool) > cache_blocks:
            pool.popitem(last=False)
        uncached = max(1, req.input_length - hits * TRACE_BLOCK_TOKENS)
        out.append(SimRequest(req.arrival_s, max(req.input_length, 1), uncached,
                              max(req.output_length, 1)))
    return out


class PrefillNode:
    __slots__ = ("started_at", "ready_at", "busy_until", "released_at", "draining",
                 "busy_s", "computed")

    def __init__(self, started_at: float, ready_at: float) -> None:
        self.started_at, self.ready_at, self.busy_until = started_at, ready_at, ready_at
        self.released_at: float | None = None
        self.draining = False
        self.busy_s = 0.0
        self.computed = 0.0


class DecodeNode:
    """One continuous batch as a fluid (module docstring)."""

    __slots__ = ("config", "started_at", "ready_at", "released_at", "draining", "steps", "at",
                 "batch", "ctx", "waiting", "version", "_seq")

    def __init__(self, config: PDConfig, started_at: float, ready_at: float) -> None:
        self.config, self.started_at, self.ready_at = config, started_at, ready_at
        self.released_at: float | None = None
        self.draining = False
        self.steps, self.at = 0.0, ready_at
        self.batch: list[tuple[float, int, int]] = []  # (finish step, seq, request index)
        self.ctx = 0.0
        self.waiting: deque[int] = deque()
        self.version = 0
        self._seq = itertools.count()

    @property
    def load(self) -> int:
        return len(self.batch) + len(self.waiting)

    def step_s(self, extra_seqs: int = 0, extra_ctx: float = 0.0) -> float:
        c = self.config
        return (c.step_base_s + c.step_per_seq_s * (len(self.batch) + extra_seqs)
                + c.step_per_ctx_token_s * (self.ctx + extra_ctx))

    def advance(self, now: float) -> None:
        if self.batch and now > self.at:
            self.steps += (now - self.at) / self.step_s()
        self.at = max(self.at, now)

    def fits(self, ctx: float) -> bool:
        return (len(self.batch) < self.config.max_batch
                and (not self.batch or self.ctx + ctx <= self.config.kv_tokens_per_node))

    def join(self, index: int, output_tokens: int, ctx: float) -> float:
        """Add a sequence now (after `advance`); returns the time of its first token."""
        first = self.at + self.step_s(1, ctx)
        heapq.heappush(self.batch, (self.steps + output_tokens, next(self._seq), index))
        self.ctx += ctx
        self.version += 1
        return first

    def next_finish(self) -> float | None:
        if not self.batch:
            return None
        return self.at + max(0.0, self.batch[0][0] - self.steps) * self.step_s()


@dataclass(slots=True)
class Outcome:
    """Per request: TTFT and ITL (None until known); misses counted as they become known."""

    ttft: list[float | None]
    itl: list[float | None]
    misses: int = 0
    done: int = 0

    def attainment(self) -> float:
        return 1.0 - self.misses / max(len(self.ttft), 1)


class PDCluster:
    """The nodes, their events and the per-request outcome; `run` drives it through a trace,
    calling `on_tick(now)` every `tick_s` (the planner) if given."""

    def __init__(self, config: PDConfig, requests: list[SimRequest], num_prefill: int,
                 num_decode: int, start_s: float = 0.0) -> None:
        self.config, self.requests = config, requests
        self.start_s = start_s
        self.prefill = [PrefillNode(start_s, start_s) for _ in range(num_prefill)]
        self.decode = [DecodeNode(config, start_s, start_s) for _ in range(num_decode)]
        self.outcome = Outcome([None] * len(requests), [None] * len(requests))
        self.first_token: list[float] = [0.0] * len(requests)
        self.now = start_s
        # (time, request index) as first tokens and finishes happen: the planner's signals
        self.first_log: list[tuple[float, int]] = []
        self.finish_log: list[tuple[float, int]] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()

    # ---- scaling ----------------------------------------------------------------------------

    def add_prefill(self, now: float) -> None:
        self.prefill.append(PrefillNode(now, now + self.config.startup_s))

    def add_decode(self, now: float) -> None:
        node = DecodeNode(self.config, now, now + self.config.startup_s)
        self.decode.append(node)
        self._push(node.ready_at, _READY, node)

    def remove_prefill(self, now: float) -> None:
        node = min(self.serving(self.prefill), key=lambda n: (n.ready_at <= now, n.busy_until))
        node.draining = True
        node.released_at = max(now, node.busy_until) if node.ready_at <= now else now

    def remove_decode(self, now: float) -> None:
        node = min(self.serving(self.decode), key=lambda n: (n.ready_at <= now, n.load))
        node.draining = True
        if node.load == 0:
            node.released_at = now

    @staticmethod
    def serving(nodes: list) -> list:
        """Nodes counted as running: started or starting, not draining."""
        return [n for n in nodes if not n.draining]

    def node_seconds(self, end_s: float) -> float:
        nodes: list[PrefillNode | DecodeNode] = [*self.prefill, *self.decode]
        return sum((n.released_at if n.released_at is not None else end_s) - n.started_at
                   for n in nodes)

    # ---- the event loop -----------------------------------------------------------------------

    def run(self, on_tick=None, tick_s: float = 10.0, max_misses: int | None = None) -> float:
        """Serve every request; returns the time the last one finished. Stops early (returning
        -1) once more than `max_misses` requests missed an SLO."""
        arrivals = iter(range(len(self.requests)))
        next_arrival = next(arrivals, None)
        if on_tick is not None:
            self._push(self.start_s, _TICK, None)
        while next_arrival is not None or self.outcome.done < len(self.requests):
            if max_misses is not None and self.outcome.misses > max_misses:
                return -1.0
            arrive_at = (self.requests[next_arrival].arrival_s if next_arrival is not None
                         else float("inf"))
            if self._events and self._events[0][0] <= arrive_at:
                at, _, kind, data = heapq.heappop(self._events)
                self.now = max(self.now, at)
                if kind == _TICK:
                    on_tick(self.now)
                    if next_arrival is not None or self.outcome.done < len(self.requests):
                        self._push(self.now + tick_s, _TICK, None)
                else:
                    self._handle(kind, data)
                continue
            assert next_arrival is not None, "no event and no arrival left"
            self.now = max(self.now, arrive_at)
            self._arrive(next_arrival)
            next_arrival = next(arrivals, None)
        return self.now

    def _push(self, at: float, kind: int, data: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, data))

    def _arrive(self, index: int) -> None:
        req, cfg, now = self.requests[index], self.config, self.now
        ready = [n for n in self.prefill if not n.draining and n.ready_at <= now]
        node = min(ready, key=lambda n: n.busy_until)
        service = cfg.prefill_fixed_s + req.uncached_tokens / cfg.prefill_tokens_per_s
        start = max(now, node.busy_until)
        node.busy_until = start + service
        node.busy_s += service
        node.computed += req.uncached_tokens
        kv_at = node.busy_until + req.input_tokens * cfg.kv_bytes_per_token \
            / cfg.transfer_bytes_per_s
        self._push(kv_at, _KV, index)

    def _handle(self, kind: int, data) -> None:
        if kind == _KV:
            self._to_decode(data)
        elif kind == _FINISH:
            node, version = data
            if version == node.version:
                self._finish(node)
        elif kind == _READY:
            self._admit(data)

    def _to_decode(self, index: int) -> None:
        ready = [n for n in self.decode if not n.draining and n.ready_at <= self.now]
        node = min(ready, key=lambda n: n.load)
        node.advance(self.now)
        node.waiting.append(index)
        self._admit(node)

    def _ctx(self, index: int) -> float:
        req = self.requests[index]
        return req.input_tokens + req.output_tokens / 2

    def _admit(self, node: DecodeNode) -> None:
        if node.ready_at > self.now:
            return
        node.advance(self.now)
        while node.waiting and node.fits(self._ctx(node.waiting[0])):
            index = node.waiting.popleft()
            req = self.requests[index]
            first = node.join(index, req.output_tokens, self._ctx(index))
            self.first_token[index] = first
            self.first_log.append((first, index))
            ttft = first - req.arrival_s
            self.outcome.ttft[index] = ttft
            if ttft > self.config.slo_ttft_s:
                self.outcome.misses += 1
        self._schedule(node)

    def _schedule(self, node: DecodeNode) -> None:
        at = node.next_finish()
        if at is not None:
            self._push(at, _FINISH, (node, node.version))

    def _finish(self, node: DecodeNode) -> None:
        node.advance(self.now)
        _, _, index = heapq.heappop(node.batch)
        node.ctx -= self._ctx(index)
        node.version += 1
        req = self.requests[index]
        itl = (self.now - self.first_token[index]) / max(req.output_tokens - 1, 1)
        self.outcome.itl[index] = itl
        self.finish_log.append((self.now, index))
        self.outcome.done += 1
        ttft = self.outcome.ttft[index]
        if itl > self.config.slo_itl_s and ttft is not None and ttft <= self.config.slo_ttft_s:
            self.outcome.misses += 1
        self._admit(node)
        if node.draining and node.load == 0 and node.released_at is None:
            node.released_at = self.now


_TICK, _KV, _FINISH, _READY = range(4)
