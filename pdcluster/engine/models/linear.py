"""Every projection of the models goes through `linear` (and the `Linear` module built on it).

On CPU it runs oneDNN's GEMM (`torch.ops.mkldnn._linear_pointwise`, the op torch's own compiler
emits for CPU linears) or `F.linear`'s MKL/OpenBLAS sgemm, whichever this machine's calibration
chose (engine/kernels/gemm.py: neither wins on every CPU); on CUDA, or where torch was built
without oneDNN, it is `F.linear` (SwiGLU's activation then one Triton pass,
engine/kernels/gpu). Measured on an AVX-512 host's 2 threads (benchmarks/peers_bench.py
measures the whole engine):

    [2048 x 576] @ [576 x 3072]   F.linear 153 GFLOP/s   oneDNN 189
    [32 x 576]   @ [576 x 960]    F.linear 127           oneDNN 152
    batch 1, 60 distinct [3072 x 576] weights (weights stream from memory, as in decode):
                                  F.linear 10.6 GB/s     oneDNN 20.5 GB/s

One row (a batch-1 decode step, the LM head of one sampled token) goes to the engine's own
GEMV (`engine.kernels`, C++ built at setup) where built: a decode step streams every weight
once, and the GEMV reads them faster than oneDNN's small-M path (one thread, the SmolLM2
layer stack: 16.9 vs 12.0 GB/s, against a 20.8 GB/s `sum`).

The weights stay plain tensors (no prepacked copy: prepacking gained under 5% and would double
the memory a model takes). Results differ from `F.linear` by float32 rounding only (another
summation order), which is what vLLM's CPU build does too; the exact-greedy tests against
`transformers` guard it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gemm, gpu


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """float32 always; bfloat16 only where this CPU has oneDNN's bf16 kernels (AVX-512
    BF16 / AMX: an AVX2-only CPU refuses to build the primitive)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN_DTYPES = _onednn_dtypes() if _onednn_available() else ()


_ONEDNN = _onednn_available()


def _gemv_ops(x: torch.Tensor, weight: torch.Tensor):
    """`torch.ops.pdcluster` when x is one float32 CPU row and the GEMV kernel is built."""
    if x.numel() != x.shape[-1] or x.numel() == 0 or not x.is_contiguous():
        return None
    if weight.dim() != 2 or weight.stride(-1) != 1:
        return None
    return kernels.ops_for(x, weight)


def _use_onednn(x: torch.Tensor, use: str) -> bool:
    """oneDNN for this CPU input, where torch has it and this machine's calibration chose it
    for `use` (engine/kernels/gemm.py)."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES
            and gemm.choice()[use] == "onednn")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for x of any leading shape."""
    ops = _gemv_ops(x, weight)
    if ops is not None:
        return ops.gemv(x, weight, bias)
    if _use_onednn(x, "linear"):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 intermediate: int) -> torch.Tensor:
    """SwiGLU's `silu(x @ gate.T) * (x @ up.T)`, gate and up stacked in `weight` `[2I, H]`.
    With oneDNN both elementwise ops ride the GEMMs' epilogues (swish after the gate GEMM,
    a multiply by it after the up GEMM), so no `[T, I]` tensor is read back to apply them.
    One row (batch-1 decode): the engine's GEMV computes both halves and multiplies."""
    if kernels.ENABLED and gpu.serves(x, weight):  # the GEMM, then one fused pass over it
        gate_up = F.linear(x, weight, bias)
        return gpu.ops().silu_and_mul(gate_up.view(-1, 2 * intermediate),
                                      intermediate).view(*x.shape[:-1], intermediate)
    ops = _gemv_ops(x, weight)
    if ops is not None:
        return ops.gemv_swiglu(x, weight, bias, intermediate)
    gate_bias, up_bias = (None, None) if bias is None else bias.split(intermediate)
    if _use_onednn(x, "swiglu"):
        gate = torch.ops.mkldnn._linear_pointwise(x, weight[:intermediate], gate_bias, "swish",
                                                  [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, weight[intermediate:],
                                                         up_bias, "mul")
    if x.device.type == "cpu":  # two GEMMs, then silu and multiply in place: no [T, 2I] split
        gate = F.silu(F.linear(x, weight[:intermediate], gate_bias), inplace=True)
        return gate.mul_(F.linear(x, weight[intermediate:], up_bias))
    gate, up = F.linear(x, weight, bias).split(intermediate, dim=-1)
    return F.silu(gate) * up


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
