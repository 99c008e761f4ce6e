"""`python -m pdcluster.engine.kernels [--force]`: at setup, pick this machine's GEMM library
(engine/kernels/gemm.py), then build the engine's native kernels (engine/kernels). Its own
module, so that the kernels package never imports gemm (which imports the package).

API: `main()`.
"""

from __future__ import annotations

import os
import shutil
import sys

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gemm


def main() -> int:
    """`python -m pdcluster.engine.kernels [--force]`: pick this machine's GEMM library
    (engine/kernels/gemm.py), then build the kernels, or say why not (exit 1)."""
    picked = gemm.calibrate_if_needed()
    if picked is not None:
        print(f"engine GEMMs: linear on {picked['linear']}, SwiGLU on {picked['swiglu']} "
              f"({gemm.choice_path()})")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        print("engine kernels: no C++ compiler (g++) found; the engine uses its torch paths",
              file=sys.stderr)
        return 1
    try:
        path = kernels.build(force="--force" in sys.argv[1:])
    except RuntimeError as exc:
        print(f"engine kernels: {exc}\nthe engine uses its torch paths", file=sys.stderr)
        return 1
    print(f"engine kernels: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
