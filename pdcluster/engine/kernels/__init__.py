"""The engine's native CPU kernels: C++ ops (csrc/*.cpp) built once on the machine that runs
them, with its compiler and for its CPU, and loaded as `torch.ops.pdcluster.*`.

- `paged_attention`: decode attention reading the paged KV cache in place
  (engine/models/attention.py uses it on CPU for float32 caches);
- `gemv`, `gemv_swiglu`: one row times a weight matrix at the memory's rate (batch-1 decode's
  projections, engine/models/linear.py);
- `rms_norm`, `add_rms_norm_`, `rope_and_cache_`: a decoder layer's small steps as one op each
  (engine/models/llama.py);
- `decode_layers_`: a batch-1 decode step's whole layer stack through the kernels above in one
  call, with no return to Python between them (engine/models/llama.py, `CausalLM.forward`).

`build()` compiles the sources with g++ against the installed torch (`python -m
pdcluster.engine.kernels`; scripts/setup.sh runs it) into `cache_dir()/kernels/<key>/`, where the
key hashes the sources, torch's version, the flags and the CPU's instruction sets, so a changed
source, torch or machine gets its own build. `ops()` loads that library when it exists and
returns `torch.ops.pdcluster`, else None: the engine then takes its pure-torch paths, which give
the same tokens. Nothing compiles at run time. `PDCLUSTER_KERNELS=0` turns the kernels off.

The GPU kernels (Triton) are the subpackage `gpu`; `layer_ops_for(*tensors)` picks whichever
set serves the tensors for the ops both have.

API: `ops()`, `ops_for(*tensors)`, `layer_ops_for(*tensors)`, `ENABLED`, `build(force=False)`,
`library_path()`, `DISABLE_ENV`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from pdcluster.core.paths import cache_dir
from pdcluster.engine.kernels import gpu

logger = logging.getLogger(__name__)

DISABLE_ENV = "PDCLUSTER_KERNELS"
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention.cpp", "gemv.cpp", "layer_ops.cpp",
                             "decode_step.cpp"))
HEADERS = (Path(__file__).with_name("csrc") / "kernels.h",)  # part of the key, not compiled
# -march=native: built for the machine it runs on (the key holds its instruction sets), AVX2
# or AVX-512 alike. Where the compiler or assembler does not know this CPU (an old g++ on a new
# host), `build` retries with the instruction sets named (`isa_choices`): the sources use AVX2
# intrinsics where __AVX2__ and __FMA__ are defined, a scalar path otherwise: any of these compiles.
# -fopenmp: at::parallel_for is inline OpenMP; the library links libgomp.so.1 by soname,
# which resolves to the copy torch has already loaded (one thread pool, not two).
# -ffp-contract=off: `a * b + c` rounds twice, as torch's separate ops do (RoPE stays
# bit-identical to transformers'); the attention and GEMV kernels ask for FMAs explicitly.
CXXFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
ISA_NATIVE: tuple[str, ...] = ("-march=native",)
ISA_AVX2 = ("-mavx2", "-mfma")
_NAME = "pdcluster_kernels"


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), part of every per-machine cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join((torch.__version__, *CXXFLAGS, cpu_flags())).encode())
    return cache_dir() / "kernels" / digest.hexdigest()[:16] / f"{_NAME}.so"


def isa_choices(flags: str | None = None) -> list[tuple[str, ...]]:
    """The instruction-set flags to try, best first: the machine's own, then AVX2+FMA where the
    CPU has them, then none (the kernels' scalar paths)."""
    have = set((cpu_flags() if flags is None else flags).split())
    choices: list[tuple[str, ...]] = [ISA_NATIVE]
    if {"avx2", "fma"} <= have:
        choices.append(ISA_AVX2)
    choices.append(())
    return choices


def _compile_command(output: Path, isa: tuple[str, ...] = ISA_NATIVE) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    return [os.environ.get("CXX", "g++"), *CXXFLAGS, *isa, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *includes, *map(str, SOURCES), "-o", str(output),
            *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
            "-lc10", "-ltorch_cpu"]


def build(force: bool = False) -> Path:
    """Compile the kernels for this machine (once), trying `isa_choices()` in turn; returns the
    library. Raises `RuntimeError` with the compiler's output when every choice fails."""
    path = library_path()
    if path.is_file() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for isa in isa_choices():
        error = _compile(path, isa)
        if error is None:
            return path
        errors.append(f"[{' '.join(isa) or 'no ISA flags'}] {error}")
        logger.warning("engine kernels: the build with %s failed; trying the next flags",
                       " ".join(isa) or "no ISA flags")
    raise RuntimeError("building the engine's kernels failed:\n" + "\n".join(errors))


def _compile(path: Path, isa: tuple[str, ...]) -> str | None:
    """One compile into `path`; None when it worked, else the reason."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        partial = Path(tmp) / path.name
        try:
            done = subprocess.run(_compile_command(partial, isa), capture_output=True,
                                  text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        if done.returncode != 0:
            return done.stderr[-3000:] or f"exit status {done.returncode}"
        os.replace(partial, path)  # atomic: a concurrent loader sees all or nothing
    return None


# Tests turn the kernels off in-process (monkeypatch) to compare against the torch paths.
ENABLED = True


def ops_for(*tensors: torch.Tensor):
    """`ops()` when every tensor is a float32 CPU tensor (the only kind the kernels take) and
    the kernels are on, else None."""
    if not ENABLED:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return None
    return ops()


def layer_ops_for(*tensors: torch.Tensor):
    """The ops both kernel sets have — `rms_norm`, `add_rms_norm_`, `rope_and_cache_`,
    `paged_attention`, with one signature each — for these tensors: the CPU C++ ops for float32
    CPU tensors (`ops_for`), the Triton kernels (engine/kernels/gpu) for CUDA tensors; None
    elsewhere or with the kernels off."""
    if not ENABLED:
        return None
    if gpu.serves(*tensors):
        return gpu.ops()
    return ops_for(*tensors)


@cache
def ops():
    """`torch.ops.pdcluster` with the kernels loaded, or None (not built, turned off, or the
    library does not load here; the reason is logged once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if not all(source.is_file() for source in (*SOURCES, *HEADERS)):
        logger.warning("engine kernel sources missing from %s: using the torch paths",
                       SOURCES[0].parent)
        return None
    path = library_path()
    if not path.is_file():
        logger.info("engine kernels not built for this machine (%s): using the torch paths; "
                    "`python -m pdcluster.engine.kernels` builds them", path.parent)
        return None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        logger.warning("engine kernels at %s do not load (%s): using the torch paths", path, exc)
        return None
    return torch.ops.pdcluster
