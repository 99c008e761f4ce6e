"""Mixture-of-experts layers shared by every MoE family (Mixtral, Qwen3-MoE, DeepSeek-V2/V3).

- `Router`: scores experts and picks each token's top-k with the model's normalisation
  (`MoEConfig`): softmax then top-k, renormalised or not (Mixtral: always — the same as a
  softmax over the top-k logits; Qwen3-MoE: if `norm_topk_prob`); DeepSeek's grouped top-k
  (V2: a group's best softmax score; V3: sigmoid scores plus `e_score_correction_bias`, a
  group's two best, the bias used for selection only) and `routed_scaling_factor`.
- `Experts`: the routed experts' weights stacked at load time (`w13 [E, 2I, H]`, `w2 [E, H, I]`).
  A step's (token, expert) pairs are sorted by expert, the tokens gathered with one
  `index_select`, each expert runs two matmuls on its contiguous group, and the weighted rows
  are summed back per token with one `index_add_`. Python loops over experts, never tokens.
- `SparseMoE`: router + experts + an optional always-on shared expert (DeepSeek).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models.linear import Linear, linear, silu_and_mul
from pdcluster.engine.models.model_families import MoEConfig


class FusedLinear(Linear):
    """A Linear whose output rows are several checkpoint weights side by side; the loader
    fills shard i at rows `sum(shard_sizes[:i])` onward."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = FusedLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        return self.down_proj(silu_and_mul(x, proj.weight, proj.bias, self.intermediate))


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
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        grouped = x.index_select(0, token_of)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = grouped[start : start + count]
                hidden = silu_and_mul(rows, self.w13[expert], None, self.intermediate)
                outputs.append(linear(hidden, self.w2[expert]))
                start += count
        routed = torch.cat(outputs) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, routed)


class SparseMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.gate = Router(cfg, hidden)
        self.experts = Experts(cfg.num_experts, hidden, cfg.intermediate_size)
        self.shared_experts = None
        if cfg.shared_intermediate_size:
            self.shared_experts = MLP(hidden, cfg.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
