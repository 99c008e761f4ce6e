"""The chaos benchmark's own arithmetic and guards, without a cluster: phases, percentiles
and recovery from request outcomes; each fault's load; the goals; refusals of bad options;
no packet filter touched outside the benchmark's own network namespace."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from benchmarks.__main__ import main
from benchmarks.chaos_bench import RESUME_GOAL_S, fault_load, goals, inflight_figures
from benchmarks.chaos_cluster import ChaosSettings
from benchmarks.chaos_load import LoadSpec, Outcome, make_prompts, run_load
from benchmarks.chaos_netns import IN_NETNS_ENV, LinkFault
from benchmarks.chaos_procs import descendants, kill_tree
from benchmarks.chaos_stats import quantile, summarize


def outcome(i: int, sent: float, latency: float, ok: bool = True, **kw) -> Outcome:
    return Outcome(i, i % 2 == 0, sent, sent + latency, ok, 200 if ok else 503, **kw)


def test_phases_recovery_and_failures_from_outcomes():
    before = [outcome(i, 0.1 * i, 0.1) for i in range(10)]  # done by 1.0 s
    during = [outcome(10, 1.8, 3.0), outcome(11, 2.2, 0.4, ok=False, cause="node gone")]
    after = [outcome(12 + i, 3.0 + 0.1 * i, 0.1) for i in range(10)]
    figures = summarize(before + during + after, fault_start=2.0, fault_end=2.5, window=4)
    assert figures["sent"] == 22 and figures["completed"] == 21 and figures["failed"] == 1
    assert figures["failed_by_cause"] == {"node gone": 1}
    assert figures["failed_by_status"] == {"503": 1}
    assert figures["latency"]["before"] == {"n": 10, "p50_ms": 100.0, "p99_ms": 100.0}
    assert figures["latency"]["during"]["n"] == 1  # in flight across the fault, completed
    assert figures["latency"]["after"]["n"] == 10
    # the first request sent after the fault began completed 3.1 - 2.0 s after it
    assert figures["first_success_s"] == pytest.approx(1.1)
    # the failed one keeps its window from counting as recovered: the next window does
    assert figures["p99_recovered_s"] == pytest.approx(1.0)


def test_quantile_is_nearest_rank():
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile([1.0, 2.0], 0.99) == 2.0
    assert quantile([], 0.5) != quantile([], 0.5)  # NaN


def test_each_fault_load_covers_the_fault_with_prompts_of_its_own():
    base = LoadSpec(rate=8.0, count=120)
    stall, at_s = fault_load(base, "metadata_stall", lease_ttl_s=10)
    kill, _ = fault_load(base, "decode_kill", lease_ttl_s=10)
    assert at_s == pytest.approx(3.75)
    assert stall.duration_s >= at_s + 3 * 10  # the stall, a TTL after it, and more
    assert kill.count == 120 and kill.seed != stall.seed
    assert make_prompts(kill, 1000) != make_prompts(stall, 1000)
    shared = {tuple(p[:64]) for p in make_prompts(kill, 1000)}
    assert len(shared) == base.num_prefixes  # every prompt behind one of the shared prefixes


def test_goals_allow_a_dead_decode_node_only_its_own_streams():
    fault = {"failed": 2, "leaked_blocks": 0, "index_exact_within_ttl": True}
    measured = {"faults": {"decode_kill": {**fault, "inflight_at_kill": 2},
                           "metadata_restart": fault}, "soak": None}
    assert goals(measured, 10) == {"decode_kill": True, "metadata_restart": False}


def test_goals_fail_a_kill_whose_node_left_children_running():
    fault = {"failed": 0, "leaked_blocks": 0, "index_exact_within_ttl": True,
             "decode_transfers": {"timeouts": 0}}
    measured = {"faults": {"prefill_kill": {**fault, "orphans_killed": ["VLLM::Worker(7)"]},
                           "decode_kill": {**fault, "orphans_killed": []}},
                "soak": None, "left_running_after_stop": ["python(8)"]}
    assert goals(measured, 10) == {"prefill_kill": False, "decode_kill": True,
                                   "nothing_left_running": False}


def test_the_requests_in_flight_at_a_fault_resume_and_finish():
    outcomes = [
        outcome(0, 1.0, 0.5, first_token=1.2),  # streamed, done before the fault
        outcome(2, 1.8, 2.0, first_token=1.9),  # streamed, had its first token already
        outcome(4, 1.9, 3.0, first_token=2.6),  # streamed, waiting at the fault: resumed
        outcome(5, 1.95, 1.5),  # not streamed: no first token to tell
        outcome(6, 2.5, 0.3, first_token=2.7),  # sent after the fault
    ]
    assert inflight_figures(outcomes, start=2.0) == {
        "inflight_at_fault": 3, "inflight_done_after_fault_s_max": 2.9,
        "inflight_waiting_at_fault": 1, "inflight_resumed_after_fault_s_max": 0.6}
    assert inflight_figures(outcomes[:1], start=2.0)["inflight_resumed_after_fault_s_max"] is None


def test_a_prefill_kill_meets_its_goal_only_if_the_decode_node_resumed_at_once():
    fault = {"failed": 0, "leaked_blocks": 0, "index_exact_within_ttl": True,
             "decode_transfers": {"timeouts": 0}, "inflight_done_after_fault_s_max": 1.4,
             "inflight_resumed_after_fault_s_max": RESUME_GOAL_S - 0.1}
    slow = {**fault, "inflight_resumed_after_fault_s_max": RESUME_GOAL_S + 0.1}
    # no timeout counted (a vLLM node's counters may lag), yet a request waited one out
    waited = {**fault, "inflight_done_after_fault_s_max": 30.137}
    for f, met in ((fault, True), (slow, False), (waited, False)):
        assert goals({"faults": {"prefill_kill": f}}, 10, kv_timeout_s=30.0) == {
            "prefill_kill": met}


def test_vllm_nodes_get_vllms_block_size_and_backend():
    own = ChaosSettings(model="m")
    vllm = ChaosSettings(model="m", engine="vllm", kv_blocks=64)
    assert own.engine_options() == {"block_size": 16, "num_kv_blocks": 512}
    assert vllm.engine_options() == {"block_size": 32, "num_kv_blocks": 64, "backend": "vllm"}
    assert vllm.node_start_s > own.node_start_s  # three processes importing torch and vLLM
    with pytest.raises(ValueError, match="engine must be one of"):
        ChaosSettings(model="m", engine="sglang")


def test_bad_options_are_refused_before_anything_starts(capsys):
    assert main(["chaos", "--faults", "prefill_kill,typo"]) == 2
    assert "unknown faults ['typo']" in capsys.readouterr().err
    assert main(["chaos", "--faults", "etcd_restart"]) == 2
    assert "needs --backend etcd" in capsys.readouterr().err


# A parent with one child that exits with it (its stdin is the parent's pipe) and one that
# lives on in a session of its own (as vLLM's engine core did when its node was killed).
_TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                 stdin=subprocess.PIPE)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                 start_new_session=True)
print("ready", flush=True)
time.sleep(60)
"""


def test_killing_a_node_reports_and_ends_children_that_outlive_it():
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline() == b"ready\n"
        children = descendants(parent.pid)
        assert len(children) == 2
        result = kill_tree(parent.pid, grace_s=2.0)
        assert result.num_children == 2 and result.children_gone_after_s is None
        assert len(result.orphans_killed) == 1  # the one that lived on, killed here
        assert descendants(parent.pid) == []
    finally:
        parent.kill()
        parent.wait()


def test_no_packet_filter_is_touched_outside_the_benchmarks_namespace(monkeypatch):
    monkeypatch.delenv(IN_NETNS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="outside the benchmark's own network namespace"):
        LinkFault([1234])


class _Completions:
    """A real HTTP server answering /v1/completions at once with one token (a stand-in for
    the router: the load's own schedule is under test, not the cluster)."""

    async def __aenter__(self) -> str:
        from aiohttp import web

        async def complete(request: web.Request) -> web.StreamResponse:
            choice = {"text": "x", "finish_reason": "length"}
            if not (await request.json())["stream"]:
                return web.json_response({"choices": [choice],
                                          "usage": {"completion_tokens": 1}})
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            await reply.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await reply.write(b"data: [DONE]\n\n")
            return reply

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def test_a_fault_that_outlasts_the_load_still_gets_requests_sent_after_it():
    ended = []

    async def slow_fault(t0: float) -> None:  # lasts well past the load's 4 requests
        await asyncio.sleep(1.0)
        ended.append(time.monotonic() - t0)

    async def load(spec: LoadSpec) -> list[Outcome]:
        async with _Completions() as url:
            return await run_load(url, "m", spec, 1000, on_start=slow_fault)

    fixed = asyncio.run(load(LoadSpec(rate=20.0, count=4, max_tokens=1)))
    assert len(fixed) == 4  # without after_side_s the count is the count
    extended = asyncio.run(load(LoadSpec(rate=20.0, count=4, max_tokens=1, after_side_s=0.3)))
    after = [o for o in extended if o.sent > ended[-1]]
    assert all(o.ok for o in fixed + extended)
    assert len(after) >= 3 and max(o.sent for o in after) >= ended[-1] + 0.2
    assert max(o.sent for o in extended) < ended[-1] + 0.3 + 0.1  # and then it stops


def test_a_router_port_another_server_took_before_the_router_bound_it_means_another_port(
        model_dirs, monkeypatch):
    """As a Ray gRPC server once did: something that is not the router listens on the port
    picked for it. The router must be found answering HTTP on a port of its own, not taken
    as up because something accepts connections there."""
    import socket
    import urllib.error
    import urllib.request

    from benchmarks import chaos_cluster
    from tests.chaos.conftest import MODEL

    cluster = chaos_cluster.ChaosCluster(ChaosSettings(model=model_dirs[MODEL]))
    with socket.socket() as taken:  # accepts connections, never answers
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        free_port = chaos_cluster.free_port
        monkeypatch.setattr(chaos_cluster, "free_port", lambda: next(picks, 0) or free_port())
        try:
            cluster.start_metadata()
            cluster.start_router()
            assert cluster.router_port != taken.getsockname()[1]
            with pytest.raises(urllib.error.HTTPError) as answer:  # the router's, no node yet
                urllib.request.urlopen(f"{cluster.router_url}/health", timeout=10)
            assert answer.value.code == 503 and "nodes" in json.loads(answer.value.read())
            assert "address already in use" in cluster.log_tail("router")
        finally:
            cluster.stop()
