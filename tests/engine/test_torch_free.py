"""The engine's core (engine/core/: block pool, KV cache manager, scheduler, requests, sampling
params, every module of it) stays torch-free, so the KV connector's scheduler side and tests
can use it without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = sorted(f"pdcluster.engine.core.{path.stem}"
              for path in (ROOT / "pdcluster/engine/core").glob("*.py") if path.stem != "__init__")
TORCH_FREE = CORE + [f"pdcluster.engine.{name}" for name in (
    "config", "output_builder", "models.model_config", "models.model_families",
    "spec_decode.config", "spec_decode.ngram", "spec_decode.decoder", "spec_decode.stats",
    "spec_decode.stops")]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


def test_the_check_detects_torch():
    code = "import sys, pdcluster.engine.kv.kv_cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "True"
