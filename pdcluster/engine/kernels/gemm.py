"""Which GEMM library runs the models' projections on this machine: oneDNN
(`torch.ops.mkldnn._linear_pointwise`, SwiGLU's silu and multiply in its epilogues) or torch's
own `F.linear` (MKL/OpenBLAS sgemm; SwiGLU as two GEMMs and an in-place silu and multiply).
Neither wins everywhere: on an AVX-512 host oneDNN ran the prefill GEMMs ~20% faster (issue
14); on an AVX2-only EPYC, `F.linear` ran SmolLM2's MLP 20-30% faster (one thread: 82.5 vs
63.9 GFLOP/s at 2,048 rows, 78.8 vs 63.2 at 256, 54.4 vs 45.2 at 32).

`calibrate()` times both on a decoder's shapes (one thread, CPU time, best of five, so
neighbours' load does not decide) and records the winner per use (`linear`, `swiglu`) in
`cache_dir()/kernels/gemm-<key>.json`, the key hashing torch's version and the CPU's flags;
`python -m pdcluster.engine.kernels` (setup) runs it. `choice()` reads that record; without
one, or for a use it does not name a known library for, oneDNN (where torch has it).

API: `choice()`, `calibrate(path=None)`, `choice_path()`.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from pdcluster.core.paths import cache_dir

USES = ("linear", "swiglu")
BACKENDS = ("onednn", "torch")
DEFAULT = {"linear": "onednn", "swiglu": "onednn"}
# A decoder's projections (SmolLM2's widths) at a prefill chunk and a decode batch.
_HIDDEN, _QKV, _INTER = 576, 960, 1536
_ROWS = (256, 32)


def choice_path() -> Path:
    from pdcluster.engine.kernels import cpu_flags

    key = hashlib.sha256(f"{torch.__version__} {cpu_flags()}".encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"gemm-{key}.json"


@cache
def choice() -> dict[str, str]:
    """The recorded winner per use, or `DEFAULT`."""
    try:
        recorded = json.loads(choice_path().read_text())
    except (OSError, ValueError):
        return dict(DEFAULT)
    if not isinstance(recorded, dict):
        return dict(DEFAULT)
    return {use: _valid(recorded.get(use), DEFAULT[use]) for use in USES}


def _valid(backend: object, default: str) -> str:
    return backend if isinstance(backend, str) and backend in BACKENDS else default


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _variants(rows: int) -> dict[tuple[str, str], object]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, _HIDDEN, generator=gen)
    qkv = torch.randn(_QKV, _HIDDEN, generator=gen)
    gate_up = torch.randn(2 * _INTER, _HIDDEN, generator=gen) / _HIDDEN**0.5
    down = torch.randn(_HIDDEN, _INTER, generator=gen) / _INTER**0.5
    pointwise = torch.ops.mkldnn._linear_pointwise

    def onednn_swiglu():
        gate = pointwise(x, gate_up[:_INTER], None, "swish", [], "")
        h = pointwise.binary(x, gate, gate_up[_INTER:], None, "mul")
        return pointwise(h, down, None, "none", [], "")

    def torch_swiglu():
        h = F.silu(F.linear(x, gate_up[:_INTER]), inplace=True).mul_(F.linear(x, gate_up[_INTER:]))
        return F.linear(h, down)

    return {("linear", "onednn"): lambda: pointwise(x, qkv, None, "none", [], ""),
            ("linear", "torch"): lambda: F.linear(x, qkv),
            ("swiglu", "onednn"): onednn_swiglu, ("swiglu", "torch"): torch_swiglu}


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def calibrate(path: Path | None = None) -> dict:
    """Time both libraries for each use (summed over the row counts), record and return the
    winners with the timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {(use, backend): 0.0 for use in USES for backend in BACKENDS}
        for rows in _ROWS:
            for key, fn in _variants(rows).items():
                seconds[key] += _seconds(fn)
    finally:
        torch.set_num_threads(threads)
    record: dict[str, object] = {
        use: min(BACKENDS, key=lambda b, use=use: seconds[(use, b)])  # type: ignore[misc]
        for use in USES}
    record["seconds"] = {f"{use}/{b}": round(s, 6) for (use, b), s in seconds.items()}
    path = path or choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    choice.cache_clear()
    return record


def calibrate_if_needed() -> dict | None:
    """Setup's step: calibrate once per machine and torch, where oneDNN is there to choose; a
    record that does not parse or names no known library is measured again."""
    if not _onednn_available():
        return None
    try:
        recorded = json.loads(choice_path().read_text())
    except (OSError, ValueError):
        return calibrate()
    if not isinstance(recorded, dict) or any(recorded.get(use) not in BACKENDS for use in USES):
        return calibrate()
    return recorded
