"""The engine's Triton kernels for a test: on CUDA as compiled, elsewhere through Triton's
interpreter. Triton reads TRITON_INTERPRET when a kernel is defined: tests/conftest.py imports
triton.language under it on machines without a GPU, and `triton_ops` sets it while the kernel
modules are first imported (the engine never imports them on CPU by itself)."""

from __future__ import annotations

import os

import torch


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_ops():
    """`engine.kernels.gpu.ops()`, interpreted where there is no GPU."""
    from pdcluster.engine.kernels import gpu

    if torch.cuda.is_available() or gpu.ops.cache_info().currsize:
        return gpu.ops()
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return gpu.ops()
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
