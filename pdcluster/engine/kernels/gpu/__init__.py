"""The engine's GPU kernels, written in Triton: paged decode and prefill attention reading the
KV cache in place (`decode_attention`, `prefill_attention`), a layer's small steps fused
(`layer_ops`: RMSNorm with the residual add, RoPE with the KV-cache write, SwiGLU), and an MoE
layer's routed experts grouped on the device (`fused_moe`).
`reference` holds the torch definition each kernel is tested against.

`serves(*tensors)` says whether the kernels take these tensors: CUDA tensors, where triton
imports. `ops()` imports the kernel modules on first use (Triton reads TRITON_INTERPRET when a
kernel is defined, so CPU tests set it before that and run the same kernels through Triton's
interpreter) and returns a namespace with the CPU C++ ops' names (engine/kernels/__init__.py):
callers use either through one interface.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from types import SimpleNamespace

import torch


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the GPU kernels run these tensors: all on one CUDA device, triton installed."""
    return (bool(tensors) and all(t.is_cuda for t in tensors) and triton_available()
            and len({t.device for t in tensors}) == 1)


@cache
def ops() -> SimpleNamespace:
    """The kernels: `paged_attention`, `prefill_attention`, `rms_norm`, `add_rms_norm_`,
    `rope_and_cache_`, `silu_and_mul`, `moe_experts`, `route_softmax_topk` (see each module)."""
    from pdcluster.engine.kernels.gpu import (
        decode_attention,
        fused_moe,
        layer_ops,
        prefill_attention,
    )

    return SimpleNamespace(
        paged_attention=decode_attention.paged_attention,
        prefill_attention=prefill_attention.prefill_attention,
        decode_splits=decode_attention.decode_splits,
        rms_norm=layer_ops.rms_norm,
        add_rms_norm_=layer_ops.add_rms_norm_,
        rope_and_cache_=layer_ops.rope_and_cache_,
        silu_and_mul=layer_ops.silu_and_mul,
        moe_experts=fused_moe.moe_experts,
        route_softmax_topk=fused_moe.route_softmax_topk,
    )
