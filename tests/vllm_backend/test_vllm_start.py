"""A vLLM start that fails part-way leaves nothing behind: vLLM's `AsyncLLM` starts its
engine-core and worker processes and opens its ZMQ sockets before it builds its stat loggers,
and a half-built one left to the garbage collector kept those processes running and blocked
the collecting thread for good (a test process hung at a random allocation, every test after
a failed start timing out). Here the stat logger's build fails, as a real registry clash
(`DuplicateTimeseries`) made it fail, or the node's own part of the start once vLLM is up."""

from __future__ import annotations

import gc
import threading
import time

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.vllm_backend.engine import VllmEngine  # noqa: E402
from pdcluster.vllm_backend.handshake import Handshake  # noqa: E402
from pdcluster.vllm_backend.stats import SerializedPrometheusStatLogger  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fails", ["while_vllm_builds", "after_vllm_is_up"])
def test_a_failed_vllm_start_stops_its_processes_and_leaves_nothing_to_block_the_collector(
        model_dirs, monkeypatch, fails) -> None:
    ours = psutil.Process()
    before = {p.pid for p in ours.children(recursive=True)}
    started: dict[psutil.Process, str] = {}  # vLLM's, as the failure comes: their commands

    def refuse(*args, **kwargs) -> None:
        # multiprocessing's resource tracker, started on the way, serves the process for good
        started.update({p: _cmdline(p) for p in ours.children(recursive=True)
                        if p.pid not in before and "resource_tracker" not in _cmdline(p)})
        raise RuntimeError(f"refused {fails}")

    if fails == "while_vllm_builds":  # vLLM's own part: its stat loggers
        monkeypatch.setattr(SerializedPrometheusStatLogger, "__init__", refuse)
    else:  # the node's part once vLLM is up: the connector's session
        monkeypatch.setattr(Handshake, "kv_session", refuse)
    assert f"refused {fails}" in _start_failing(model_dirs["llama-vllm"])
    assert any("EngineCore" in command for command in started.values()), started
    deadline = time.monotonic() + 15
    while (alive := [p for p in started if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, [started[p] for p in alive]
    collector = threading.Thread(target=gc.collect, daemon=True)  # the half-built AsyncLLM
    collector.start()
    collector.join(15)
    assert not collector.is_alive(), "collecting the failed start blocked"


def _start_failing(model: str) -> str:
    """The error of a VllmEngine's start, kept in a reference cycle (the error's traceback
    holds this frame, which holds the error), as a caller that keeps it does (pytest caching
    a module fixture's error did): only the garbage collector frees it."""
    try:
        VllmEngine(EngineConfig(model, backend="vllm", block_size=32, num_kv_blocks=64))
    except RuntimeError as exc:
        failed = [exc]
    return str(failed[0])


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie: vLLM's, stopped
        return ""
