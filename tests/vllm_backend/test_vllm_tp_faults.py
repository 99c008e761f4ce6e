"""A vLLM prefill node at TP=2 (vLLM's CPU build, multiprocessing executor, gloo) whose
tensor-parallel rank 1 worker is SIGKILLed while a disaggregated request's KV waits on it to
be read by a decode node at TP=1. The moment is chosen by stopping processes (SIGSTOP), not by
timing (as tests/chaos/prefill_lost.py does):

1. the decode node's vLLM (engine core and worker) is stopped; the request goes to both nodes
   and the prefill node does its part (its KV pinned, waiting for the decode node to ask);
2. a second request streams on the prefill node; once it has a token, the prefill node's
   vLLM is stopped, its rank 1 worker SIGKILLed, and the rest resumed;
3. the prefill node must go down cleanly: the streaming request fails with "internal" naming
   the lost engine and its server reports the loss (`on_fatal`, where a node actor exits so
   that Ray restarts it). Its actor then stops the node (`Pair.stop_node`), none of its vLLM
   processes outlives it, its connection closes, and the router tells the decode node
   (`PrefillLost`, sent here as the router sends it) while its vLLM is still stopped;
4. the decode node's vLLM runs again and recomputes the prompt at once: its receive failed as
   lost (`sources_lost`), never timed out; exactly transformers' greedy tokens; no block held.

Then the decode node's worker is SIGKILLed while the node is idle (nothing running, nothing
pinned): the node notices on its own and goes down the same way.

A module of its own: the kills spend its nodes, which a shared pair could not lend to later
tests (each vLLM node start costs 30-60 s on 2 cores)."""

from __future__ import annotations

import time

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from pdcluster.core.node_wire import (  # noqa: E402
    GenerateRequest,
    PrefillLost,
    RequestError,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.node.client import tokens_of  # noqa: E402
from pdcluster.vllm_backend.failures import VllmEngineLost  # noqa: E402
from tests.models import random_prompts  # noqa: E402
from tests.vllm_backend.test_vllm_nodes import (  # noqa: E402, F401
    BLOCK,
    Pair,
    metadata,
    stopped,
    wait_for,
)

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
# Long enough that nothing here could wait it out unnoticed (test_vllm_tp.py's, for the
# same 2 cores shared by three vLLM processes and the other node's).
KV_TIMEOUT_S = 30.0
# The goal is 1 s; a loaded 2-core machine gets more (tests/vllm_backend/test_vllm_faults.py).
RESUMED_WITHIN_S = 5.0
DOWN_WITHIN_S = 15.0  # a node noticing its dead rank and failing its requests
# vLLM's engine core may linger after its executor failed (13 s seen under a load of 12);
# stopping the node ends it (SIGTERM, then SIGKILL after vLLM's 5 s grace; 0.2 s seen).
GONE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def pair(model_dirs, metadata):  # noqa: F811
    pair = Pair(model_dirs["llama-vllm"], metadata[0].address, tp=(2, 1),
                kv_timeout_s=KV_TIMEOUT_S)
    yield pair
    pair.close()


def vllm_tree(pair: Pair, node) -> list[psutil.Process]:
    """`node`'s vLLM engine core and every process under it (its tensor-parallel workers)."""
    core = pair.vllm_processes(node)[0]
    return [core, *core.children(recursive=True)]


def rank_worker(tree: list[psutil.Process], rank: int) -> psutil.Process:
    """vLLM titles each tensor-parallel worker `VLLM::Worker_TP<rank>`."""
    found = [p for p in tree if f"Worker_TP{rank}" in " ".join(p.cmdline())]
    assert len(found) == 1, [p.cmdline() for p in tree]
    return found[0]


def gone(procs: list[psutil.Process]) -> bool:
    def dead(proc: psutil.Process) -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return all(dead(p) for p in procs)


def test_a_prefill_rank_killed_under_pinned_kv_downs_the_node_and_the_decode_node_recomputes(
        pair, hf_reference, model_dirs) -> None:
    model = model_dirs["llama-vllm"]
    warm = random_prompts(1, 2 * BLOCK + 5, 2 * BLOCK + 5, seed=81)[0]
    # both engines' first steps, and the decode node's side channel to the prefill node
    assert tokens_of(pair.disaggregated("warm", warm)) == hf_reference(model, warm, 8)
    prompt = random_prompts(1, 3 * BLOCK + 9, 3 * BLOCK + 9, seed=83)[0]
    rid, tid = "killed-d", "killed-t"
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    p_tree, d_vllm = vllm_tree(pair, pair.p), pair.vllm_processes(pair.d)
    rank1 = rank_worker(p_tree, 1)
    lost = pair.counter(pair.d, "sources_lost")
    timeouts = pair.counter(pair.d, "timeouts")
    with stopped(d_vllm):
        pair.to_d.send(GenerateRequest(rid, prompt, spec,
                                       TransferSpec("remote_prefill", tid, pair.p.kv_address)))
        pair.to_p.send(GenerateRequest("killed-p", prompt, SamplingSpec(
            max_tokens=1, temperature=0.0), TransferSpec("remote_decode", tid)))
        assert isinstance(pair.to_p.collect({"killed-p"})["killed-p"][-1], TokenDelta)
        assert pair.p.server.call(lambda e: e.pool_state())["num_pinned_requests"] == 1
        pair.to_p.send(GenerateRequest("busy", warm, SamplingSpec(
            max_tokens=200, temperature=0.0, ignore_eos=True)))
        assert isinstance(pair.to_p.recv(), TokenDelta)  # it is streaming
        others = [p for p in p_tree if p.pid != rank1.pid]
        with stopped(others):
            rank1.kill()
            wait_for(lambda: gone([rank1]))  # a zombie until its stopped parent reaps it
        killed_at = time.monotonic()
        failed = pair.to_p.collect({"busy"}, timeout_s=DOWN_WITHIN_S)["busy"][-1]
        assert isinstance(failed, RequestError) and failed.code == "internal", failed
        assert "vLLM's engine is dead" in failed.message, failed.message
        wait_for(lambda: pair.fatal["p0"], DOWN_WITHIN_S)
        down_s = time.monotonic() - killed_at
        assert isinstance(pair.fatal["p0"][0], VllmEngineLost), pair.fatal["p0"]
        assert pair.p.server.failure is pair.fatal["p0"][0] and pair.p.server.draining
        pair.stop_node("p0")  # what its actor does before it exits: its connection closes
        wait_for(lambda: gone(p_tree), GONE_WITHIN_S)  # no vLLM process outlives the node
        pair.to_d.send(PrefillLost(rid, tid, "p0: disconnected"))  # so the router says
        time.sleep(1.0)  # the notice waits for a decode node busy elsewhere
    resumed_at = time.monotonic()
    got = pair.to_d.collect({rid}, timeout_s=KV_TIMEOUT_S + 30)[rid]
    done_s = time.monotonic() - resumed_at
    assert all(isinstance(m, TokenDelta) for m in got), got
    assert tokens_of(got) == hf_reference(model, prompt, MAX_TOKENS)
    assert done_s < RESUMED_WITHIN_S, f"resumed after {done_s:.1f} s (down after {down_s:.1f})"
    wait_for(lambda: pair.counter(pair.d, "sources_lost") == lost + 1)
    assert pair.counter(pair.d, "timeouts") == timeouts
    pair.assert_idle()  # the decode node holds no block


# Last: it spends the decode node.
def test_a_vllm_worker_killed_while_the_node_is_idle_takes_the_node_down(pair) -> None:
    pair.assert_idle()
    tree = vllm_tree(pair, pair.d)
    pair.vllm_processes(pair.d)[1].kill()  # the worker (TP=1: it serves the KV address)
    wait_for(lambda: pair.fatal["d0"], DOWN_WITHIN_S)  # no request needed to notice
    assert isinstance(pair.fatal["d0"][0], VllmEngineLost), pair.fatal["d0"]
    assert pair.d.server.failure is pair.fatal["d0"][0] and pair.d.server.draining
    pair.stop_node("d0")
    wait_for(lambda: gone(tree), GONE_WITHIN_S)
