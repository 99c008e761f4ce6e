"""`VllmEngine`: vLLM behind the node's engine interface (`engine.api.NodeEngine`).

vLLM runs as vLLM runs itself: `AsyncLLM` in the node process, its scheduler in an
engine-core process and its model in a worker process, pdcluster's KV connector inside both
(connector.py). `AsyncLLM` lives on an asyncio loop of its own thread; the node's engine
thread never waits on vLLM:

- `submit` checks the request, turns the spec and transfer into vLLM's `SamplingParams` and
  `kv_transfer_params`, and starts a task that iterates vLLM's output stream (deltas) into a
  queue; `step` drains that queue (waiting at most a few milliseconds when it is empty).
- `abort_request` forgets the request at once and asks vLLM to abort it in the background;
  until vLLM's figures include the abort (aborts.py), the node does not count as idle.
- `step` raises `engine.api.EngineFailure` once vLLM's engine is dead (a worker or its
  engine core died: failures.py), so that the node goes down instead of serving on; a dead
  engine counts as unfinished work, so that an idle node steps and notices too.
- Load and counters come from vLLM's stats (stats.py), KV events from vLLM's event
  publisher (events.py), the connector's KV address from the handshake folder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.events import KVEvent
from pdcluster.core.hashing import HashConfig
from pdcluster.core.identity import Directory
from pdcluster.core.kv_connector import TransferTiming
from pdcluster.core.kv_transfer import (
    KVTransferParams,
    PrefixPull,
    TransferId,
)
from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import BlockHash, ReqId
from pdcluster.engine.api import NodeEngine
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.outputs import EngineCounters, EngineLoad, RequestOutput
from pdcluster.vllm_backend.aborts import AbortTracker
from pdcluster.vllm_backend.connector_scheduler import kv_transfer_params
from pdcluster.vllm_backend.events import EventSubscriber
from pdcluster.vllm_backend.failures import is_dead, raise_if_dead
from pdcluster.vllm_backend.handshake import DirectoryServer, Handshake, endpoint
from pdcluster.vllm_backend.lost import LostNotifier
from pdcluster.vllm_backend.sampling import to_node_output, to_vllm_params
from pdcluster.vllm_backend.settings import ConnectorSettings, check_supported, engine_args
from pdcluster.vllm_backend.stats import (
    EngineStats,
    SerializedPrometheusStatLogger,
    logger_factory,
)
from pdcluster.vllm_backend.wake import Waker

logger = logging.getLogger(__name__)
_STEP_WAIT_S = 0.002
START_TIMEOUT_S = 900.0


@dataclass(slots=True)
class _Tracked:
    num_top: int
    prompt_len: int
    started: bool = False  # produced its first token


class VllmEngine(NodeEngine):
    """`connector`: the KV connector's settings (None: no connector, a node that neither
    sends nor receives KV); `curve`: the node's CURVE keys for the connector's side channel,
    `directory` the node's key directory (core.identity), copied to the connector's
    processes (None: the shared-key mode of `curve`)."""

    def __init__(self, config: EngineConfig, connector: ConnectorSettings | None = None,
                 curve: CurveKeys | None = None, directory: Directory | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        check_supported(config)
        # vLLM's events must carry the digests the router computes, not a 64-bit fold.
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
        # vLLM's CPU worker binds its threads to cores as if it had the machine to itself
        # (and keeps one core for its scheduler): with several nodes on a host they would
        # share one core. Unpinned unless the operator says otherwise.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.config = config
        self._handshake = Handshake()
        self._handshake.write_curve(curve)
        self._directory_server: DirectoryServer | None = None
        if directory is not None:  # the connector's processes admit whom the node admits
            directory.subscribe(self._handshake.write_peers)
            self._directory_server = DirectoryServer(self._handshake.dir, directory)
        settings = connector or ConnectorSettings(str(self._handshake.dir))
        settings = ConnectorSettings(**{**settings.as_extra_config(),
                                        "handshake_dir": str(self._handshake.dir)})
        self._stats = EngineStats()
        self._aborts = AbortTracker(lambda: self._stats.num_reports)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="vllm-engine")
        self._thread.start()
        args = engine_args(config, settings, self._handshake.dir,
                           with_connector=connector is not None)
        self._llm: Any = None
        self._wake = Waker(endpoint(self._handshake.dir, "wake"), self._poke)
        try:
            self._llm = self._run(self._start(args), start_timeout_s)
            self.kv_address = (self._handshake.wait_kv_address(start_timeout_s)
                               if connector is not None else "")
            self.kv_session = self._handshake.kv_session()
        except BaseException:
            if self._llm is not None:  # vLLM is up, the rest of the start failed
                self._llm.shutdown()
            self._wake.close()
            self._close_directory_server()
            self._shutdown_loop()
            self._handshake.close()
            raise
        vllm_config = self._llm.vllm_config
        self._num_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._vocab_size = int(vllm_config.model_config.get_vocab_size())
        self._events = EventSubscriber(f"ipc://{self._handshake.dir / 'kv-events'}",
                                       f"ipc://{self._handshake.dir / 'kv-replay'}")
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._requests: dict[ReqId, _Tracked] = {}
        self._step_times: list[float] = []
        self._has_connector = connector is not None
        self._lost = LostNotifier(endpoint(self._handshake.dir, "lost"))

    async def _start(self, args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        from pdcluster.vllm_backend.async_llm import NodeAsyncLLM

        # Constructed on the loop, so that its output handler starts on it.
        return NodeAsyncLLM.from_engine_args(
            AsyncEngineArgs(**args),
            stat_loggers=[logger_factory(self._stats), SerializedPrometheusStatLogger])

    def _poke(self) -> None:
        """Make vLLM's engine core look at its input (a cheap utility call): an idle engine
        then asks the connector whether it has work (a peer's pull to look up)."""
        if self._llm is not None:
            self._spawn(self._llm.is_sleeping())

    def _run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ---- NodeEngine: the request path ------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    @property
    def hash_config(self) -> HashConfig:
        return self.config.hash_config

    @property
    def accepts_prefix_pulls(self) -> bool:
        return self._has_connector

    def submit(self, request_id: ReqId, prompt_token_ids: list[int], sampling: SamplingSpec,
               *, cache_salt: str | None = None, kv_transfer: KVTransferParams | None = None,
               prefix_pull: PrefixPull | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self._check_prompt(prompt_token_ids, sampling)
        params = to_vllm_params(sampling, kv_transfer_params(kv_transfer, prefix_pull),
                                self.config.max_logprobs)
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        self._requests[request_id] = _Tracked(sampling.logprobs or 0, len(prompt_token_ids))
        self._spawn(self._generate(request_id, prompt, params, sampling.logprobs or 0))

    def _check_prompt(self, prompt: list[int], sampling: SamplingSpec) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + sampling.max_tokens > self._max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens "
                             f"({sampling.max_tokens}) exceeds the model's context of "
                             f"{self._max_model_len} tokens")
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise ValueError(f"token ids must be in [0, {self._vocab_size})")

    async def _generate(self, request_id: ReqId, prompt: dict[str, Any], params: Any,
                        num_top: int) -> None:
        try:
            async for out in self._llm.generate(prompt, params, request_id):
                self._outputs.put(to_node_output(out, num_top))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this request alone fails; the node goes on
            logger.warning("vLLM failed request %s: %s", request_id, exc)
            self._outputs.put(RequestOutput(request_id, [], [], [], True, "error",
                                            error=f"{type(exc).__name__}: {exc}"))

    def kv_source_lost(self, transfer_id: TransferId, reason: str) -> bool:
        """The receive's load lives in vLLM's engine core: the connector's scheduler side is
        told (vllm_backend/lost.py) and fails it at vLLM's next step, or as it is registered
        if vLLM has not got that far. True: the notice is on its way."""
        if not self._has_connector:
            return False
        return self._lost.send(transfer_id, reason)

    def abort_request(self, request_id: ReqId) -> bool:
        if self._requests.pop(request_id, None) is None:
            return False
        self._aborts.started()
        self._spawn(self._abort(request_id))
        return True

    async def _abort(self, request_id: ReqId) -> None:
        try:
            await self._llm.abort(request_id)
            # A round trip queued behind the abort: the engine core has applied it once this
            # answers (it serves its input in order).
            await self._llm.is_sleeping()
        except Exception as exc:  # vLLM is gone: nothing is left to free
            logger.warning("vLLM could not abort %s: %s", request_id, exc)
        finally:
            self._aborts.confirmed()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        try:
            outputs.append(self._outputs.get(timeout=_STEP_WAIT_S))
            while True:
                outputs.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        # After the drain: a request that vLLM's death failed fails as the node's loss.
        raise_if_dead(self._llm, self.config.tensor_parallel_size)
        kept = []
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue  # aborted by its client: late outputs are dropped
            tracked.started = tracked.started or bool(out.new_token_ids)
            if out.finished:
                del self._requests[out.request_id]
            kept.append(out)
        if kept:
            self._step_times.append(time.perf_counter() - started)
        return kept

    def has_unfinished_requests(self) -> bool:
        # A dead vLLM has one thing left to do, idle or not: a step that reports its death.
        return bool(self._requests) or not self._aborts.settled() or is_dead(self._llm)

    def has_runnable_requests(self) -> bool:
        return bool(self._requests)

    def has_pinned_blocks(self) -> bool:
        with self._stats.lock:
            return self._stats.transfers_in_flight > 0

    # ---- NodeEngine: figures -----------------------------------------------------------

    def load(self) -> EngineLoad:
        with self._stats.lock:
            running, waiting = self._stats.num_running, self._stats.num_waiting
            free = round((1.0 - self._stats.kv_cache_usage) * self._num_blocks)
        queued = sum(t.prompt_len for t in self._requests.values() if not t.started)
        return EngineLoad(waiting, running, free, self._num_blocks, queued)

    def counters(self) -> EngineCounters:
        load = self.load()
        stats = self._stats
        with stats.lock:
            return EngineCounters(
                load, self._num_blocks - load.num_free_blocks,
                len(self._events.cached_hashes()), stats.num_steps, 0.0,
                stats.num_preemptions, stats.num_prefix_queried_tokens,
                stats.num_prefix_hit_tokens)

    def take_step_times(self) -> list[float]:
        taken, self._step_times = self._step_times, []
        return taken

    def transfer_counters(self) -> dict[str, int]:
        with self._stats.lock:
            return dict(self._stats.transfer_counters)

    def take_transfer_latencies(self) -> list[TransferTiming]:
        return self._stats.take_latencies()

    def pool_state(self) -> dict[str, int]:
        unfinished = self.has_unfinished_requests()  # first: the figures read next are newer
        load = self.load()
        with self._stats.lock:
            in_flight = self._stats.transfers_in_flight
        return {"num_free_blocks": load.num_free_blocks, "num_blocks": load.num_blocks,
                "num_held_blocks": load.num_blocks - load.num_free_blocks,
                "num_pinned_requests": in_flight, "num_unfinished": int(unfinished)}

    def take_kv_events(self) -> list[KVEvent]:
        return self._events.take()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self._events.cached_hashes()

    def cached_block_media(self) -> dict[BlockHash, int]:
        return self._events.cached_media()

    def reset_prefix_cache(self) -> bool:
        if self._requests:
            return False
        reset = bool(self._run(self._llm.reset_prefix_cache()))
        if reset:
            self._events.note_cleared()
        return reset

    def describe(self) -> dict[str, Any]:
        import vllm

        return {"backend": "vllm", "version": vllm.__version__}

    def close(self) -> None:
        for request_id in list(self._requests):
            self.abort_request(request_id)
        llm, self._llm = self._llm, None
        try:
            llm.shutdown()
            del llm  # its __del__ shuts down again: now, not at interpreter exit
        finally:
            self._wake.close()
            self._close_directory_server()
            self._lost.close()
            self._events.close()
            self._shutdown_loop()
            self._handshake.close()

    def _close_directory_server(self) -> None:
        if self._directory_server is not None:
            self._directory_server.close()

    # ---- the loop thread ---------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
