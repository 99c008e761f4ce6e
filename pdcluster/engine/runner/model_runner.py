"""Runs one scheduled step on the model: builds the flattened batch and attention metadata
from the scheduler's plan, runs the forward pass, and samples one token for every request
whose chunk reached its last known token.

Tokens are ordered decode-first (every single-token chunk, including a prompt whose only
uncached token is its last), then prefill chunks; see `engine.models.attention`.
"""

from __future__ import annotations

import torch

from pdcluster.engine.core.outputs import StepResult
from pdcluster.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention import (
    AttentionMetadata,
    CascadeTables,
    GatherWorkspace,
    PrefillChunk,
)
from pdcluster.engine.models.llama import CausalLM
from pdcluster.engine.sample.rejection import verify_chunks
from pdcluster.engine.sample.sampler import Sampler

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

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[StepResult]:
        """One entry per `out.scheduled` item, in that order; None where nothing is sampled,
        a `RequestFailure` where sampling failed for that request alone (engine.sample.sampler), a
        list of tokens for a chunk that verified proposed tokens (engine/spec_decode)."""
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens > 1)
        items = [out.scheduled[i] for i in order]
        input_ids, positions, meta, last_rows = self._prepare(items)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
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
        unordered: list[StepResult] = [None] * len(items)
        for k, i in enumerate(order):
            unordered[i] = results[k]
        return unordered

    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slot_blocks: list[torch.Tensor] = []
        last_rows: list[int] = []
        decodes = [it for it in items if it.num_tokens == 1]
        prefills: list[PrefillChunk] = []
        for it in items:
            start, end = it.start, it.start + it.num_tokens
            ids.extend(it.token_ids)
            p = torch.arange(start, end)
            table = torch.tensor(it.block_ids[: -(-end // bs)])
            pos.append(p)
            slot_blocks.append(table[p // bs])
            if it.num_tokens > 1:
                prefills.append(self._prefill_chunk(len(ids) - it.num_tokens, p, table))
            last_rows.append(len(ids) - 1)
        positions = torch.cat(pos)
        slot_rows = self.kv_cache.slot_rows(torch.cat(slot_blocks), positions % bs)
        meta = AttentionMetadata(
            slot_rows=slot_rows.to(self.device),
            num_decodes=len(decodes),
            decode_block_table=None,
            decode_mask=None,
            prefills=prefills,
            workspace=self.workspace,
        )
        if decodes:
            (meta.decode_block_table, meta.decode_mask, meta.decode_lens,
             meta.cascade) = self._decode_tables(decodes)
        input_ids = torch.tensor(ids, device=self.device)
        return input_ids, positions.to(self.device), meta, last_rows

    def _prefill_chunk(self, offset: int, positions: torch.Tensor, table: torch.Tensor):
        n, context_len = len(positions), int(positions[-1]) + 1
        mask = None
        if int(positions[0]) > 0:
            mask = (torch.arange(context_len)[None, :] <= positions[:, None]).to(self.device)
        return PrefillChunk(offset, offset + n, context_len, table.to(self.device), mask)

    def _decode_tables(self, decodes: list[ScheduledRequest]):
        bs = self.block_size
        context_lens = [it.start + 1 for it in decodes]
        max_blocks = -(-max(context_lens) // bs)
        table = torch.zeros((len(decodes), max_blocks), dtype=torch.long)
        for row, (it, ctx) in enumerate(zip(decodes, context_lens, strict=True)):
            n = -(-ctx // bs)
            table[row, :n] = torch.tensor(it.block_ids[:n])
        lens = torch.tensor(context_lens)
        mask = torch.arange(max_blocks * bs)[None, :] < lens[:, None]
        return (table.to(self.device), mask[:, None, None, :].to(self.device),
                lens.to(self.device), self._cascade(table, lens))

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
