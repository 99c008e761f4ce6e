"""The engine's Triton kernels for a test: on CUDA as compiled, elsewhere through Triton's
interpreter. Triton reads TRITON_INTERPRET when a kernel is defined: tests/conftest.py imports
triton.language under it on machines without a GPU, and `triton_ops` sets it while the kernel
modules are first imported (the engine never imports them on CPU by itself)."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator

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


# aten ops that launch nothing on a GPU: views, and allocations (a captured graph's memory is
# its pool's)
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "split",
    "split_with_sizes", "unbind", "unsqueeze", "squeeze", "transpose", "permute", "t",
    "as_strided", "expand", "alias", "detach", "lift_fresh", "empty", "empty_strided",
    "empty_like",
})


@contextlib.contextmanager
def kernel_launches() -> Iterator[collections.Counter]:
    """Count what the code in the block would launch on a GPU, run on CPU through Triton's
    interpreter: each Triton kernel launch by the kernel's name, and each torch op that
    computes (views and allocations excluded) by the op's name. Torch ops that Triton's
    interpreter runs inside a launch are not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    counts: collections.Counter = collections.Counter()
    inside = [0]
    launch = interpreter.GridExecutor.__call__

    def counted_launch(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        inside[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and name not in _NO_KERNEL:
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    interpreter.GridExecutor.__call__ = counted_launch
    try:
        with TorchOps():
            yield counts
    finally:
        interpreter.GridExecutor.__call__ = launch
