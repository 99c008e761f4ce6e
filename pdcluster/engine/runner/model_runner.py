"""Runs one scheduled step on the model: builds the flattened batch and attention metadata
from the scheduler's plan (engine/runner/inputs.py), runs the forward pass, and samples one
token for every request whose chunk reached its last known token.

On CUDA, once `capture_graphs` has run, a step of decodes only (no prefill chunk, no proposed
tokens to verify, at most the largest captured batch) replays the CUDA graph of its batch-size
bucket instead (engine/runner/cuda_graphs.py); every other step runs eagerly. Either way the
step waits for the device once: for the sampled token ids.
"""

from __future__ import annotations

import logging

import torch

from pdcluster.engine.core.outputs import StepResult
from pdcluster.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention import (
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
    build_inputs,
    chunk_tables,
    decode_table,
    to_device,
)
from pdcluster.engine.sample.rejection import verify_chunks
from pdcluster.engine.sample.sampler import Sampler

logger = logging.getLogger(__name__)

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

    def capture_graphs(self, max_batch: int, max_model_len: int) -> bool:
        """Capture the decode step's CUDA graphs (CUDA only); False, with the reason logged,
        where this model or device cannot take them."""
        reason = graph_blocker(self.model, self.kv_cache)
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return False
        self.graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_model_len)
        self.graphs.capture()
        return True

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[StepResult]:
        """One entry per `out.scheduled` item, in that order; None where nothing is sampled,
        a `RequestFailure` where sampling failed for that request alone (engine.sample.sampler), a
        list of tokens for a chunk that verified proposed tokens (engine/spec_decode)."""
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens > 1)
        items = [out.scheduled[i] for i in order]
        inputs = build_inputs(items, self.kv_cache)
        if self._replays(items):
            results = self._replay(items, inputs)
        else:
            results = self._run_eager(items, inputs)
        unordered: list[StepResult] = [None] * len(items)
        for k, i in enumerate(order):
            unordered[i] = results[k]
        return unordered

    def _replays(self, items: list[ScheduledRequest]) -> bool:
        graphs = self.graphs
        return (graphs is not None and len(items) <= graphs.max_batch
                and all(it.num_tokens == 1 and it.samples and not it.spec_token_ids
                        for it in items))

    def _replay(self, items: list[ScheduledRequest], inputs: StepInputs) -> list[StepResult]:
        assert self.graphs is not None, "replayed only with graphs"
        logits = self.graphs.replay(inputs, decode_table(items, inputs.decode_lens,
                                                         self.block_size))
        return list(self.sampler.sample(logits, [it.request for it in items]))

    def _run_eager(self, items: list[ScheduledRequest], inputs: StepInputs
                   ) -> list[StepResult]:
        meta = self._metadata(items, inputs)
        hidden = self.model(to_device(inputs.token_ids, self.device),
                            to_device(inputs.positions, self.device), self.kv_cache, meta)
        last_rows = inputs.last_rows
        sampling = [k for k, item in enumerate(items) if item.samples and not item.spec_token_ids]
        results: list[StepResult] = [None] * len(items)
        verifying = [k for k, item in enumerate(items) if item.spec_token_ids]
        if verifying:
            verified = verify_chunks(self.model, self.sampler, hidden,
                                     [items[k] for k in verifying],
                                     [last_rows[k] for k in verifying])
            for k, tokens in zip(verifying, verified, strict=True):
                results[k] = tokens
        if sampling:
            rows = torch.tensor([last_rows[k] for k in sampling], device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            sampled = self.sampler.sample(logits, [items[k].request for k in sampling])
            for k, token in zip(sampling, sampled, strict=True):
                results[k] = token
        return results

    def _metadata(self, items: list[ScheduledRequest], inputs: StepInputs) -> AttentionMetadata:
        device, n = self.device, inputs.num_decodes
        meta = AttentionMetadata(
            slot_rows=to_device(inputs.slot_rows, device),
            num_decodes=n,
            decode_block_table=None,
            decode_lens=None,
            prefills=[self._prefill_chunk(inputs, c) for c in range(len(inputs.chunks))],
            workspace=self.workspace,
        )
        if n:
            table = decode_table(items[:n], inputs.decode_lens, self.block_size)
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
        table = torch.tensor(blocks[: -(-context_len // self.block_size)])
        return PrefillChunk(row, end, context_len, table.to(self.device))

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
