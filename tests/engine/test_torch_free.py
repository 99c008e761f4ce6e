"""The engine's bookkeeping (block pool, KV cache manager, scheduler, request, sampling params)
stays torch-free, so the KV connector's scheduler side and tests can use it without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = ["pdcluster.engine.block_pool", "pdcluster.engine.kv_cache_manager", "pdcluster.engine.scheduler",
              "pdcluster.engine.request", "pdcluster.engine.sampling_params", "pdcluster.engine.outputs",
              "pdcluster.engine.model_config", "pdcluster.engine.config", "pdcluster.engine.prefix_pulls",
              "pdcluster.engine.scheduler_output", "pdcluster.engine.pins", "pdcluster.engine.validation"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


def test_the_check_detects_torch():
    code = "import sys, pdcluster.engine.kv_cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "True"
