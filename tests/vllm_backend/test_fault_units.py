"""The vLLM backend's fault handling, each part alone (no vLLM engine runs here; the served
cluster's faults are tests/vllm_backend/test_vllm_faults.py):

- `AbortTracker`: an abort counts as pending until vLLM's figures include it;
- `LostTransfers`: lost-transfer notices waiting for their load are bounded and expire;
- `take_curve`: the node's CURVE keys leave the private folder once the connector took them;
- `die_with_parent`: a process spawned by multiprocessing (as vLLM spawns its engine core
  and worker) dies with its parent once it asked to — and outlives it otherwise, which is
  what vLLM's engine core did before.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import psutil
import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.vllm_backend.aborts import AbortTracker
from pdcluster.vllm_backend.handshake import Handshake, take_curve
from pdcluster.vllm_backend.lifeline import die_with_parent
from pdcluster.vllm_backend.lost import LostTransfers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_tracker(settle_s: float = 1.0):
    reports, clock = [0], Clock()
    return AbortTracker(lambda: reports[0], clock, settle_s), reports, clock


def test_an_abort_is_pending_until_a_step_after_its_confirmation():
    tracker, reports, _ = make_tracker()
    assert tracker.settled()
    tracker.started()
    reports[0] = 3  # steps recorded while the abort crosses to the engine core
    assert not tracker.settled()
    tracker.confirmed()
    assert not tracker.settled()  # the stats read now may predate the abort
    reports[0] = 4
    assert tracker.settled()


def test_an_abort_that_finished_nothing_settles_after_the_grace_period():
    tracker, _, clock = make_tracker(settle_s=1.0)
    tracker.started()
    tracker.confirmed()  # vLLM takes no step after it: nothing changed
    clock.now += 0.9
    assert not tracker.settled()
    clock.now += 0.1
    assert tracker.settled()


def test_overlapping_aborts_wait_for_the_last():
    tracker, reports, _ = make_tracker()
    tracker.started()
    tracker.started()
    tracker.confirmed()
    reports[0] = 10
    assert not tracker.settled()  # the second one is still on its way
    tracker.confirmed()
    assert not tracker.settled()
    reports[0] = 11
    assert tracker.settled()


def test_lost_transfers_wait_for_their_load_bounded_and_expiring():
    clock = Clock()
    lost = LostTransfers(ttl_s=10.0, max_entries=2, clock=clock)
    lost.note("t1", "p0 died")
    lost.note("t2", "p0 died")
    lost.note("t3", "p1 refused")
    assert len(lost) == 2 and lost.take("t1") is None  # the oldest made room
    assert lost.take("t3") == "p1 refused" and lost.take("t3") is None  # used up
    clock.now += 9.9
    assert len(lost) == 1
    clock.now += 0.1
    assert lost.take("t2") is None and len(lost) == 0  # expired
    lost.note("t4", "p0 died")
    lost.forget("t4")
    assert lost.take("t4") is None
    with pytest.raises(ValueError):
        LostTransfers(ttl_s=0)


def test_the_connector_takes_the_nodes_keys_once():
    keys = CurveKeys(public=b"P" * 40, secret=b"S" * 40)
    handshake = Handshake()
    try:
        assert take_curve(handshake.dir) is None  # a node without CURVE
        handshake.write_curve(keys)
        assert take_curve(handshake.dir) == keys
        # a node killed from now on leaves no key behind in its folder
        assert b"S" * 40 not in (handshake.dir / "curve").read_bytes()
        assert (handshake.dir / "curve").stat().st_mode & 0o777 == 0o600
        with pytest.raises(RuntimeError, match="taken already"):
            take_curve(handshake.dir)  # never a silent fall back to plaintext
    finally:
        handshake.close()


def _child(tie: bool, ready) -> None:
    if tie:
        die_with_parent()
    ready.set()
    time.sleep(120)


def _parent(tie: bool, pids) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_child, args=(tie, ready))
    child.start()
    ready.wait(60)
    pids.put(child.pid)
    time.sleep(120)


def _child_after_parent_killed(tie: bool) -> bool:
    """Spawn a parent that spawns a child, SIGKILL the parent: whether the child is gone 5 s
    later (it is killed here otherwise)."""
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    parent = context.Process(target=_parent, args=(tie, pids))
    parent.start()
    child_pid = pids.get(timeout=60)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(10)
    child = psutil.Process(child_pid)
    try:
        child.wait(5)
        return True
    except psutil.TimeoutExpired:
        child.kill()
        return False


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_tied_to_its_parent_dies_with_it():
    assert _child_after_parent_killed(tie=True)
    assert not _child_after_parent_killed(tie=False)  # what vLLM's engine core did


def test_a_process_not_spawned_by_multiprocessing_is_left_alone():
    assert die_with_parent() is False  # pytest's own process
