"""`DraftProposer`: a smaller model with the target's tokenizer proposes k tokens greedily.

The draft runs on the engine's own machinery — a `ModelRunner` over its own `PagedKVCache`,
and a `KVCacheManager` over its own `BlockPool` (no prefix caching) — with one shadow
`Request` per target request holding the target's tokens plus the drafts. Per step:
1. sync: the shadow keeps the longest prefix it shares with the target's tokens (rejected
   drafts drop out, accepted ones and the target's new token come in); its computed count
   is cut to that prefix, so stale KV past it is simply overwritten;
2. round 1 computes every shadow's uncomputed tokens as one batch (a chunk after a
   preemption or a remote prefill, usually 1-2 tokens) and takes the argmax; rounds 2..k
   decode one token per shadow per round, batched.
Greedy drafting makes each proposal a point mass, which `rejection.verify` handles exactly
at any temperature. A shadow that cannot get draft blocks proposes what it has so far.
EAGLE-style heads would replace the draft model behind the same `Proposer` interface.
"""

from __future__ import annotations

import dataclasses

from pdcluster.core.types import ReqId
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.outputs import SampledToken
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.sampling_params import SamplingParams
from pdcluster.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.runner.model_runner import ModelRunner
from pdcluster.engine.spec_decode.config import SpeculativeConfig
from pdcluster.engine.spec_decode.proposer import Proposer

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv
        self._shadows: dict[ReqId, Request] = {}
        self._synced: dict[ReqId, int] = {}  # target tokens the shadow has seen

    @classmethod
    def for_target(cls, config: SpeculativeConfig, target) -> DraftProposer:
        """Load `config.draft_model` on the target engine's device and dtype, with as many
        KV blocks of the same size in tokens as the target has."""
        path = config.draft_model
        assert path is not None, "the draft method comes with its model (SpeculativeConfig)"
        mc = ModelConfig.from_pretrained(path)
        if mc.vocab_size != target.model_config.vocab_size:
            raise ValueError(f"draft model vocabulary {mc.vocab_size} differs from the "
                             f"target's {target.model_config.vocab_size}")
        if mc.max_model_len < target.max_model_len:
            raise ValueError(f"draft model length {mc.max_model_len} is shorter than the "
                             f"target's {target.max_model_len}")
        model = load_model(path, mc, target.dtype, target.device,
                           target.max_model_len)
        planes, heads, dim = mc.kv_layout
        spec = dataclasses.replace(target.kv_spec, num_layers=mc.num_layers, num_kv_heads=heads,
                                   head_dim=dim, num_planes=planes)
        runner = ModelRunner(model, PagedKVCache(spec, target.dtype, target.device),
                             target.device)
        pool = BlockPool(spec.num_blocks, spec.block_size, enable_caching=False)
        return cls(runner, KVCacheManager(pool, enable_caching=False))

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        shadows = [self._sync(req) for req in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, cap in enumerate(max_tokens) if cap > 0]
        while live:
            live = self._draft_round(shadows, drafts, live)
            live = [i for i in live if len(drafts[i]) < max_tokens[i]]
        return drafts

    def _draft_round(self, shadows: list[Request], drafts: list[list[int]], live: list[int]
                     ) -> list[int]:
        """Compute each live shadow's new tokens and append its argmax; returns the shadows
        that drafted a token."""
        items, indices = [], []
        for i in live:
            shadow = shadows[i]
            num_new = shadow.num_tokens - shadow.num_computed_tokens
            if self.kv.allocate_slots(shadow, num_new) is None:
                continue  # draft pool full: propose what this one has
            items.append(ScheduledRequest(shadow, shadow.num_computed_tokens, num_new,
                                          self.kv.block_ids(shadow.request_id)))
            indices.append(i)
        if not items:
            return []
        results = self.runner.execute(SchedulerOutput(items))
        drafted = []
        for i, item, token in zip(indices, items, results, strict=True):
            item.request.num_computed_tokens = item.start + item.num_tokens
            if isinstance(token, SampledToken):
                item.request.all_token_ids.append(token.token_id)
                drafts[i].append(token.token_id)
                drafted.append(i)
        return drafted

    def _sync(self, req: Request) -> Request:
        """The shadow of `req`, holding exactly the target's tokens."""
        shadow = self._shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, req.all_token_ids, _GREEDY, self.kv.block_size)
            self._shadows[req.request_id] = shadow
            self._synced[req.request_id] = req.num_tokens
            return shadow
        theirs, ours = req.all_token_ids, shadow.all_token_ids
        common = self._synced[req.request_id]
        limit = min(len(theirs), len(ours))
        while common < limit and theirs[common] == ours[common]:
            common += 1
        del ours[common:]
        ours.extend(theirs[common:])
        # The last token is always computed again: its logits give the first draft.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(theirs) - 1)
        self.kv.trim(shadow, shadow.num_computed_tokens + 1)
        self._synced[req.request_id] = len(theirs)
        return shadow

    def forget(self, request_id: ReqId) -> None:
        shadow = self._shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def retain(self, request_ids: set[ReqId]) -> None:
        for gone in [r for r in self._shadows if r not in request_ids]:
            self.forget(gone)

    @property
    def block_pool(self) -> BlockPool:
        return self.kv.pool


__all__ = ["DraftProposer"]
