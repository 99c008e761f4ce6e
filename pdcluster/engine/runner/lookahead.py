"""Decode look-ahead: the next decode step launched on the GPU before the host has applied this
step's tokens.

A decode step on CUDA is one graph replay (engine/runner/cuda_graphs.py). Around it the host
spends a fraction of a millisecond: applying the sampled tokens, stop checks, outputs, the next
schedule and its inputs. Taking turns, the GPU idles through all of it. With look-ahead, a step
of decodes whose successor is predictable (the same requests, each one position on; none ends
by length; nothing waits to join: `Scheduler.next_decodes`) launches that successor as soon as
its own tokens are sampled on the device, feeding them to the next graph from the device. Only
then does the host wait for the tokens' copy. The host's work for this step and the next one's
schedule then run while the GPU computes the next step.

The next step takes the launched one when its own plan agrees row by row: request, position,
cache slot, context length, block table and token id (`take`). A request that finished in
between (a stop token, an abort) only drops its row. Requests that become ready meanwhile (just
admitted, or their KV arrived from a prefill node) join one step later (`Scheduler.schedule`'s
`only`), so the launched step is not thrown away for them. A plan that disagrees anyway runs
its own forward. The launched step's cache writes are then the right keys and values of each
request's next position (its token is the one the request appends), so they harm nothing.

The launched step writes each request's next cache slot, in a block the scheduler allocated for
it beforehand. A request's blocks may be freed (finish, abort, preemption) before that write
has run; `fence`, which the KV cache manager calls before it frees a request's blocks, waits for
the launched step first. So no block changes owner with a write still pending: nothing another
request computes, loads from a tier or receives from another node lands under it.

On CPU the launch runs at once (the same code path, for tests); there is nothing to overlap.

API: `DecodeLookahead` (`launch`, `take`, `fence`, `pending_ids`), `Launched`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdcluster.core.types import ReqId
from pdcluster.engine.core.scheduler_output import ScheduledRequest
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.runner.cuda_graphs import DecodeGraphs
from pdcluster.engine.runner.inputs import StepInputs, StepPlan, decode_table, lookahead_inputs


class DeviceMark:
    """A point in the device's stream (a CUDA event); on CPU the work is done already."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass(slots=True)
class Launched:
    """A decode step launched ahead: its requests (one row each), inputs, block table, the
    logits it will leave, and the token ids it was fed, copied back to the host."""

    request_ids: list[ReqId]
    inputs: StepInputs
    table: np.ndarray
    logits: torch.Tensor  # [len(request_ids), vocab]
    host_ids: torch.Tensor  # the fed token ids, copied to the host once `ids_copied` is reached
    ids_copied: DeviceMark
    rows_of: dict[ReqId, int] = field(default_factory=dict)

    def rows_for(self, items: list[ScheduledRequest], plan: StepPlan) -> list[int] | None:
        """This step's row for each of `items`, or None where any row differs from what the
        plan would compute."""
        if not self.rows_of:
            self.rows_of = {rid: row for row, rid in enumerate(self.request_ids)}
        rows = [self.rows_of.get(item.request.request_id, -1) for item in items]
        if -1 in rows or plan.decode_table is None:
            return None
        self.ids_copied.wait()
        fed = self.host_ids.numpy()
        mine, theirs, picked = self.inputs, plan.inputs, np.asarray(rows)
        table = plan.decode_table
        same = (np.array_equal(theirs.positions, mine.positions[picked])
                and np.array_equal(theirs.slot_rows, mine.slot_rows[picked])
                and np.array_equal(theirs.decode_lens, mine.decode_lens[picked])
                and np.array_equal(theirs.token_ids, fed[picked])
                and table.shape[1] <= self.table.shape[1]
                and np.array_equal(table, self.table[picked, :table.shape[1]]))
        return rows if same else None


class DecodeLookahead:
    """The runner's one launched step, if any, and the counts a benchmark reports."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.launched: Launched | None = None
        # The latest launch's requests and the point its writes are done by, for `fence`
        self._writers: frozenset[ReqId] = frozenset()
        self._written: DeviceMark | None = None
        self.num_launched = self.num_taken = self.num_missed = 0

    def pending_ids(self) -> frozenset[ReqId] | None:
        """The requests of the launched step the next one should take, or None."""
        return frozenset(self.launched.request_ids) if self.launched is not None else None

    def launch(self, graphs: DecodeGraphs, kv_cache: PagedKVCache,
               items: list[ScheduledRequest], ahead: list[ScheduledRequest],
               sampled: torch.Tensor) -> None:
        """Launch the decode step `ahead` (each item one position past its request's row in
        `items`), fed the tokens `sampled` on the device for `items`, in their order."""
        row_of = {item.request.request_id: k for k, item in enumerate(items)}
        rows = [row_of[item.request.request_id] for item in ahead]
        fed = sampled if rows == list(range(len(items))) else \
            sampled[torch.tensor(rows, device=sampled.device)]
        pinned = self.device.type == "cuda"
        host_ids = torch.empty(len(rows), dtype=torch.int64, pin_memory=pinned)
        host_ids.copy_(fed, non_blocking=pinned)
        ids_copied = DeviceMark(self.device)
        inputs = lookahead_inputs(ahead, kv_cache)
        table = decode_table(ahead, inputs.decode_lens, kv_cache.spec.block_size)
        logits = graphs.replay(inputs, table, token_ids=fed)
        request_ids = [item.request.request_id for item in ahead]
        self.launched = Launched(request_ids, inputs, table, logits, host_ids, ids_copied)
        self._writers, self._written = frozenset(request_ids), DeviceMark(self.device)
        self.num_launched += 1

    def take(self, items: list[ScheduledRequest], plan: StepPlan) -> torch.Tensor | None:
        """The launched step's logits for this plan's rows when it computed them all; None
        (the plan runs its own forward) otherwise. Either way the launched step is used up."""
        launched, self.launched = self.launched, None
        if launched is None:
            return None
        rows = launched.rows_for(items, plan) if plan.replay else None
        if rows is None:
            self.num_missed += 1
            return None
        self.num_taken += 1
        if rows == list(range(len(launched.request_ids))):
            return launched.logits
        return launched.logits[torch.tensor(rows, device=launched.logits.device)]

    def fence(self, request_id: ReqId) -> None:
        """Wait until the latest launched step has written its slots when it writes into
        `request_id`'s blocks (called before they are freed)."""
        if self._written is not None and request_id in self._writers:
            self._written.wait()
            self._writers, self._written = frozenset(), None
