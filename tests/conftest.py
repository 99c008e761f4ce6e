"""Suite-wide settings: no model hub at run time, and `@pytest.mark.gpu` tests skip cleanly
on machines without CUDA."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random HF model folders, one per variant in tests/models.py."""
    from tests.models import build_model_dirs

    return build_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def cluster_secret():
    """The session's cluster secret (tests/cluster_secret.py): every node, router and metadata
    service a test builds needs one."""
    from tests.cluster_secret import TEST_SECRET

    return TEST_SECRET


@pytest.fixture(scope="session")
def hf_reference():
    """Memoised transformers greedy reference: (model_dir, prompt_ids, n) -> token ids."""
    from tests.models import make_hf_reference

    return make_hf_reference()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
