"""Global prefix reuse, the worker's half: `PullWorkerMixin`, mixed into `ConnectorWorker`
(it uses the worker's lock, clock, timeout, results, stats, send pool and transport).

Requester: a `PullJob` becomes a `PrefixPullRequest` to the holder, naming the wanted blocks
by the prompt's tokens and cache salt (the holder hashes them itself) and the byte address to
write each to; the holder's `XferDone` (or the
timeout, or an unreachable holder) becomes a `PullResult` with the number of leading blocks
written (0 on failure).
Holder: a `PrefixPullRequest` is recorded and handed to the engine as a `PullLookup` (only
the engine thread may touch the prefix cache); the engine answers with a `ServeJob` naming
the blocks it referenced, the leading run of the asked blocks it holds. The write runs on the
send pool (consecutive blocks coalesced into one descriptor), then the requester gets
`XferDone(num_blocks_sent=n)` and the engine `served` (drop the references). A pull not
resolved within `timeout_s`, or aborted by the requester before its write, is answered as
failed; its late `ServeJob` is released at once.
"""

from __future__ import annotations

import logging

from core.kv_connector import PrefixTokens, PullJob, PullLookup, PullResult, ServeJob
from core.kv_transfer import PrefixPullRequest, XferDone
from transfer.worker_state import Recv

logger = logging.getLogger(__name__)


class PullWorkerMixin:
    # ---- requester --------------------------------------------------------------------

    def _start_pull(self, job: PullJob) -> tuple[str, PrefixPullRequest]:
        region = self._require_region()
        self._recvs[job.transfer_id] = Recv(job.request_id, job.source_addr,
                                            self._clock() + self.timeout_s, is_pull=True)
        request = PrefixPullRequest(
            transfer_id=job.transfer_id, request_id=job.request_id,
            reply_addr=self.transport.reply_address, dest_session=self.transport.session_id,
            block_nbytes=region.block_nbytes, block_size=job.prefix.block_size,
            first_block=job.prefix.first_block, token_ids=list(job.prefix.token_ids),
            dest_block_addrs=[region.block_addr(b) for b in job.block_ids],
            cache_salt=job.prefix.cache_salt, lora_id=job.prefix.lora_id)
        return job.source_addr, request

    def _finish_pull(self, recv: Recv, ok: bool, num_blocks: int, error: str | None) -> None:
        if ok:
            self.stats.pulls_ok += 1
            self.stats.blocks_pulled += num_blocks
        else:
            self.stats.pulls_failed += 1
            logger.warning("prefix pull for %s from %s failed (computing instead): %s",
                           recv.request_id, recv.source_addr, error)
        self._results.pulled.append(
            PullResult(recv.request_id, ok, num_blocks if ok else 0, error))

    # ---- holder -----------------------------------------------------------------------

    def _on_pull_request(self, msg: PrefixPullRequest) -> None:
        outbox = []
        with self._lock:
            reason = self._finished.get(msg.transfer_id)
            if reason is not None:
                outbox.append((msg.reply_addr, XferDone(msg.transfer_id, False, error=reason)))
            elif self._serves.add(msg, self._clock() + self.timeout_s):
                prefix = PrefixTokens(msg.token_ids, msg.block_size, msg.first_block,
                                      msg.cache_salt, msg.lora_id)
                self._results.lookups.append(PullLookup(msg.transfer_id, prefix))
        self._flush(outbox)

    def _add_serve(self, job: ServeJob) -> None:
        msg = self._serves.start(job.transfer_id)
        if msg is None:  # expired or aborted while the engine looked it up
            self._results.served.append(job.transfer_id)
            return
        self._pool.submit(self._serve, job, msg)

    def _serve(self, job: ServeJob, msg: PrefixPullRequest) -> None:
        tid = job.transfer_id
        num_blocks = min(len(job.block_ids), len(msg.dest_block_addrs))
        try:
            num_descriptors, _ = self._write(job.block_ids[:num_blocks],
                                             msg.dest_block_addrs[:num_blocks],
                                             msg.dest_session, msg.block_nbytes)
            done = XferDone(tid, True, num_blocks_sent=num_blocks,
                            num_descriptors=num_descriptors)
        except Exception as exc:  # report every failure rather than let the requester wait
            logger.warning("prefix pull %s for %s failed: %s", tid, msg.request_id, exc)
            done = XferDone(tid, False, error=f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._serves.finish(tid)
            self._remember(tid, "transfer already finished")
            self._results.served.append(tid)
            if done.ok:
                self.stats.pull_requests_served += 1
                self.stats.blocks_served += num_blocks
            else:
                self.stats.pull_serves_failed += 1
        self._flush([(msg.reply_addr, done)])

    def _cancel_serve(self, tid: str, outbox) -> None:
        msg = self._serves.cancel(tid)
        if msg is not None:
            self._remember(tid, "transfer aborted")
            outbox.append((msg.reply_addr, XferDone(tid, False, error="transfer aborted")))

    def _expire_serves(self, now: float, outbox) -> None:
        for msg in self._serves.expire(now):
            self.stats.timeouts += 1
            reason = "prefix pull expired on the holder"
            self._remember(msg.transfer_id, reason)
            outbox.append((msg.reply_addr, XferDone(msg.transfer_id, False, error=reason)))
