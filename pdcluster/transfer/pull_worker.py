"""Global prefix reuse, the worker's half: `PullWorker`, a part of `ConnectorWorker`. It is
handed what it shares with the worker — the `WorkerState` (lock, clock, timeout, results,
receives, statistics, transport, region), the send pool, and the worker's `write` (blocks to
a peer) and `flush` (side-channel messages out) — and owns only the holder's `ServeTable`.

Requester: a `PullJob` becomes a `PrefixPullRequest` to the holder, naming the wanted blocks
by the prompt's tokens and cache salt (the holder hashes them itself) and the byte address to
write each to; the holder's `XferDone` (or the timeout, or an unreachable holder) becomes a
`PullResult` with the number of leading blocks written (0 on failure).
Holder: a `PrefixPullRequest` is recorded and handed to the engine as a `PullLookup` (only
the engine thread may touch the prefix cache); the engine answers with a `ServeJob` naming
the blocks it referenced, the leading run of the asked blocks it holds. The write runs on the
send pool (consecutive blocks coalesced into one descriptor), then the requester gets
`XferDone(num_blocks_sent=n)` and the engine `served` (drop the references). A pull not
resolved within `timeout_s`, or aborted by the requester before its write, is answered as
failed; its late `ServeJob` is released at once. A pull without the router's valid ticket
(transfer/peer_rules.py) never reaches the engine: `refuse` answers it as failed at once.

Methods marked "lock held" are called by the worker with `state.lock` held; the others take
it themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdcluster.core.kv_connector import (
    PrefixTokens,
    PullJob,
    PullLookup,
    PullResult,
    ServeJob,
    TransferTiming,
)
from pdcluster.core.kv_transfer import PrefixPullRequest, SideChannelMessage, TransferId, XferDone
from pdcluster.transfer.errors import error_text
from pdcluster.transfer.group_writer import Destination, destination
from pdcluster.transfer.worker_state import OVER_BUDGET, Recv, ServeTable, WorkerState

logger = logging.getLogger(__name__)

PULL_REFUSED = "prefix pull refused: no valid ticket"

Outbox = list[tuple[str, SideChannelMessage]]
# (local block ids, peer addresses, where) -> (descriptors, bytes)
WriteFn = Callable[[list[int], list[int], Destination], tuple[int, int]]


class PullWorker:
    def __init__(self, state: WorkerState, pool: ThreadPoolExecutor, write: WriteFn,
                 flush: Callable[[Outbox], None]) -> None:
        self._state = state
        self._pool = pool
        self._write = write
        self._flush = flush
        self._serves = ServeTable(state.budget)

    def requester(self, transfer_id: TransferId) -> str | None:
        """The reply address of the peer pulling `transfer_id` from here (lock held)."""
        return self._serves.requester(transfer_id)

    @property
    def num_waiting_lookups(self) -> int:
        """Peers' pulls the engine has not looked up yet (lock held)."""
        return self._serves.num_waiting

    # ---- requester --------------------------------------------------------------------

    def start(self, job: PullJob) -> tuple[str, PrefixPullRequest]:
        """Record the pull as a receive; the request to send to the holder (lock held)."""
        state = self._state
        region = state.require_region()
        state.recvs[job.transfer_id] = Recv(job.request_id, job.source_addr,
                                            state.deadline(), is_pull=True,
                                            started=state.clock())
        request = PrefixPullRequest(
            transfer_id=job.transfer_id, request_id=job.request_id,
            reply_addr=state.transport.reply_address, dest_session=state.transport.session_id,
            block_nbytes=region.block_nbytes, block_size=job.prefix.block_size,
            first_block=job.prefix.first_block, token_ids=list(job.prefix.token_ids),
            dest_block_addrs=[region.block_addr(b) for b in job.block_ids],
            cache_salt=job.prefix.cache_salt, lora_id=job.prefix.lora_id,
            dest_segment_offsets=list(region.segment_offsets), dest_group=state.group,
            ticket=job.ticket)
        return job.source_addr, request

    def finish(self, recv: Recv, ok: bool, num_blocks: int, error: str | None) -> None:
        """The pull's outcome for the engine (lock held)."""
        stats = self._state.stats
        if ok:
            stats.pulls_ok += 1
            stats.blocks_pulled += num_blocks
            stats.bytes_pulled += num_blocks * self._state.region_nbytes_per_block
            stats.latencies.append(TransferTiming.now("pull", self._state.clock() - recv.started,
                                                      recv.request_id))
        else:
            stats.pulls_failed += 1
            logger.warning("prefix pull for %s from %s failed (computing instead): %s",
                           recv.request_id, recv.source_addr, error)
        self._state.results.pulled.append(
            PullResult(recv.request_id, ok, num_blocks if ok else 0, error))

    # ---- holder -----------------------------------------------------------------------

    def on_request(self, msg: PrefixPullRequest) -> None:
        state = self._state
        outbox: Outbox = []
        with state.lock:
            reason = state.finished.get(msg.transfer_id)
            added = None if reason is not None else self._serves.add(msg, state.deadline())
            if reason is not None or added is None:
                outbox.append((msg.reply_addr, XferDone(msg.transfer_id, False,
                                                        error=reason or OVER_BUDGET)))
            elif added:
                prefix = PrefixTokens(msg.token_ids, msg.block_size, msg.first_block,
                                      msg.cache_salt, msg.lora_id)
                state.results.lookups.append(PullLookup(msg.transfer_id, prefix))
        self._flush(outbox)

    def refuse(self, msg: PrefixPullRequest) -> None:
        """Answer a pull that may not be served (no valid ticket: transfer/peer_rules.py) as
        failed at once: no blocks written, no count of what this node holds."""
        with self._state.lock:
            self._state.stats.pull_requests_refused += 1
        self._flush([(msg.reply_addr, XferDone(msg.transfer_id, False, error=PULL_REFUSED))])

    def add_serve(self, job: ServeJob) -> None:
        """The engine's blocks for a pull: write them on the send pool (lock held)."""
        msg = self._serves.start(job.transfer_id)
        if msg is None:  # expired or aborted while the engine looked it up
            self._state.results.served.append(job.transfer_id)
            return
        self._pool.submit(self._serve, job, msg)

    def _serve(self, job: ServeJob, msg: PrefixPullRequest) -> None:
        tid, state = job.transfer_id, self._state
        num_blocks, nbytes = min(len(job.block_ids), len(msg.dest_block_addrs)), 0
        try:
            num_descriptors, nbytes = self._write(job.block_ids[:num_blocks],
                                                  msg.dest_block_addrs[:num_blocks],
                                                  destination(msg))
            done = XferDone(tid, True, num_blocks_sent=num_blocks,
                            num_descriptors=num_descriptors)
        except Exception as exc:  # report every failure rather than let the requester wait
            logger.warning("prefix pull %s for %s failed: %s", tid, msg.request_id, exc)
            done = XferDone(tid, False, error=error_text(exc))
        with state.lock:
            self._serves.finish(tid)
            state.remember(tid, "transfer already finished")
            state.results.served.append(tid)
            if done.ok:
                state.stats.pull_requests_served += 1
                state.stats.blocks_served += num_blocks
                state.stats.bytes_served += nbytes
            else:
                state.stats.pull_serves_failed += 1
        self._flush([(msg.reply_addr, done)])

    def cancel(self, tid: TransferId, outbox: Outbox) -> bool:
        """Abort a peer's pull not yet being written; False if `tid` is no pull served here
        (lock held)."""
        if tid not in self._serves:
            return False
        msg = self._serves.cancel(tid)
        if msg is not None:
            self._state.remember(tid, "transfer aborted")
            outbox.append((msg.reply_addr, XferDone(tid, False, error="transfer aborted")))
        return True

    def expire(self, now: float, outbox: Outbox) -> None:
        """Answer the peers' pulls the engine did not resolve in time (lock held)."""
        for msg in self._serves.expire(now):
            self._state.stats.timeouts += 1
            reason = "prefix pull expired on the holder"
            self._state.remember(msg.transfer_id, reason)
            outbox.append((msg.reply_addr, XferDone(msg.transfer_id, False, error=reason)))

