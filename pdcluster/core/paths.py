"""Where pdcluster keeps what it writes outside a request: converted models, the peer
benchmarks' virtual environments, benchmark artefacts. Never next to the code (`__file__`),
which is read-only or shared once installed.

The root is `$PDCLUSTER_CACHE_DIR`, else `$XDG_CACHE_HOME/pdcluster`, else
`~/.cache/pdcluster`. The Makefile points it at the checkout's `.cache/`, so `make run` and
`make test` keep everything in the checkout.

API: `CACHE_ENV`, `cache_dir()`, `BUILTIN_MODEL_NAME`, `builtin_model_dir()`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDCLUSTER_CACHE_DIR"
# The built-in model's folder name, which is also the name the API serves it under
# (scripts/setup.sh converts it there).
BUILTIN_MODEL_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The cache root (not created here: each user makes the folder it writes)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdcluster"


def builtin_model_dir() -> Path:
    """Where setup converts the built-in model (SmolLM2-135M-Instruct)."""
    return cache_dir() / BUILTIN_MODEL_NAME
