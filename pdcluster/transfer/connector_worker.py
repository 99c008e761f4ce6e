"""Worker side of the KV connector: executes plans and moves KV bytes.

On a decode node D, a `RecvJob` becomes an `XferRequest` to the prefill node P naming the
byte address of every block D lacks; P's `XferDone` (or the timeout) becomes a `RecvResult`.
On P, a `SendJob` (prefill done, blocks pinned) meets D's `XferRequest` — whichever arrives
second starts the write on a background thread: the source and destination block ranges are
coalesced so n consecutive blocks are one descriptor, written with one batch call, then D is
told. Everything is keyed by transfer id; duplicate and late messages are answered or
ignored, never fatal. Timeouts: a receive not done in `timeout_s` fails (D aborts it at P);
a send whose request has not come in `timeout_s` releases its blocks. Keep the data plane's
own timeout (Mooncake's MC_TRANSFER_TIMEOUT) below `timeout_s`, so a write can no longer
land in blocks D has given up on. With `peers` (the key directory, core.identity), each
incoming message is first checked against its sender (transfer/peer_rules.py). Prefix pulls
(global prefix reuse, either side) are in `transfer.pull_worker.PullWorker`, a part handed
the state it shares with this worker (`transfer.worker_state.WorkerState`), with the same
timeouts and abort rules.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdcluster.core.identity import Directory
from pdcluster.core.kv_connector import (
    ConnectorPlan,
    ConnectorResults,
    KVConnectorWorker,
    KVRegion,
    RecvJob,
    RecvResult,
    SendJob,
    TransferTiming,
)
from pdcluster.core.kv_ranks import KVRanks, RankAgentSpec
from pdcluster.core.kv_transfer import (
    PrefixPullRequest,
    SideChannelMessage,
    TransferId,
    XferAbort,
    XferDone,
    XferRequest,
)
from pdcluster.core.throttle import Throttle
from pdcluster.transfer.errors import error_text
from pdcluster.transfer.group_writer import Destination, GroupWriter, destination
from pdcluster.transfer.peer_rules import PeerRules
from pdcluster.transfer.pull_worker import Outbox, PullWorker
from pdcluster.transfer.transport import Transport
from pdcluster.transfer.worker_state import (
    OVER_BUDGET,
    Recv,
    Send,
    SendTable,
    WorkerState,
    WorkerStats,
)

logger = logging.getLogger(__name__)

__all__ = ["ConnectorWorker", "WorkerStats"]


class ConnectorWorker(KVConnectorWorker):
    def __init__(self, transport: Transport, timeout_s: float = 30.0, clock=time.monotonic,
                 max_parallel_sends: int = 2, peers: Directory | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self._state = WorkerState(transport, timeout_s, clock)
        self.transport, self.timeout_s = transport, timeout_s
        self.stats: WorkerStats = self._state.stats
        self._lock = self._state.lock
        self._sends = SendTable(self._state.budget)
        self._pool = ThreadPoolExecutor(max_parallel_sends, thread_name_prefix="kv-send")
        self._unsent_log = Throttle()
        self._writer: GroupWriter | None = None
        self._pulls = PullWorker(self._state, self._pool, self._write, self._flush)
        # Called (side-channel thread) when a peer's pull waits for the engine to look it up:
        # an engine in other processes (vLLM) may be idle and must be woken to do it.
        self.on_lookup: Callable[[], None] | None = None
        rules = None if peers is None else PeerRules(peers, self._state, self._requester_of,
                                                     transport.public_key, self._pulls.refuse)
        transport.start(self._on_message, rules)

    # ---- engine-facing ----------------------------------------------------------------

    def register_kv_region(self, region: KVRegion, ranks: KVRanks | None = None) -> None:
        """`ranks`: the node's other tensor-parallel ranks (core.kv_ranks), whose agents
        registered their own regions; this worker plans and drives their writes."""
        for addr, nbytes in region.memory_ranges():
            self.transport.register(addr, nbytes)
        self._writer = GroupWriter(self.transport, region, ranks, self.timeout_s)
        self._state.region, self._state.group = region, self._writer.group

    def rank_agent(self) -> RankAgentSpec | None:
        return self.transport.rank_agent()

    def execute(self, plan: ConnectorPlan) -> None:
        outbox: list[tuple[str, SideChannelMessage]] = []
        with self._lock:
            for recv in plan.recvs:
                self._start_recv(recv, outbox)
            for send in plan.sends:
                self._add_send(send, outbox)
            for pull in plan.pulls:
                outbox.append(self._pulls.start(pull))
            for serve in plan.serves:
                self._pulls.add_serve(serve)
            for transfer_id in plan.cancelled:
                self._cancel(transfer_id, outbox)
            self._expire(outbox)
        self._flush(outbox)

    def get_results(self) -> ConnectorResults:
        outbox: list[tuple[str, SideChannelMessage]] = []
        with self._lock:
            self._expire(outbox)
            results = self._state.take_results()
        self._flush(outbox)
        return results

    def release_at_source(self, transfer_id: TransferId, source_addr: str) -> None:
        """D will not ask for `transfer_id` after all (its own cache held the whole prompt, or
        the request ended before its blocks existed): the prefill node frees what it holds
        for it now rather than at its timeout."""
        self._flush([(source_addr, XferAbort(transfer_id))])

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._state.results.lookups) or self._pulls.num_waiting_lookups > 0

    def counters(self) -> dict[str, int]:
        """`WorkerStats`' counters by name (not `latencies` nor `recent_write_s`)."""
        stats = self.stats
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__
                if name not in ("latencies", "recent_write_s")}

    def take_latencies(self) -> list[TransferTiming]:
        """The transfers finished since the last call (`WorkerStats.latencies`)."""
        with self._lock:
            taken = list(self.stats.latencies)
            self.stats.latencies.clear()
        return taken

    def fail_receive(self, transfer_id: TransferId, reason: str) -> bool:
        outbox: list[tuple[str, SideChannelMessage]] = []
        with self._lock:
            recv = self._state.recvs.get(transfer_id)
            if recv is None or recv.is_pull:
                # not started yet (the request still queued here): it fails when it starts
                self._state.give_up(transfer_id, reason)
                return False
            del self._state.recvs[transfer_id]
            self.stats.sources_lost += 1
            self._finish_recv(recv, False, error=reason)
            # should the source still be alive after all, it forgets the transfer
            outbox.append((recv.source_addr, XferAbort(transfer_id)))
        self._flush(outbox)
        return True

    @property
    def num_pending_receives(self) -> int:
        """Receives under way: asked of their source, not yet done, failed or expired."""
        with self._lock:
            return len(self._state.recvs)

    @property
    def num_pending_sends(self) -> int:
        """Sends known on this node: awaiting their prefill, their request, or the write."""
        with self._lock:
            return len(self._sends)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()

    # ---- decode side ------------------------------------------------------------------

    def _start_recv(self, job: RecvJob, outbox: Outbox) -> None:
        region = self._state.require_region()
        tid = job.transfer.transfer_id
        recv = Recv(job.request_id, job.transfer.source_addr, self._state.deadline(),
                    started=self._state.clock())
        reason = self._state.given_up.pop(tid, None)
        if reason is not None:  # its source was reported lost before it started
            self.stats.sources_lost += 1
            self._finish_recv(recv, False, error=reason)
            return
        self._state.recvs[tid] = recv
        request = XferRequest(
            transfer_id=tid, request_id=job.request_id,
            reply_addr=self.transport.reply_address, dest_session=self.transport.session_id,
            block_nbytes=region.block_nbytes, num_blocks=len(job.block_ids),
            skip_blocks=job.skip_blocks,
            dest_block_addrs=[region.block_addr(b) for b in job.block_ids[job.skip_blocks:]],
            dest_segment_offsets=list(region.segment_offsets), dest_group=self._state.group)
        outbox.append((job.transfer.source_addr, request))

    def _on_done(self, msg: XferDone) -> None:
        with self._lock:
            recv = self._state.recvs.pop(msg.transfer_id, None)
            if recv is None:
                self.stats.late_messages += 1
                if not msg.ok:  # a receive not started yet fails as it starts
                    self._state.give_up(msg.transfer_id, msg.error or "transfer failed")
                return
            if recv.is_pull:
                self._pulls.finish(recv, msg.ok, msg.num_blocks_sent, msg.error)
                return
            self.stats.blocks_received += msg.num_blocks_sent
            self.stats.descriptors_received += msg.num_descriptors
            self.stats.bytes_received += (msg.num_blocks_sent
                                          * self._state.region_nbytes_per_block)
            if msg.ok:
                self.stats.latencies.append(TransferTiming.now(
                    "recv", self._state.clock() - recv.started, recv.request_id))
            self._finish_recv(recv, msg.ok, msg.first_token, msg.first_logprob, msg.error)

    def _finish_recv(self, recv: Recv, ok: bool, token=None, logprob=None, error=None) -> None:
        if recv.is_pull:
            self._pulls.finish(recv, ok, 0, error)
            return
        if ok:
            self.stats.recvs_ok += 1
        else:
            self.stats.recvs_failed += 1
            logger.warning("KV receive for %s failed: %s", recv.request_id, error)
        self._state.results.received.append(RecvResult(recv.request_id, ok, token, logprob, error))

    # ---- prefill side -----------------------------------------------------------------

    def _add_send(self, job: SendJob, outbox) -> None:
        tid = job.transfer.transfer_id
        if tid in self._state.finished:  # cancelled before prefill finished
            self._state.results.released.append(job.request_id)
            return
        entry = self._sends.for_job(tid)
        entry.job, entry.deadline = job, self._state.deadline()
        self._maybe_start(tid, entry)

    def _on_request(self, msg: XferRequest) -> None:
        outbox: list[tuple[str, SideChannelMessage]] = []
        with self._lock:
            reason = self._state.finished.get(msg.transfer_id)
            entry = None if reason is not None else self._sends.for_request(msg)
            if entry is None:
                outbox.append((msg.reply_addr, XferDone(msg.transfer_id, False,
                                                        error=reason or OVER_BUDGET)))
            else:
                if entry.request is None:  # a duplicate request is harmless
                    entry.request = msg
                    entry.deadline = entry.deadline or self._state.deadline()
                    self._maybe_start(msg.transfer_id, entry)
        self._flush(outbox)

    def _maybe_start(self, tid: TransferId, entry: Send) -> None:
        if entry.job is not None and entry.request is not None and not entry.started:
            entry.started = True
            self._pool.submit(self._send, tid, entry.job, entry.request)

    def _send(self, tid: TransferId, job: SendJob, request: XferRequest) -> None:
        try:
            num_descriptors = self._write_blocks(job, request)
            done = XferDone(tid, True, job.first_token, job.first_logprob,
                            num_blocks_sent=len(request.dest_block_addrs),
                            num_descriptors=num_descriptors)
        except Exception as exc:  # report every failure to D rather than let it time out
            logger.warning("KV send %s for %s failed: %s", tid, job.request_id, exc)
            done = XferDone(tid, False, error=error_text(exc))
        with self._lock:
            self._sends.pop(tid)
            self._state.remember(tid, "transfer already finished")
            self._state.results.released.append(job.request_id)
            if done.ok:
                self.stats.sends_ok += 1
            else:
                self.stats.sends_failed += 1
        self._flush([(request.reply_addr, done)])

    def _write_blocks(self, job: SendJob, request: XferRequest) -> int:
        if len(job.block_ids) < request.num_blocks:
            raise ValueError(f"{request.num_blocks} blocks asked, {len(job.block_ids)} held")
        block_ids = job.block_ids[request.skip_blocks:request.num_blocks]
        started = time.perf_counter()
        num_descriptors, nbytes = self._write(block_ids, request.dest_block_addrs,
                                              destination(request))
        with self._lock:
            self.stats.recent_write_s.append(time.perf_counter() - started)
            self.stats.latencies.append(TransferTiming.now(
                "send", time.perf_counter() - started, job.request_id))
            self.stats.blocks_sent += len(block_ids)
            self.stats.descriptors_sent += num_descriptors
            self.stats.bytes_sent += nbytes
        return num_descriptors

    def _write(self, block_ids: list[int], dest_addrs: list[int],
               dest: Destination) -> tuple[int, int]:
        """Write local blocks to a peer's addresses, every rank of this node's group its
        share (transfer/group_writer.py): (descriptors, bytes) written."""
        if self._writer is None:
            raise RuntimeError("register_kv_region() must be called before transfers")
        return self._writer.write(block_ids, dest_addrs, dest)

    # ---- both sides -------------------------------------------------------------------

    def _requester_of(self, tid: TransferId) -> str | None:
        """Who asked for `tid` here: its requester's reply address (lock held)."""
        entry = self._sends.get(tid)
        if entry is not None and entry.request is not None:
            return entry.request.reply_addr
        return self._pulls.requester(tid)

    def _on_message(self, msg: SideChannelMessage) -> None:
        if isinstance(msg, XferRequest):
            self._on_request(msg)
        elif isinstance(msg, PrefixPullRequest):
            self._pulls.on_request(msg)
            if self.on_lookup is not None:
                self.on_lookup()
        elif isinstance(msg, XferDone):
            self._on_done(msg)
        elif isinstance(msg, XferAbort):
            outbox: list[tuple[str, SideChannelMessage]] = []
            with self._lock:
                self._cancel(msg.transfer_id, outbox, msg.reason)
            self._flush(outbox)

    def _cancel(self, tid: TransferId, outbox, timed_out: str | None = None) -> None:
        """Cancel `tid` here (D: ask P to stop; P: release its blocks unless the write is
        under way). `timed_out`: the requester's reason when it gave up waiting, which P
        logs with what it lacked."""
        recv = self._state.recvs.get(tid)
        if recv is not None:  # D: ask P to stop; blocks stay pinned until P answers
            outbox.append((recv.source_addr, XferAbort(tid)))
            return
        if self._pulls.cancel(tid, outbox):
            return
        entry = self._sends.get(tid)
        if timed_out is not None and tid not in self._state.finished:
            self._log_unsent(tid, f"its requester gave up ({timed_out}); here "
                             + _stalled_at(entry))
        if entry is not None and entry.started:
            return  # the write is under way: it releases the blocks when done
        self._sends.pop(tid)
        self._state.remember(tid, "transfer aborted")
        if entry is not None:
            self._release_unsent(tid, entry, "transfer aborted", outbox)

    def _expire(self, outbox) -> None:
        now, recvs = self._state.clock(), self._state.recvs
        for tid, recv in [(t, r) for t, r in recvs.items() if r.deadline <= now]:
            del recvs[tid]
            self.stats.timeouts += 1
            reason = f"no KV within {self.timeout_s:g} s"
            self._finish_recv(recv, False, error=reason)
            outbox.append((recv.source_addr, XferAbort(tid, reason)))
        for tid, entry in self._sends.expired(now):
            self.stats.timeouts += 1
            self._state.remember(tid, "transfer expired on the prefill node")
            self._log_unsent(tid, "it expired here; " + _stalled_at(entry))
            self._release_unsent(tid, entry, "transfer expired on the prefill node", outbox)
        self._pulls.expire(now, outbox)

    def _log_unsent(self, tid: TransferId, why: str) -> None:
        """A send that ends without its write (its requester gave up, or it expired here):
        which half never came says where a transfer stalled. Throttled: an abort storm
        ends many sends at once."""
        if self._unsent_log.ready():
            logger.warning("KV send %s ended before its write finished: %s (%d similar not "
                           "logged)", tid, why, self._unsent_log.take_suppressed())

    def _release_unsent(self, tid: TransferId, entry: Send, reason: str, outbox) -> None:
        if entry.job is not None:
            self._state.results.released.append(entry.job.request_id)
        if entry.request is not None:
            outbox.append((entry.request.reply_addr, XferDone(tid, False, error=reason)))

    def _flush(self, outbox: Outbox) -> None:
        """Hand messages to the transport, which never blocks (the engine thread calls this):
        a request whose source turns out unreachable fails its receive when the transport
        says so, from its own thread."""
        for address, msg in outbox:
            on_failure = None
            if isinstance(msg, XferRequest | PrefixPullRequest):
                on_failure = functools.partial(self._source_unreachable, msg.transfer_id)
            try:
                self.transport.send(address, msg, on_failure)
            except Exception as exc:  # a bad or dead peer must not break this node
                logger.warning("side-channel send to %s failed: %s", address, exc)
                if on_failure is not None:
                    on_failure(str(exc))

    def _source_unreachable(self, tid: TransferId, reason: str) -> None:
        with self._lock:
            recv = self._state.recvs.pop(tid, None)
            if recv is None:
                return
            if not recv.is_pull:
                self.stats.sources_unreachable += 1
            self._finish_recv(recv, False, error=f"KV source unreachable: {reason}")


def _stalled_at(entry: Send | None) -> str:
    """Where a send stood when it ended unwritten."""
    if entry is None:
        return "neither its request nor this node's blocks had come"
    if entry.started:
        return "its write was under way"
    if entry.request is None:
        return "its request never came"
    return "this node's engine had not handed over the blocks"
