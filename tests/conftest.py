"""Suite-wide settings: no model hub at run time, and `@pytest.mark.gpu` tests skip cleanly
on machines without CUDA. Session fixtures: the tiny random models, and the real model
(tests/real_model.py), each loaded once."""

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


def _interpret_triton_here() -> None:
    """Without a GPU the engine's Triton kernels run in Triton's interpreter
    (tests/triton_kernels.py). Triton reads TRITON_INTERPRET when a function is decorated,
    its own library's included, so triton.language is imported under it before anything
    else imports triton; the variable is then dropped, so processes the tests start do not
    inherit it."""
    if _cuda_available() or os.environ.get("TRITON_INTERPRET"):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.experimental.gluon  # noqa: F401  (the interpreter imports it at launch)
        import triton.language  # noqa: F401
    finally:
        del os.environ["TRITON_INTERPRET"]


_interpret_triton_here()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random HF model folders, one per variant in tests/models.py."""
    from tests.models import build_model_dirs

    return build_model_dirs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """A wheel of the checkout (tests/installed.py), built once per session."""
    from tests.installed import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_install(built_wheel, tmp_path_factory):
    """That wheel installed into a fresh venv: an `Installed` to run commands of."""
    from tests.installed import Installed, fresh_venv, site_package_dir

    python = fresh_venv(built_wheel, tmp_path_factory.mktemp("venv") / "env")
    return Installed("wheel", python, site_package_dir(python))


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


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """The converted SmolLM2-135M-Instruct folder; skips when setup has not made it."""
    from tests.real_model import missing_reason, real_model_dir

    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    return str(real_model_dir())


@pytest.fixture(scope="session")
def real_reference(real_model_dir):
    """transformers on the real model, loaded once per session (tests.real_model)."""
    from tests.real_model import RealModelReference

    return RealModelReference(real_model_dir)


@pytest.fixture(scope="session")
def real_llm(real_model_dir):
    """pdcluster's engine on the real model, loaded once per session (256 KV blocks)."""
    from pdcluster.engine import LLM

    return LLM(real_model_dir, dtype="float32", device="cpu", num_kv_blocks=256)


@pytest.fixture
def node(model_dirs):
    """One `NodeServer` on the tiny llama-gqa model (128 KV blocks of 8 tokens) and a blocking
    client of it, both closed after the test."""
    from pdcluster.engine import LLMEngine
    from pdcluster.node.client import BlockingNodeClient
    from pdcluster.node.server import NodeServer
    from tests.cluster_secret import TEST_CURVE

    engine = LLMEngine.from_model(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8)
    server = NodeServer(engine, "n0", "both", curve=TEST_CURVE).start()
    client = BlockingNodeClient(server.address, curve=TEST_CURVE)
    yield server, client
    client.close()
    server.stop(drain=False)


def pytest_sessionfinish(session, exitstatus):
    """No module of ours may have been loaded under a second name in this process — a bare
    `engine.llm` beside `pdcluster.engine.llm` is two class objects for one file — and each
    of ours must come from the package folder that `pdcluster` itself was loaded from."""
    import sys
    from pathlib import Path

    from tests.installed import PACKAGE_ROOMS

    # the checkout's harnesses (benchmarks/ at the root) share a room's name, not its files
    harnesses = Path(__file__).resolve().parents[1] / "benchmarks"
    bare = sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] in PACKAGE_ROOMS
                  and not _file_under(module, harnesses))
    package = sys.modules.get("pdcluster")
    root = Path(package.__file__).resolve().parent if package else None
    stray = sorted(name for name, module in list(sys.modules.items())
                   if name.startswith("pdcluster.") and root is not None
                   and getattr(module, "__file__", None)
                   and not Path(module.__file__).resolve().is_relative_to(root))
    if bare or stray:
        session.config.get_terminal_writer().line(
            f"modules loaded under a second name: {bare}; outside {root}: {stray}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _file_under(module, folder) -> bool:
    from pathlib import Path

    path = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
    return path is not None and Path(path).resolve().is_relative_to(folder)
