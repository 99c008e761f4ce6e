"""Runs one scheduled step on the model: builds the flattened batch and attention metadata
from the scheduler's plan (engine/runner/inputs.py), runs the forward pass, and samples one
token for every request whose chunk reached its last known token.

On CUDA, once `capture_graphs` has run, a step of decodes only (no prefill chunk, no proposed
tokens to verify, at most the largest captured batch) replays the CUDA graph of its batch-size
bucket instead (engine/runner/cuda_graphs.py); every other step runs eagerly. Either way the
step waits for the device once: for the sampled token ids. A replayed step can launch the next
one before that wait (engine/runner/lookahead.py), and the next step then takes its logits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from pdcluster.engine.core.outputs import StepResult
from pdcluster.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention_meta import (
    AttentionMetadata,
    CascadeTables,
    GatherWorkspace,
    PrefillBatch,
    PrefillChunk,
)
from pdcluster.engine.models.llama import CausalLM
from pdcluster.engine.runner.cuda_graphs import DecodeGraphs, graph_blocker
from pdcluster.engine.runner.inputs import (
    StepInputs,
    StepPlan,
    build_inputs,
    chunk_tables,
    decode_table,
    to_device,
)
from pdcluster.engine.runner.lookahead import DecodeLookahead
from pdcluster.engine.sample.rejection import verify_chunks
from pdcluster.engine.sample.sampler import Sampler

logger = logging.getLogger(__name__)


class Peers(Protocol):
    """The other tensor-parallel ranks, as rank 0 drives them (engine/runner/tp_workers.py's
    `StepPeers`; named here by what it does, so that the ranks' module may import this one)."""

    def step(self, plan: StepPlan) -> None: ...

    def capture(self, max_batch: int, max_model_len: int) -> None: ...

    def failed(self, exc: Exception) -> Exception: ...

    def close(self) -> None: ...

# Decode attention splits at the blocks all decodes share (engine/models/attention.py) from this
# many on. Chosen, not tuned: a few shared blocks save little reading and still cost a second
# attention call and the merge (measured only at W4's 64 shared blocks: step 0.40 -> 0.23 s).
MIN_SHARED_BLOCKS = 4


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, device: torch.device,
                 seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.workspace = GatherWorkspace()  # attention's gather buffers, reused every step
        self.graphs: DecodeGraphs | None = None
        self.lookahead = DecodeLookahead(device)  # decode steps launched ahead (on graphs)
        self.peers: Peers | None = None  # the other tensor-parallel ranks, if any

    def capture_graphs(self, max_batch: int, max_model_len: int) -> bool:
        """Capture the decode step's CUDA graphs (CUDA only); False, with the reason logged,
        where this model or device cannot take them."""
        reason = graph_blocker(self.model, self.kv_cache)
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return False
        graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_model_len)
        if self.peers is not None:  # every rank captures at once: the forward holds collectives
            self.peers.capture(max_batch, max_model_len)
            graphs.capture()  # a rank's failure here is the engine's (the ranks must agree)
        else:
            try:
                graphs.capture()
            except RuntimeError:  # an op of this model that a graph cannot hold
                logger.warning("capturing the decode CUDA graphs failed: decode steps run "
                               "eagerly", exc_info=True)
                return False
        self.graphs = graphs
        return True

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, ahead: list[ScheduledRequest] | None = None
                ) -> list[StepResult]:
        """One entry per `out.scheduled` item, in that order; None where nothing is sampled,
        a `RequestFailure` where sampling failed for that request alone (engine.sample.sampler),
        a list of tokens for a chunk that verified proposed tokens (engine/spec_decode).
        `ahead`: the decode step predicted to follow this one (`Scheduler.next_decodes`),
        launched before this step's tokens reach the host (engine/runner/lookahead.py)."""
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens > 1)
        items = [out.scheduled[i] for i in order]
        plan = self._plan(items)
        logits = self.lookahead.take(items, plan)  # computed by a step launched ahead
        if logits is None:
            logits = self._forward_on_every_rank(plan)
        results = self._sample(items, logits, self._launcher(items, plan, ahead))
        unordered: list[StepResult] = [None] * len(items)
        for k, i in enumerate(order):
            unordered[i] = results[k]
        return unordered

    def _forward_on_every_rank(self, plan: StepPlan) -> torch.Tensor:
        if self.peers is None:
            return self.forward(plan)
        self.peers.step(plan)  # the other tensor-parallel ranks run the same forward
        try:
            return self.forward(plan)
        except RuntimeError as exc:
            raise self.peers.failed(exc) from exc

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """The step's forward pass: logits `[len(plan.logit_rows), vocab]` (float32). Every
        tensor-parallel rank runs it on the same plan (its collectives pair up)."""
        if plan.replay:
            assert self.graphs is not None and plan.decode_table is not None, \
                "a replayed step has graphs and a decode table"
            return self.graphs.replay(plan.inputs, plan.decode_table)
        inputs = plan.inputs
        hidden = self.model(to_device(inputs.token_ids, self.device),
                            to_device(inputs.positions, self.device), self.kv_cache,
                            self._metadata(plan))
        rows = to_device(plan.logit_rows, self.device)
        return self.model.compute_logits(hidden[rows])

    def _plan(self, items: list[ScheduledRequest]) -> StepPlan:
        inputs = build_inputs(items, self.kv_cache)
        n = inputs.num_decodes
        table = decode_table(items[:n], inputs.decode_lens, self.block_size) if n else None
        replay = self.replays(items)
        rows: list[int] = []  # verifying chunks' rows, then the sampled rows
        for item, last in zip(items, inputs.last_rows, strict=True):
            if item.spec_token_ids:
                rows += range(last - len(item.spec_token_ids), last + 1)
        rows += [last for item, last in zip(items, inputs.last_rows, strict=True)
                 if item.samples and not item.spec_token_ids]
        return StepPlan(inputs, table, np.asarray(rows, dtype=np.int64), replay)

    def _launcher(self, items: list[ScheduledRequest], plan: StepPlan,
                  ahead: list[ScheduledRequest] | None) -> Callable[[torch.Tensor], None] | None:
        """What launches `ahead` once this step's tokens are sampled on the device, or None:
        look-ahead needs a replayed step and one rank (its ranks would have to launch too)."""
        graphs = self.graphs
        if not ahead or not plan.replay or graphs is None or self.peers is not None:
            return None
        return lambda sampled: self.lookahead.launch(graphs, self.kv_cache, items, ahead,
                                                     sampled)

    def replays(self, items: list[ScheduledRequest]) -> bool:
        """Whether a step of these items replays a decode graph."""
        graphs = self.graphs
        return (graphs is not None and len(items) <= graphs.max_batch
                and all(it.num_tokens == 1 and it.samples and not it.spec_token_ids
                        for it in items))

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor,
                launch: Callable[[torch.Tensor], None] | None = None) -> list[StepResult]:
        """`logits` rows in `_plan`'s order: each verifying chunk's, then the sampled rows
        (with `launch`, every item samples)."""
        results: list[StepResult] = [None] * len(items)
        verifying = [k for k, item in enumerate(items) if item.spec_token_ids]
        offset = 0
        if verifying:
            verified = verify_chunks(self.sampler, logits, [items[k] for k in verifying])
            for k, tokens in zip(verifying, verified, strict=True):
                results[k] = tokens
            offset = sum(len(items[k].spec_token_ids) + 1 for k in verifying)
        sampling = [k for k, item in enumerate(items) if item.samples and not item.spec_token_ids]
        if sampling:
            sampled = self.sampler.sample(logits[offset:], [items[k].request for k in sampling],
                                          launch)
            for k, token in zip(sampling, sampled, strict=True):
                results[k] = token
        return results

    def _metadata(self, plan: StepPlan) -> AttentionMetadata:
        inputs, device, n = plan.inputs, self.device, plan.inputs.num_decodes
        meta = AttentionMetadata(
            slot_rows=to_device(inputs.slot_rows, device),
            num_decodes=n,
            decode_block_table=None,
            decode_lens=None,
            prefills=[self._prefill_chunk(inputs, c) for c in range(len(inputs.chunks))],
            workspace=self.workspace,
        )
        if n:
            table = plan.decode_table
            assert table is not None, "a step with decodes has their table"
            meta.decode_block_table = to_device(table, device)
            meta.decode_lens = to_device(inputs.decode_lens, device)
            meta.cascade = self._cascade(torch.from_numpy(table),
                                         torch.from_numpy(inputs.decode_lens))
        if inputs.chunks and gpu.serves(self.kv_cache.tensor):
            tables, starts, first, longest = chunk_tables(inputs, len(inputs.token_ids))
            meta.prefill_batch = PrefillBatch(to_device(tables, device),
                                              to_device(starts, device),
                                              to_device(first, device), longest)
        return meta

    def _prefill_chunk(self, inputs: StepInputs, c: int) -> PrefillChunk:
        row, first_pos, blocks = inputs.chunks[c]
        end = inputs.chunks[c + 1][0] if c + 1 < len(inputs.chunks) else len(inputs.token_ids)
        context_len = first_pos + end - row
        table = np.asarray(blocks[: -(-context_len // self.block_size)], dtype=np.int64)
        return PrefillChunk(row, end, context_len, to_device(table, self.device))

    def _cascade(self, table: torch.Tensor, lens: torch.Tensor) -> CascadeTables | None:
        """The decode batch split at its leading blocks common to every sequence (only blocks
        that every context covers whole), or None when fewer than MIN_SHARED_BLOCKS."""
        bs = self.block_size
        if table.shape[0] < 2:
            return None
        same = (table == table[0]).all(dim=0).long()
        shared = min(int(same.cumprod(0).sum()), int(lens.min()) // bs)
        if shared < MIN_SHARED_BLOCKS:
            return None
        rest = table[:, shared:]
        own = torch.arange(rest.shape[1] * bs)[None, :] < (lens - shared * bs)[:, None]
        bias = torch.zeros(own.shape, dtype=self.kv_cache.tensor.dtype)
        bias.masked_fill_(~own, float("-inf"))
        return CascadeTables(table[0, :shared].to(self.device), rest.contiguous().to(self.device),
                             bias[:, None, None, :].to(self.device),
                             (lens - shared * bs).to(self.device))
