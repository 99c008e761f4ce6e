"""Rotary position embeddings: inverse frequencies for each supported `rope_type`, a cos/sin
table over all positions, and the rotation itself (rotate-half convention, as in HF Llama).

The frequency formulas follow the published definitions (Llama 3 frequency smoothing, YaRN's
ramp between interpolation and extrapolation); they are computed in float32 exactly as the
reference implementation does, so greedy outputs match token for token.
"""

from __future__ import annotations

import math

import torch

from pdcluster.engine.models.model_config import RopeConfig


def _need(cfg: RopeConfig, name: str) -> float:
    """A parameter `cfg`'s rope type cannot do without (a ValueError naming it if absent)."""
    value = getattr(cfg, name)
    if value is None:
        raise ValueError(f"rope type {cfg.rope_type!r} needs {name!r}")
    return float(value)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(cfg.theta, dim)
    factor, low, high = (_need(cfg, name) for name in
                         ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = _need(cfg, "original_max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, old_len = cfg.theta, _need(cfg, "original_max_position_embeddings")
    factor = _need(cfg, "factor")
    attention_factor = cfg.attention_factor
    if attention_factor is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(
                factor, cfg.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast or 32), correction_dim(cfg.beta_slow or 1)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def inv_freq_and_scale(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, length dim/2) and the factor applied to cos/sin."""
    if cfg.rope_type == "default":
        return _default_inv_freq(cfg.theta, dim), 1.0
    if cfg.rope_type == "linear":
        return _default_inv_freq(cfg.theta, dim) / _need(cfg, "factor"), 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg, dim), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg, dim)
    raise ValueError(f"unsupported rope type {cfg.rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position up to `max_positions`; `forward` rotates q and k."""

    cos: torch.Tensor  # buffers (register_buffer), [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, cfg: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # (positions, dtype, cos, sin) of the latest step
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        if torch.empty(0).is_meta:  # built on the meta device (the loader): shapes only, and
            # the loader computes the tables once the model has a device (`init_buffers`).
            # Computing them on meta tensors would import torch's compiler (two seconds).
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
            return
        inv_freq, scale = inv_freq_and_scale(cfg, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, N, D] (any N heads: q and k side by side rotate in one call)."""
        cos, sin = self._cos_sin(positions, x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's `[T, 1, D]` tables, gathered once per positions tensor: every layer of a
        step shares one positions tensor, so 29 of 30 layers skip the gather."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            memo = self._memo = (positions, dtype, cos, sin)
        return memo[2], memo[3]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
