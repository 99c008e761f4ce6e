"""`LLMEngine`: the step-level engine that nodes drive.

    engine = LLMEngine(EngineConfig(model="path/to/model"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():      # new tokens of every request that advanced
            ...
    engine.abort_request("r1")         # frees its blocks at once

It owns the tokenizer, the scheduler and KV cache manager (bookkeeping, torch-free) and the
model runner (torch). Bad requests raise ValueError at `add_request`, before any state changes
(engine/core/validation.py); a `RemoteDecode` request past the node's pin budget raises
`OverloadedError` (engine/core/pins.py). A fault while serving one request fails it alone (`step`).
With tensor parallelism (`tensor_parallel_size` ranks, engine/runner/tp_workers.py) a rank that
died or stalls makes `step` raise `TensorParallelError`, an `engine.api.EngineFailure`: the
engine is lost and its node restarts.

With a `KVConnector` (see core/kv_connector.py) the engine takes part in disaggregated
serving (with tensor parallelism too: every rank runs the connector's agent and moves its own
KV heads, core/kv_ranks.py): `add_request(..., kv_transfer=RemotePrefill(...))` on a decode
node waits for its prompt's KV instead of computing it; `kv_transfer=RemoteDecode(...)` on a
prefill node keeps the blocks pinned after prefill until the connector has sent them.
`prefix_pull=PrefixPull(holder's side channel, blocks it holds)` (global prefix reuse) pulls
the prompt's cached prefix from another node when that saves enough blocks, computing
whatever does not arrive; the engine also serves other nodes' pulls from its own prefix
cache. Each step first applies the connector's results, then schedules and runs the model,
then hands the connector the step's plan. On decode graphs a step of decodes launches the next
one before its own tokens reach the host (`overlap_decode`, engine/runner/lookahead.py).

Building the parts from the config is engine/engine_setup.py; turning a request into its
`RequestOutput` (stop strings included) is engine/output_builder.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from pdcluster.core.events import KVEvent
from pdcluster.core.hashing import BlockExtra, HashConfig
from pdcluster.core.kv_connector import KVConnector, KVRegion, TransferTiming
from pdcluster.core.kv_transfer import KVTransferParams, PrefixPull, RemotePrefill, TransferId
from pdcluster.core.node_wire import KVCosts
from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import BlockHash, ReqId
from pdcluster.engine.api import NodeEngine
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.kv_costs import KVCostMeter
from pdcluster.engine.core.outputs import EngineCounters, EngineLoad, RequestOutput
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.sampling_params import SamplingParams, check_guided
from pdcluster.engine.core.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pdcluster.engine.core.validation import RequestLimits, validate_keys, validate_request
from pdcluster.engine.engine_setup import (
    build_model,
    host_tier,
    kv_cache_spec,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_max_len,
)
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.output_builder import OutputBuilder
from pdcluster.engine.runner.model_runner import ModelRunner
from pdcluster.engine.runner.tp_workers import StepPeers
from pdcluster.engine.sample.structured_output import GrammarCompiler
from pdcluster.engine.spec_decode.decoder import SpecDecoder, build_proposer
from pdcluster.engine.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)
_STEP_TIMES_KEPT = 4096  # step durations kept for `take_step_times` (oldest dropped)


class LLMEngine(NodeEngine):
    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None) -> None:
        if config.backend != "pdcluster":
            raise ValueError(f"backend {config.backend!r} is not this engine: nodes build it "
                             "through pdcluster.node.engines")
        self.config = config
        self.connector = kv_connector
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        self.max_model_len = resolve_max_len(config, self.model_config)
        self.tokenizer = load_tokenizer(config.model)
        if config.tensor_parallel_size > 1 and kv_connector is not None \
                and kv_connector.worker.rank_agent() is None:
            raise ValueError("this KV connector cannot span tensor-parallel ranks "
                             "(tensor_parallel_size > 1)")
        model, peers = build_model(config, self.model_config, self.dtype, self.device,
                                   self.max_model_len)
        self.kv_spec = kv_cache_spec(config, self.model_config, self.dtype, self.device,
                                     self.max_model_len)
        if peers is not None:
            peers.allocate_kv(self.kv_spec)
        self.runner = ModelRunner(model, PagedKVCache(self.kv_spec, self.dtype, self.device),
                                  self.device, config.seed)
        self.runner.peers = self.peers = peers
        pool = BlockPool(self.kv_spec.num_blocks, config.block_size,
                         enable_caching=config.enable_prefix_caching,
                         enable_events=config.enable_kv_events)
        self.tiers, self.host_cache = host_tier(config, pool, self.runner.kv_cache, peers)
        self.cost_meter = KVCostMeter(self.kv_spec.block_nbytes / config.block_size)
        self.kv_manager = KVCacheManager(pool, config.enable_prefix_caching, self.tiers)
        max_pinned = max(1, int(config.max_pinned_fraction * self.kv_spec.num_blocks))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            self.max_model_len, max_pinned, config.pin_timeout_s),
            self.kv_manager, kv_connector.scheduler if kv_connector else None,
            config.hash_config)
        if kv_connector is not None:
            self._register_kv(kv_connector, peers)
        self._outputs = OutputBuilder(self.tokenizer, self.scheduler.finish_request)
        self.grammars = self._grammar_compiler()
        self._num_steps, self._step_seconds = 0, 0.0
        self._step_times: deque[float] = deque(maxlen=_STEP_TIMES_KEPT)
        self.limits = RequestLimits(self.model_config.vocab_size, config.max_logprobs,
                                    self.max_model_len, config.block_size,
                                    self.kv_spec.num_blocks, self.tokenizer is not None)
        self.spec_decoder = self._spec_decoder()
        self.uses_cuda_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                 and self.runner.capture_graphs(config.max_num_seqs,
                                                                self.max_model_len))
        self.kv_manager.before_free = self.runner.lookahead.fence
        self.overlap_decode = config.overlap_decode  # a benchmark compares both ways in one run
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens",
                    self.model_config.architecture, self.device, self.dtype,
                    self.kv_spec.num_blocks, config.block_size)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        """Structured output needs the tokenizer (a folder without one refuses guided
        requests at admission)."""
        if self.tokenizer is None:
            return None
        compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                   self.model_config.eos_token_ids)
        self.runner.sampler.use_grammars(compiler)
        return compiler

    def _spec_decoder(self) -> SpecDecoder | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        return SpecDecoder(spec, build_proposer(spec, self), self.max_model_len)

    def _register_kv(self, connector: KVConnector, peers: StepPeers | None) -> None:
        """Hand the connector this rank's KV region and, with tensor parallelism, the other
        ranks, each running the connector's agent with its own region (core.kv_ranks)."""
        if peers is None:
            connector.worker.register_kv_region(self.kv_region)
            return
        spec = connector.worker.rank_agent()
        assert spec is not None, "checked before the ranks started"
        connector.worker.register_kv_region(self.kv_region, peers.start_agents(spec))

    @classmethod
    def from_model(cls, model: str | Path, kv_connector: KVConnector | None = None,
                   **options) -> LLMEngine:
        return cls(EngineConfig(model=str(model), **options), kv_connector)

    @property
    def block_pool(self) -> BlockPool:
        return self.kv_manager.pool

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.kv_cache

    @property
    def kv_region(self) -> KVRegion:
        spec = self.kv_spec
        host = self.host_cache  # at TP > 1 rank 0's slice; each rank registers its own
        return KVRegion(self.kv_cache.data_ptr(), spec.total_nbytes, spec.block_nbytes,
                        spec.num_blocks, host_addr=host.tensor.data_ptr() if host else 0,
                        num_host_blocks=host.num_blocks if host else 0,
                        num_kv_heads=self.model_config.kv_layout[1])

    # ---- NodeEngine: what a node asks (engine/api.py) ----------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_spec.num_blocks

    @property
    def hash_config(self) -> HashConfig:
        return self.config.hash_config

    @property
    def accepts_prefix_pulls(self) -> bool:
        return self.connector is not None

    def prepare(self, sampling: SamplingSpec) -> Future[None] | None:
        if sampling.guided is None or self.grammars is None:
            return None  # without a tokenizer, submit refuses it
        check_guided(sampling.guided)  # its form and depth, before anything compiles it
        return self.grammars.compile_async(sampling.guided)

    def submit(self, request_id: ReqId, prompt_token_ids: list[int], sampling: SamplingSpec,
               *, cache_salt: str | None = None, kv_transfer: KVTransferParams | None = None,
               prefix_pull: PrefixPull | None = None) -> None:
        self.add_request(request_id, prompt_token_ids, SamplingParams.from_spec(sampling),
                         cache_salt=cache_salt, kv_transfer=kv_transfer,
                         prefix_pull=prefix_pull)

    def transfer_counters(self) -> dict[str, int]:
        return self.connector.worker.counters() if self.connector is not None else {}

    def take_transfer_latencies(self) -> list[TransferTiming]:
        return self.connector.worker.take_latencies() if self.connector is not None else []

    def kv_source_lost(self, transfer_id: TransferId, reason: str) -> bool:
        if self.connector is None:
            return False
        return self.connector.worker.fail_receive(transfer_id, reason)

    def recent_write_times(self) -> list[float]:
        worker = self.connector.worker if self.connector is not None else None
        stats = getattr(worker, "stats", None)  # the Mooncake worker keeps them
        return list(stats.recent_write_s) if stats is not None else []

    def kv_costs(self) -> KVCosts | None:
        host_cache = self.host_cache
        host = host_cache.loads.fit() if host_cache is not None else None
        disk = host_cache.disk.loads.fit() if host_cache and host_cache.disk else None
        return self.cost_meter.costs(host, disk)

    def pool_state(self) -> dict[str, int]:
        pool = self.block_pool
        return {"num_free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "num_held_blocks": sum(1 for b in pool.blocks if b.ref_cnt),
                "num_pinned_requests": len(self.scheduler.pinned),
                "num_unfinished": int(self.has_unfinished_requests())}


    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token ids")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def add_request(self, request_id: ReqId, prompt: str | list[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    arrival_time: float | None = None,
                    kv_transfer: KVTransferParams | None = None,
                    prefix_pull: PrefixPull | None = None) -> Request:
        """`prefix_pull` is ignored with `RemotePrefill`: the whole prompt's KV arrives."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        validate_keys(request_id, cache_salt)
        validate_request(token_ids, params, self.limits)
        if params.guided is not None:
            assert self.grammars is not None, "validation refuses guided without a tokenizer"
            self.grammars.check(params.guided)
        if (kv_transfer is not None or prefix_pull is not None) and self.connector is None:
            raise ValueError("kv_transfer or prefix_pull was given but this engine has no KV "
                             "connector")
        if isinstance(kv_transfer, RemotePrefill):
            prefix_pull = None
        extra = BlockExtra(cache_salt=cache_salt) if cache_salt else None
        req = Request(request_id, token_ids, params, self.config.block_size,
                      self.model_config.eos_token_ids, extra, self.config.hash_config,
                      arrival_time, kv_transfer, prefix_pull)
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: ReqId) -> bool:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return req is not None

    def _forget(self, request_id: ReqId) -> None:
        """Drop per-request state kept outside the scheduler (seeded generators, drafts)."""
        self.runner.sampler.forget(request_id)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_runnable_requests(self) -> bool:
        """Work a step can advance now (not only requests waiting for remote KV)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def load(self) -> EngineLoad:
        scheduler, pool = self.scheduler, self.block_pool
        queued = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
        queued += sum(r.num_tokens - r.num_computed_tokens
                      for r in scheduler.running if r.is_prefilling)
        return EngineLoad(len(scheduler.waiting),
                          len(scheduler.running) + len(scheduler.waiting_for_remote),
                          pool.num_free_blocks, pool.num_blocks, queued)

    def counters(self) -> EngineCounters:
        """The engine's figures for metrics (call it on the thread that steps the engine)."""
        pool, scheduler, spec = self.block_pool, self.scheduler, self.spec_decode_stats()
        return EngineCounters(self.load(), pool.num_blocks - pool.num_free_blocks,
                              len(pool.cached_block_map), self._num_steps,
                              self._step_seconds, scheduler.num_preemptions,
                              scheduler.num_prefix_queried_tokens,
                              scheduler.num_prefix_hit_tokens,
                              spec.num_draft_tokens if spec else 0,
                              spec.num_accepted_tokens if spec else 0)

    def take_step_times(self) -> list[float]:
        """Seconds of each step since the last call (at most the latest 4,096), for a
        step-time histogram."""
        times = list(self._step_times)
        self._step_times.clear()
        return times

    def take_kv_events(self) -> list[KVEvent]:
        """The block pool's KV events since the last call (empty without enable_kv_events)."""
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        """The hashes of every block in the prefix cache, on either tier. Safe from another
        thread: list() of a dict copies it atomically under the GIL, while the engine thread
        may be mid-step."""
        if self.tiers is not None:
            return self.tiers.cached_hashes()
        return list(self.block_pool.cached_block_map)

    def cached_block_media(self) -> list[BlockHash] | dict[BlockHash, int]:
        if self.tiers is not None:
            return self.tiers.cached_media()
        return self.cached_block_hashes()

    def has_pinned_blocks(self) -> bool:
        """Transfer work that holds blocks or soon will (drain it before shutdown): finished
        requests waiting to send, blocks serving another node's pull, or such a pull still
        waiting for a step to look it up."""
        pulls = self.scheduler.pulls
        if self.scheduler.pinned or pulls.serving or pulls.pending:
            return True
        return self.connector is not None and self.connector.worker.has_pending_work()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (a KV event tells the global index), e.g. between
        benchmark runs. Only when idle: False, and nothing changes, while a request or a
        transfer holds blocks."""
        if self.has_unfinished_requests() or self.has_pinned_blocks():
            return False
        if self.tiers is not None and self.host_cache is not None:
            if not self.host_cache.collect(self.tiers, wait=True):
                return False
            return self.tiers.reset()
        return self.block_pool.reset_prefix_cache()

    def close(self) -> None:
        if self.runner.peers is not None:
            self.runner.peers.close()
        if self.connector is not None:
            self.connector.worker.close()
        if self.host_cache is not None:
            self.host_cache.close()

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step. Returns an output for every request that gained tokens or
        finished; `new_token_ids` holds the tokens not returned before.

        Per-request isolation: a failure in a per-request stage (sampling, stop checks,
        detokenising, building the output) finishes only that request, with finish_reason
        "error"; the others go on unchanged. A failure of the batch as a whole (the model
        forward, the scheduler, the connector) still raises here, and the caller fails every
        request of the step (the node server answers each with an "internal" error)."""
        started = time.perf_counter()
        if self.peers is not None:  # a rank gone (even between forwards): fail at once
            self.peers.check()
        updated: list[Request] = []
        if self.connector is not None:
            results = self.connector.worker.get_results()
            updated += self.scheduler.apply_connector_results(results)
        if self.tiers is not None and self.host_cache is not None:
            self.host_cache.collect(self.tiers)
        sched = self.scheduler.schedule(self._propose(), self.runner.lookahead.pending_ids())
        if self.tiers is not None and self.host_cache is not None:  # before the model writes
            self.host_cache.flush(self.tiers)
        if not sched.is_empty:
            run_started = time.perf_counter()
            sampled = self.runner.execute(sched, self._next_decodes(sched))
            self.cost_meter.record_step(
                sum(s.num_tokens for s in sched.scheduled if s.num_tokens > 1),
                sched.num_batched_tokens, time.perf_counter() - run_started)
            updated += self.scheduler.update_from_output(sched, sampled)
            if self.spec_decoder is not None:
                self.spec_decoder.record(sched, sampled)
        if self.connector is not None:
            self.scheduler.expire_pins()
            self.connector.worker.execute(self.connector.scheduler.build_plan())
        elapsed = time.perf_counter() - started
        self._num_steps += 1
        self._step_seconds += elapsed
        self._step_times.append(elapsed)
        unique = {req.request_id: req for req in updated}
        return [self._output_or_error(req, elapsed) for req in unique.values()]

    def _next_decodes(self, sched: SchedulerOutput) -> list[ScheduledRequest] | None:
        """The decode step to launch before this one's tokens reach the host, if any
        (engine/runner/lookahead.py): with `overlap_decode`, on decode graphs, at one rank,
        without speculative decoding (whose steps verify proposals, never replay)."""
        if not self.overlap_decode or self.peers is not None \
                or self.spec_decoder is not None or not self.runner.replays(sched.scheduled):
            return None
        return self.scheduler.next_decodes(sched)

    def _propose(self) -> dict[ReqId, list[int]] | None:
        """This step's proposed tokens per request (speculative decoding), or None when off."""
        if self.spec_decoder is None:
            return None
        self.spec_decoder.retain(set(self.scheduler.requests))
        return self.spec_decoder.propose(self.scheduler.running)

    def _output_or_error(self, req: Request, step_s: float) -> RequestOutput:
        try:
            out = self._outputs.output(req, step_s)
        except Exception:
            logger.exception("building the output of request %s failed", req.request_id)
            self.scheduler.fail_request(req, "detokenising its output failed on the node")
            self._forget(req.request_id)
            return self._outputs.error_output(req, step_s)
        if out.finished:
            self._forget(req.request_id)
        return out

    def stats(self) -> dict[str, float]:
        pool, pins = self.block_pool, self.scheduler.pins
        return {"num_waiting": self.scheduler.num_waiting,
                "num_running": len(self.scheduler.running),
                "num_free_blocks": pool.num_free_blocks, "kv_usage": pool.usage,
                "num_pinned_blocks": pins.num_used, "num_pin_refusals": pins.num_refused,
                "num_pins_expired": pins.num_expired,
                **(self.tiers.stats() if self.tiers is not None else {}), **self._spec_stats()}

    def _spec_stats(self) -> dict[str, float]:
        return {} if self.spec_decoder is None else self.spec_decoder.stats.as_dict()

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters (proposed, accepted, per position), None when
        off: what a node maps to its metrics."""
        return None if self.spec_decoder is None else self.spec_decoder.stats


__all__ = ["LLMEngine", "SchedulerOutput"]
