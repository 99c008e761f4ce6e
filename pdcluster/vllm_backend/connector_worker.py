"""The worker side of pdcluster's connector inside vLLM (its worker process): the project's
`ConnectorWorker` over Mooncake and the CURVE side channel, on vLLM's paged KV cache.

- `kv_region` describes vLLM's per-layer cache tensors as one `KVRegion` of many segments
  (one per layer): block b of a layer is one byte run, so n consecutive blocks travel as one
  descriptor per segment. Both nodes run the same model and engine, so their segments line up
  one to one (the worker checks count and size). The connector asks vLLM for the layout
  LBHNC (CPU and GPU alike), where a block of a layer holds its KV heads outermost, so the
  region names the model's KV heads and nodes of different tensor-parallel sizes map head
  ranges (transfer/head_map.py).
- With tensor parallelism vLLM builds this side in every rank: rank 0 is the node's connector
  (`VllmWorkerSide`, driving the other ranks' writes through `ranks.RankClients`); ranks
  r >= 1 only register their KV slice and write what rank 0 plans (`VllmRankSide`).
- Each step's plan (built by the scheduler side) is executed: when the step's loads start,
  receives whose source is lost fail, then receives, pulls and cancels start; sends after
  the step's forward (`wait_for_save`), so a prefill node never sends KV its model has not
  finished writing.
- The worker's results become vLLM's: sends released (`finished_sending`), receives done
  (`finished_recving`, failures also in `failed_recving`, with the blocks they should have
  filled reported as load errors so vLLM recomputes them), and the whole `ConnectorResults`
  goes back to the scheduler side in the worker metadata.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import zmq

from pdcluster.core.kv_connector import ConnectorPlan, ConnectorResults, KVRegion
from pdcluster.transfer.connector_worker import ConnectorWorker
from pdcluster.transfer.mooncake_engine import MooncakeConfig
from pdcluster.transfer.rank_agent import MooncakeRankAgent
from pdcluster.transfer.transport import MooncakeTransport
from pdcluster.vllm_backend.connector_scheduler import StepPlan
from pdcluster.vllm_backend.handshake import (
    endpoint,
    read_directory,
    take_curve,
    write_kv_address,
)
from pdcluster.vllm_backend.ranks import RankClients, RankServer
from pdcluster.vllm_backend.settings import HEAD_OUTERMOST_LAYOUTS, ConnectorSettings

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def kv_region(kv_caches: dict[str, Any], num_blocks: int, heads: tuple[int, int]) -> KVRegion:
    """vLLM's per-layer cache tensors (layer name -> tensor) as one multi-segment region.
    `heads`: (the model's KV heads, this rank's). Each layer's cache is vLLM's logical
    `[blocks, KV heads, block size, content]` view; its physical layout (`KVCacheLayout`) must
    hold a block of a layer as one byte run with the KV heads outermost (LBHNC or BLHNC: the
    layout the connector asks vLLM for, `HEAD_OUTERMOST_LAYOUTS`), so that a range of heads is
    one run and groups of different TP map heads. Anything else is refused by name."""
    segments = []
    for name in sorted(kv_caches, key=_layer_order):
        cache = kv_caches[name]
        if cache.shape[0] != num_blocks:
            raise ValueError(f"KV cache layout of {name} {tuple(cache.shape)} has no block "
                             f"dimension of {num_blocks} first: not supported by this connector")
        if cache.ndim < 3 or cache.shape[1] != heads[1] or not cache[0].is_contiguous():
            raise ValueError(
                f"KV cache of {name} {tuple(cache.shape)}, strides {tuple(cache.stride())}: "
                f"a block does not hold its {heads[1]} KV heads outermost in one byte run. "
                f"pdcluster's connector needs KV cache layout {' or '.join(HEAD_OUTERMOST_LAYOUTS)}"
                " (unset VLLM_KV_CACHE_LAYOUT: the connector asks vLLM for LBHNC)")
        segments.append(cache)
    first = segments[0]
    block_nbytes = first[0].nbytes
    stride = first.stride(0) * first.element_size()
    for segment in segments:
        if segment[0].nbytes != block_nbytes or segment.stride(0) * segment.element_size() \
                != stride:
            raise ValueError("vLLM's KV cache segments differ in block size or stride")
    base = first.data_ptr()
    return KVRegion(base, 0, block_nbytes, num_blocks, block_stride=stride,
                    segment_offsets=tuple(s.data_ptr() - base for s in segments),
                    num_kv_heads=heads[0])


def _layer_order(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(f".{name}.")
    return (int(match.group(1)) if match else -1, name)


class VllmWorkerSide:
    def __init__(self, settings: ConnectorSettings) -> None:
        directory = read_directory(settings.handshake_dir)  # None: the shared-key mode
        transport = MooncakeTransport(
            MooncakeConfig(hostname=settings.host, protocol=settings.protocol,
                           device_name=settings.device),
            host=settings.host, curve=take_curve(settings.handshake_dir), directory=directory)
        self.worker = ConnectorWorker(transport, timeout_s=settings.timeout_s, peers=directory)
        self.worker.on_lookup = self._announce_lookup
        self._handshake_dir = settings.handshake_dir
        self._announcers: list[zmq.Socket] = []
        self._recv_blocks: dict[str, list[int]] = {}  # request -> blocks awaiting remote KV
        self._pull_blocks: dict[str, list[int]] = {}  # request -> blocks awaiting a pull
        self._sends = ConnectorPlan()
        self._results = ConnectorResults()
        self._load_errors: set[int] = set()
        self._ranks: RankClients | None = None

    def register(self, kv_caches: dict[str, Any], num_blocks: int, heads: tuple[int, int],
                 tp_size: int = 1) -> None:
        region = kv_region(kv_caches, num_blocks, heads)
        if tp_size > 1:
            self._ranks = RankClients(self._handshake_dir, tp_size, self.worker.timeout_s)
        self.worker.register_kv_region(region, self._ranks)
        logger.info("pdcluster connector: %d KV segments of %d blocks x %d bytes registered",
                    region.num_segments, num_blocks, region.block_nbytes)
        # Only now can peers be served: tell the node where to send KV requests.
        transport = self.worker.transport
        write_kv_address(self._handshake_dir, transport.reply_address, transport.session_id)

    def start_loads(self, step: StepPlan) -> None:
        plan = step.plan
        for recv in plan.recvs:
            self._recv_blocks[recv.request_id] = recv.block_ids[recv.skip_blocks:]
        for pull in plan.pulls:
            self._pull_blocks[pull.request_id] = list(pull.block_ids)
        # Before the receives: one planned in this same step then fails as it starts (its
        # source is not even asked).
        for transfer_id, reason in step.lost:
            self.worker.fail_receive(transfer_id, reason)
        self.worker.execute(ConnectorPlan(recvs=plan.recvs, cancelled=plan.cancelled,
                                          pulls=plan.pulls))
        self._sends = ConnectorPlan(sends=plan.sends, serves=plan.serves)
        for transfer_id, source_addr in step.released:
            self.worker.release_at_source(transfer_id, source_addr)

    def after_forward(self) -> None:
        sends, self._sends = self._sends, ConnectorPlan()
        if not sends.is_empty:
            self.worker.execute(sends)

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids; the full
        results wait for `take_worker_results`."""
        results = self.worker.get_results()
        self._results = _merge(self._results, results)
        done_sending = set(results.released)
        done_recving, failed = set(), set()
        for recv in results.received:
            done_recving.add(recv.request_id)
            blocks = self._recv_blocks.pop(recv.request_id, [])
            if not recv.ok:
                failed.add(recv.request_id)
                self._load_errors.update(blocks)
        for pulled in results.pulled:  # the holder may have had fewer: vLLM computes the rest
            done_recving.add(pulled.request_id)
            blocks = self._pull_blocks.pop(pulled.request_id, [])
            self._load_errors.update(blocks[pulled.num_blocks:])
        return done_sending, done_recving, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_worker_results(self) -> ConnectorResults:
        results, self._results = self._results, ConnectorResults()
        return results

    def _announce_lookup(self) -> None:
        """A peer's pull waits for vLLM's scheduler (side-channel thread): tell the scheduler
        side it is coming, and the node to wake vLLM's engine should it be asleep."""
        if not self._announcers:
            for name in ("lookups", "wake"):
                sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 64)
                sock.connect(endpoint(self._handshake_dir, name))
                self._announcers.append(sock)
        for sock in self._announcers:
            with contextlib.suppress(zmq.Again):  # plenty queued already: one wakes it
                sock.send(b"lookup", zmq.NOBLOCK)

    def close(self) -> None:
        for sock in self._announcers:
            sock.close()
        self.worker.close()
        if self._ranks is not None:
            self._ranks.close()


class VllmRankSide:
    """Tensor-parallel rank r >= 1: its KV slice registered with a transfer engine of its
    own, writing what rank 0 plans (ranks.RankServer); the step's plans are rank 0's."""

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        self._settings, self._rank = settings, rank
        self._server: RankServer | None = None

    def register(self, kv_caches: dict[str, Any], num_blocks: int,
                 heads: tuple[int, int]) -> None:
        region = kv_region(kv_caches, num_blocks, heads)
        settings = self._settings
        agent = MooncakeRankAgent(settings.host, settings.protocol, settings.device)
        self._server = RankServer(settings.handshake_dir, self._rank, agent, region)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def _merge(a: ConnectorResults, b: ConnectorResults) -> ConnectorResults:
    return ConnectorResults(a.received + b.received, a.released + b.released,
                            a.pulled + b.pulled, a.lookups + b.lookups, a.served + b.served)
