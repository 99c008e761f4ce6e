"""Engine tests name their device and dtype. Those that leave them to the engine ("auto") run
on `PDCLUSTER_TEST_DEVICE` (default: the engine's own choice, cpu on a machine without a GPU)
in float32, where the parity tests against transformers hold token for token:

    PDCLUSTER_TEST_DEVICE=cuda pytest tests/engine
"""

from __future__ import annotations

import os

import pytest

TEST_DEVICE_ENV = "PDCLUSTER_TEST_DEVICE"


@pytest.fixture(autouse=True)
def _engine_test_device(monkeypatch):
    device = os.environ.get(TEST_DEVICE_ENV)
    if not device:
        return
    import torch

    from pdcluster.engine import llm_engine
    from pdcluster.engine.engine_setup import resolve_device, resolve_dtype

    monkeypatch.setattr(llm_engine, "resolve_device",
                        lambda name: resolve_device(device if name == "auto" else name))
    monkeypatch.setattr(llm_engine, "resolve_dtype",
                        lambda name, dev, mc: torch.float32 if name == "auto"
                        else resolve_dtype(name, dev, mc))
