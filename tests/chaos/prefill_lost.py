"""A prefill node killed under one disaggregated request at a moment chosen by stopping
processes (SIGSTOP), not by timing — on a served cluster of one prefill and one decode node
(tests/chaos/conftest.py), either engine:

1. the decode node's engine is stopped; the request goes in through the router; the prefill
   node does its part (its KV pinned, waiting for the decode node to ask for it);
2. `registered=False`: the decode node has not asked yet (its load is not registered) when
   the prefill node is SIGKILLed. `registered=True`: the prefill node is stopped instead, the
   decode node runs until it has asked (its load registered, the request waiting in the
   stopped prefill node's socket), is stopped again, and the prefill node is SIGKILLed;
3. the router sees the prefill node's connection close and tells the decode node
   (`PrefillLost`), which gets the notice while its engine is still stopped — `hold_s` more
   (a busy engine, on a loaded machine) — and then runs again.

It must resume the request at once: its receive failed because its source is gone, never
timed out, the request done. Told by the router (`sources_lost`), or — with `registered=True`,
when the decode node's request to the prefill node had not left before it was stopped — by
its own side channel, which cannot hand the request to the dead node (`sources_unreachable`):
both wait for the engine to run again, and whichever it meets first fails the receive.

The engine that is stopped is the node process itself for the own engine, and vLLM's engine
core and worker for a vLLM node (its node process relays the router's messages meanwhile).
Before anything is stopped (and once every node is up: a prefill node killed before is
restarted by Ray), one request through the same two nodes opens the decode node's side
channel to the prefill node (a restarted prefill node is a new peer: a first handshake with a
stopped one could not complete).

API: `kill_prefill_after_its_part`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import psutil

from benchmarks.chaos_bench import wait_ready
from benchmarks.chaos_load import LoadSpec, make_prompts
from benchmarks.chaos_procs import descendants, kill_tree
from tests.chaos.conftest import Chaos

MAX_TOKENS = 8
WAIT_S = 30.0  # for the cluster (a vLLM node restarting takes longer: wait_ready first)


@dataclass(slots=True)
class Reply:
    first_token: float | None = None
    done: float | None = None
    num_tokens: int = 0
    error: str | None = None


def kill_prefill_after_its_part(chaos: Chaos, registered: bool, seed: int,
                                hold_s: float = 1.0) -> dict:
    """Run the schedule above (an AssertionError if the router does not tell the decode
    node within 5 s); what the decode node did: `resumed_after_s` / `done_after_s` (the
    request's first token and end, from the moment its engine runs again), the request's
    `error` and `num_tokens`, the decode node's `sources_lost`, `sources_unreachable` and
    `timeouts`, and whether its counters showed the failed receive at all
    (`receive_failed`)."""
    asyncio.run(wait_ready(chaos.cluster))  # a prefill node killed before is back
    prefill, decode = _the_two_nodes(chaos)
    prompts = make_prompts(LoadSpec(rate=1, count=2, unique=True, seed=seed),
                           chaos.vocab_size)
    warm = _stream(chaos, prompts[0])
    warm.join(WAIT_S)  # the decode node's side channel to this prefill node is open
    assert warm.reply.done is not None, warm.reply.error
    pids = chaos.cluster.node_pids()
    d_engine = _engine_processes(chaos, pids[decode])
    p_tree = [psutil.Process(pid) for pid in (pids[prefill], *descendants(pids[prefill]))]
    before = _decode_counters(chaos, decode)
    told = _router_counter(chaos, "router_prefill_lost_total")
    with _stopped(d_engine):
        reply = _stream(chaos, prompts[1])
        _wait(lambda: _prefill_part_done(chaos, prefill), "the prefill node's part")
        if registered:
            with _stopped(p_tree):
                with _running(d_engine):
                    _wait(lambda: _load_registered(chaos, decode), "the decode node's load")
                    time.sleep(0.2)  # its request on the way to the stopped prefill node
                kill_tree(pids[prefill])
        else:
            kill_tree(pids[prefill])
        _wait(lambda: _router_counter(chaos, "router_prefill_lost_total") > told,
              "word from the router to the decode node", timeout_s=5.0)
        time.sleep(hold_s)
    resumed_at = time.monotonic()
    reply.thread.join(WAIT_S)
    after = _decode_counters(chaos, decode, moved_from=before)
    return {"error": reply.reply.error, "num_tokens": reply.reply.num_tokens,
            "resumed_after_s": _since(reply.reply.first_token, resumed_at),
            "done_after_s": _since(reply.reply.done, resumed_at),
            **{name: after[name] - before[name]
               for name in ("sources_lost", "sources_unreachable", "timeouts")},
            # False: the decode node's counters showed no failed receive within WAIT_S
            "receive_failed": after["recvs_failed"] > before["recvs_failed"]}


@dataclass(slots=True)
class _Call:
    thread: threading.Thread
    reply: Reply

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)


def _stream(chaos: Chaos, prompt: list[int]) -> _Call:
    """One streamed request through the router, on a thread of its own."""
    reply = Reply()
    client = openai.OpenAI(base_url=f"{chaos.cluster.router_url}/v1", api_key="none",
                           max_retries=0, timeout=120)

    def call() -> None:
        try:
            for chunk in client.completions.create(
                    model=chaos.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text is not None:
                    reply.first_token = reply.first_token or time.monotonic()
                if chunk.usage is not None:  # the last chunk
                    reply.num_tokens = chunk.usage.completion_tokens
            reply.done = time.monotonic()
        except openai.APIError as exc:
            reply.error = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call, daemon=True, name="prefill-lost-request")
    thread.start()
    return _Call(thread, reply)


def _the_two_nodes(chaos: Chaos) -> tuple[str, str]:
    prefills = [n for n in chaos.cluster.actors if n.startswith("p")]
    decodes = [n for n in chaos.cluster.actors if n.startswith("d")]
    assert len(prefills) == len(decodes) == 1, "the schedule needs one node of each role"
    return prefills[0], decodes[0]


def _engine_processes(chaos: Chaos, node_pid: int) -> list[psutil.Process]:
    if chaos.cluster.settings.engine == "vllm":
        children = [psutil.Process(pid) for pid in descendants(node_pid)]
        assert children, "a vLLM node without vLLM's processes"
        return children
    return [psutil.Process(node_pid)]


@contextmanager
def _stopped(processes: list[psutil.Process]) -> Iterator[None]:
    for proc in processes:
        proc.suspend()
    try:
        yield
    finally:
        for proc in reversed(processes):
            try:
                proc.resume()
            except psutil.NoSuchProcess:  # killed meanwhile (the prefill node)
                continue


@contextmanager
def _running(processes: list[psutil.Process]) -> Iterator[None]:
    for proc in reversed(processes):
        proc.resume()
    try:
        yield
    finally:
        for proc in processes:
            proc.suspend()


def _prefill_part_done(chaos: Chaos, prefill: str) -> bool:
    """Its KV is pinned for the decode node, and its reply has reached the router."""
    import json

    import ray

    state = ray.get(chaos.cluster.actors[prefill].pool_state.remote(), timeout=WAIT_S)
    with urllib.request.urlopen(f"{chaos.cluster.router_url}/health", timeout=10) as reply:
        inflight = json.loads(reply.read())["nodes"][prefill]["inflight"]
    return state["num_pinned_requests"] > 0 and inflight == 0


def _load_registered(chaos: Chaos, decode: str) -> bool:
    import ray

    state = ray.get(chaos.cluster.actors[decode].pool_state.remote(), timeout=WAIT_S)
    return state["num_held_blocks"] > 0 or state["num_pinned_requests"] > 0


def _decode_counters(chaos: Chaos, decode: str, moved_from: dict | None = None) -> dict:
    """The decode node's receive counters; with `moved_from`, once the receive's end shows
    in them (a vLLM node reports its worker's counters with later steps)."""
    import ray

    names = ("recvs_ok", "recvs_failed", "sources_lost", "sources_unreachable", "timeouts")
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = ray.get(chaos.cluster.actors[decode].transfer_stats.remote(), timeout=WAIT_S)
        counters = {name: int(stats.get(name, 0)) for name in names}
        if moved_from is None or counters["recvs_failed"] > moved_from["recvs_failed"] \
                or time.monotonic() > deadline:
            return counters
        time.sleep(0.1)


def _router_counter(chaos: Chaos, name: str) -> float:
    with urllib.request.urlopen(f"{chaos.cluster.router_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.02)


def _since(moment: float | None, start: float) -> float | None:
    return None if moment is None else round(moment - start, 3)

