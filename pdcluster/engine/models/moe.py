"""Mixture-of-experts layers shared by every MoE family (Mixtral, Qwen3-MoE, DeepSeek-V2/V3).

- `Router`: scores experts and picks each token's top-k with the model's normalisation
  (`MoEConfig`): softmax then top-k, renormalised or not (Mixtral: always — the same as a
  softmax over the top-k logits; Qwen3-MoE: if `norm_topk_prob`); DeepSeek's grouped top-k
  (V2: a group's best softmax score; V3: sigmoid scores plus `e_score_correction_bias`, a
  group's two best, the bias used for selection only) and `routed_scaling_factor`.
- `Experts`: the routed experts' weights stacked at load time (`w13 [E, 2I, H]`, `w2 [E, H, I]`).
  A step's (token, expert) pairs are sorted by expert, the tokens gathered with one
  `index_select`, each expert runs two matmuls on its contiguous group, and the weighted rows
  are summed back per token with one `index_add_`. Python loops over experts, never tokens;
  it reads the counts per expert back first, a host sync. On CUDA the grouping stays on the
  device instead (engine/kernels/gpu/fused_moe.py), so a CUDA graph holds the layer.
- `SparseMoE`: router + experts + an optional always-on shared expert (DeepSeek).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.models.linear import linear, silu_and_mul
from pdcluster.engine.models.model_families import MoEConfig
from pdcluster.engine.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    even_slice,
)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul; with tensor parallelism each rank holds
    `intermediate / tp` of both (column-parallel) and of the down projection's inputs
    (row-parallel: summed over ranks, unless `reduce_output` is False and the caller sums)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 tp: TensorParallel = SINGLE, reduce_output: bool = True) -> None:
        super().__init__()
        part = even_slice(intermediate, tp, "intermediate_size")
        self.intermediate = part.length
        self.gate_up_proj = ColumnParallelLinear(hidden, [part, part], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp, reduce_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        return self.down_proj(silu_and_mul(x, proj.weight, proj.bias, self.intermediate))


# The one-launch router (kernels/gpu/fused_moe.py) reads the whole router weight once per
# token: for a decode batch that is a few small reads instead of eight launches; for a long
# prefill, cuBLAS's GEMM reads it once for all tokens (a choice by arithmetic, not measured).
ROUTE_KERNEL_MAX_TOKENS = 256


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        if cfg.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in x's dtype)."""
        cfg = self.cfg
        if (kernels.ENABLED and cfg.scoring == "softmax" and cfg.num_groups == 1
                and not cfg.score_bias and x.shape[0] <= ROUTE_KERNEL_MAX_TOKENS
                and gpu.serves(x, self.weight)):
            return gpu.ops().route_softmax_topk(x.contiguous(), self.weight, cfg.top_k,
                                                cfg.norm_topk_prob, cfg.routed_scaling_factor)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if cfg.scoring == "softmax" else logits.sigmoid()
        choice = scores
        if cfg.score_bias:
            choice = scores + self.e_score_correction_bias.float()
        if cfg.num_groups > 1:
            choice = self._mask_groups(choice)
        weights, ids = torch.topk(choice, cfg.top_k, dim=-1)
        if cfg.score_bias:
            weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            eps = 1e-20 if cfg.scoring == "sigmoid" else 0.0
            weights = weights / (weights.sum(-1, keepdim=True) + eps)
        return ids, (weights * cfg.routed_scaling_factor).to(x.dtype)

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the experts of each token's `topk_groups` best groups; the rest can't win."""
        cfg = self.cfg
        grouped = choice.view(choice.shape[0], cfg.num_groups, -1)
        if cfg.group_score == "max":
            group_scores = grouped.max(-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(cfg.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # softmax scores drop to 0 (as transformers' V2), biased sigmoid ones to -inf (V3)
        fill = 0.0 if cfg.scoring == "softmax" else float("-inf")
        return grouped.masked_fill(~keep[..., None], fill).view_as(choice)


class Experts(nn.Module):
    """This rank's routed experts: `num_experts / tp` of them, from `first_expert` on. A
    (token, expert) pair routed elsewhere contributes nothing here (the ranks' outputs are
    summed by the caller)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        local = tp.split(num_experts, "the number of routed experts")
        self.intermediate, self.num_experts = intermediate, num_experts
        self.first_expert = tp.rank * local
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if kernels.ENABLED and gpu.serves(x, self.w13):  # grouped on the device: no sync
            return gpu.ops().moe_experts(x, ids, weights, self.w13, self.w2, self.first_expert)
        top_k, num_local = ids.shape[1], self.w13.shape[0]
        flat = ids.reshape(-1) - self.first_expert
        flat = flat.masked_fill((flat < 0) | (flat >= num_local), num_local)  # elsewhere
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=num_local + 1).tolist()[:num_local]
        grouped = x.index_select(0, token_of)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = grouped[start : start + count]
                hidden = silu_and_mul(rows, self.w13[expert], None, self.intermediate)
                outputs.append(linear(hidden, self.w2[expert]))
                start += count
        if not outputs:
            return torch.zeros_like(x)
        mine = order[:start]
        routed = torch.cat(outputs) * weights.reshape(-1)[mine, None]
        return torch.zeros_like(x).index_add_(0, token_of[:start], routed)


class SparseMoE(nn.Module):
    """Router (replicated), routed experts split over the ranks, and the shared expert (if
    any) split as an MLP; one all-reduce sums both."""

    def __init__(self, cfg: MoEConfig, hidden: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg, hidden)
        self.experts = Experts(cfg.num_experts, hidden, cfg.intermediate_size, tp)
        self.shared_experts = None
        if cfg.shared_intermediate_size:
            self.shared_experts = MLP(hidden, cfg.shared_intermediate_size, tp=tp,
                                      reduce_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
