"""Two vLLM nodes (NodeRuntime with `backend="vllm"`: vLLM's AsyncLLM with its engine-core and
worker processes, pdcluster's connector inside them, Mooncake over TCP on 127.0.0.1, the CURVE
side channel) registered with a real metadata service. Remote prefill from the prefill node
into the decode node's paged cache gives exactly the tokens the decode node computes alone;
vLLM's KV events reach the global index under the hashes the router computes; aborts, a
prefill node that never comes and a dead one end in recompute or release, with every vLLM
block free afterwards; a prefill node reported lost ends the wait at once, even when the
report reaches a vLLM busy elsewhere."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from pdcluster.core.hashing import hash_block_tokens  # noqa: E402
from pdcluster.core.node_wire import (  # noqa: E402
    AbortRequest,
    GenerateRequest,
    PrefillLost,
    PrefixSource,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.metadata_service.client import MetadataClient  # noqa: E402
from pdcluster.metadata_service.server import ServerThread  # noqa: E402
from pdcluster.node.client import tokens_of  # noqa: E402
from pdcluster.node.config import NodeConfig  # noqa: E402
from pdcluster.node.runtime import NodeRuntime  # noqa: E402
from tests.cluster_secret import TEST_SECRET, node_token  # noqa: E402
from tests.identity import registered_signer, router_clients  # noqa: E402
from tests.metadata_service.helpers import make_config  # noqa: E402
from tests.models import random_prompts  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 32
KV_TIMEOUT_S = 6.0
DEAD_ADDRESS = "tcp://127.0.0.1:9"  # nothing listens on the discard port


class Pair:
    """`tp`: each node's tensor-parallel size (p0, d0). `fatal[node_id]`: what lost that
    node's engine for good, as its server reports it (`on_fatal`)."""

    def __init__(self, model: str, metadata_address: str, tp: tuple[int, int] = (1, 1),
                 kv_timeout_s: float = KV_TIMEOUT_S) -> None:
        self.fatal: dict[str, list[Exception]] = {"p0": [], "d0": []}

        def start(node_id: str, role: str, tp_size: int) -> NodeRuntime:
            engine = EngineConfig(model, backend="vllm", block_size=BLOCK, num_kv_blocks=192,
                                  max_num_seqs=8, tensor_parallel_size=tp_size)
            return NodeRuntime(NodeConfig(
                node_id=node_id, role=role, engine=engine, metadata_address=metadata_address,
                lease_ttl_s=5, publish_interval_s=0.02, bootstrap_token=node_token(node_id),
                kv_timeout_s=kv_timeout_s), on_fatal=self.fatal[node_id].append,
            ).start(registration_timeout_s=30)

        # Both at once, as a cluster starts its node actors: each vLLM start is mostly its
        # engine-core and worker processes importing vLLM.
        with ThreadPoolExecutor(2) as pool:
            starting = {node_id: pool.submit(start, node_id, role, tp_size)
                        for (node_id, role), tp_size
                        in zip((("p0", "prefill"), ("d0", "decode")), tp, strict=True)}
        self.nodes = {n: f.result() for n, f in starting.items() if f.exception() is None}
        failed = [f.exception() for f in starting.values() if f.exception() is not None]
        if failed:
            self.close_nodes()
            raise failed[0]
        self.p, self.d = self.nodes["p0"], self.nodes["d0"]
        # each node with its own keys, the test a registered router (as in a cluster)
        clients = router_clients(metadata_address, TEST_SECRET,
                                 {n: node.server.address for n, node in self.nodes.items()})
        self.to_p, self.to_d = clients["p0"], clients["d0"]
        self.tickets = registered_signer(metadata_address, TEST_SECRET)[1]  # pull tickets

    def disaggregated(self, rid: str, prompt: list[int], max_tokens: int = 8,
                      source: str | None = None) -> list:
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.to_d.send(GenerateRequest(f"{rid}-d", prompt, spec, TransferSpec(
            "remote_prefill", rid, source or self.p.kv_address)))
        if source is None:
            self.to_p.send(GenerateRequest(f"{rid}-p", prompt, SamplingSpec(
                max_tokens=1, temperature=0.0), TransferSpec("remote_decode", rid)))
            self.to_p.collect({f"{rid}-p"})
        return self.to_d.collect({f"{rid}-d"})[f"{rid}-d"]

    def local(self, rid: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.to_d.send(GenerateRequest(rid, prompt, spec))
        return tokens_of(self.to_d.collect({rid})[rid])

    def vllm_processes(self, node) -> list[psutil.Process]:
        """`node`'s vLLM engine core and worker (the worker serves the node's KV address)."""
        port = int(node.kv_address.rsplit(":", 1)[1])
        for proc in psutil.Process().children(recursive=True):
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in proc.net_connections("tcp")):
                return [proc.parent(), proc]
        raise AssertionError(f"no process of ours serves {node.kv_address}")

    def counter(self, node, name: str) -> int:
        return node.engine.transfer_counters().get(name, 0)

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        """Every block of both engines (those still running) free again (vLLM's own KV usage
        back to zero) and no transfer in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {n: node.server.call(lambda e: e.pool_state())
                      for n, node in self.nodes.items()}
            if all(s["num_held_blocks"] == 0 and s["num_pinned_requests"] == 0
                   and s["num_unfinished"] == 0 for s in states.values()):
                return
            assert time.monotonic() < deadline, f"blocks still held: {states}"
            time.sleep(0.1)

    def stop_node(self, node_id: str) -> None:
        """Stop one node for good, as its actor does before it exits (`assert_idle` and
        `close` leave it out from then on)."""
        self.nodes.pop(node_id).stop(drain=False, timeout_s=10)

    def close(self) -> None:
        self.to_p.close()
        self.to_d.close()
        self.close_nodes()

    def close_nodes(self) -> None:
        for node in self.nodes.values():
            node.stop(drain=False)


@pytest.fixture(scope="module")
def metadata():
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server, \
            MetadataClient(server.address, cluster_secret=TEST_SECRET) as client:
        yield server, client


@pytest.fixture(scope="module")
def pair(model_dirs, metadata):
    pair = Pair(model_dirs["llama-vllm"], metadata[0].address)
    yield pair
    pair.close()


def test_remote_prefill_gives_the_tokens_the_decode_node_computes_alone(pair) -> None:
    prompts = random_prompts(4, BLOCK, 140, seed=3) + [list(range(5, 5 + BLOCK))]
    before = pair.d.engine.transfer_counters().get("blocks_received", 0)
    for i, prompt in enumerate(prompts):
        got = pair.disaggregated(f"t{i}", prompt)
        assert all(isinstance(m, TokenDelta) for m in got), got
        pair.d.server.call(lambda e: e.reset_prefix_cache())  # the local run must compute
        assert tokens_of(got) == pair.local(f"l{i}", prompt), f"prompt {i} ({len(prompt)})"
    counters = pair.d.engine.transfer_counters()
    assert counters["recvs_failed"] == 0
    expected = sum(-(-len(p) // BLOCK) for p in prompts)
    assert counters["blocks_received"] - before == expected
    # one descriptor per layer per run of consecutive blocks (2 layers)
    assert counters["descriptors_received"] <= 2 * len(prompts) * 2
    pair.assert_idle()


def test_vllm_events_reach_the_index_under_the_routers_hashes(pair, metadata) -> None:
    _, client = metadata
    prompt = random_prompts(1, 3 * BLOCK + 5, 3 * BLOCK + 5, seed=11)[0]
    pair.disaggregated("ev", prompt)
    chain = hash_block_tokens(prompt, BLOCK, config=pair.d.engine.hash_config)
    deadline = time.monotonic() + 10
    while dict(client.query(chain)) != {"p0": 3, "d0": 3}:
        assert time.monotonic() < deadline, dict(client.query(chain))
        time.sleep(0.05)
    assert set(chain) <= set(pair.d.engine.cached_block_hashes())
    # an emptied cache leaves the index at once (AllBlocksCleared)
    assert pair.d.server.call(lambda e: e.reset_prefix_cache())
    deadline = time.monotonic() + 10
    while dict(client.query(chain)) != {"p0": 3}:
        assert time.monotonic() < deadline, dict(client.query(chain))
        time.sleep(0.05)


def test_a_prompt_cached_on_the_decode_node_releases_the_prefill_node(pair) -> None:
    # 2 blocks + 1 token: cached on D, only the last token is left to compute
    prompt = random_prompts(1, 2 * BLOCK + 1, 2 * BLOCK + 1, seed=21)[0]
    expected = pair.local("warm", prompt)
    sends = pair.p.engine.transfer_counters().get("sends_ok", 0)
    assert tokens_of(pair.disaggregated("cached", prompt)) == expected
    assert pair.p.engine.transfer_counters().get("sends_ok", 0) == sends  # nothing sent
    pair.assert_idle(timeout_s=3)  # P let go at once, not at its timeout


def test_an_unreachable_prefill_node_means_recompute(pair) -> None:
    prompt = random_prompts(1, 90, 90, seed=31)[0]
    started = time.monotonic()
    got = pair.disaggregated("dead", prompt, source=DEAD_ADDRESS)
    assert time.monotonic() - started < KV_TIMEOUT_S + 10
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    assert tokens_of(got) == pair.local("dead-local", prompt)
    pair.assert_idle()


@contextmanager
def stopped(processes: list[psutil.Process]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block: a vLLM that is busy elsewhere, or
    not scheduled at all on a loaded machine."""
    for proc in processes:
        proc.suspend()
    try:
        yield
    finally:
        for proc in reversed(processes):
            proc.resume()


# Before test_a_lost_prefill_node_means_recompute_at_once: the node's first reports reach a
# vLLM that is stopped here, as they would a busy one.
@pytest.mark.parametrize("registered", [False, True])
def test_a_refused_request_is_recomputed_at_once_by_a_busy_vllm(pair, registered) -> None:
    """The prefill node refused the request (it never got it; the router reports that as
    `PrefillLost`), and the report reaches the decode node while its vLLM is stopped: with
    the request's load not registered yet (the request came while vLLM was stopped), or
    registered (its receive waits for a prefill node that will never send). Once vLLM runs
    again it recomputes the prompt at once, not after its KV timeout: the receive is failed
    as lost (`sources_lost`), never timed out, and the tokens are the decode node's own."""
    prompt = random_prompts(1, 100, 100, seed=71 + registered)[0]
    rid, tid = f"refused{registered}", f"refused-t{registered}"
    spec = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
    vllm = pair.vllm_processes(pair.d)
    lost, timeouts = pair.counter(pair.d, "sources_lost"), pair.counter(pair.d, "timeouts")
    request = GenerateRequest(rid, prompt, spec,
                              TransferSpec("remote_prefill", tid, pair.p.kv_address))
    started = time.monotonic()
    if registered:
        pair.to_d.send(request)
        wait_for(lambda: pair.d.server.call(lambda e: e.pool_state())["num_pinned_requests"])
    with stopped(vllm):
        if not registered:
            pair.to_d.send(request)
        pair.to_d.send(PrefillLost(rid, tid, "p0: overloaded: test"))
        time.sleep(1.5)
    got = pair.to_d.collect({rid})[rid]
    assert time.monotonic() - started < KV_TIMEOUT_S - 1
    wait_for(lambda: pair.counter(pair.d, "sources_lost") == lost + 1)
    assert pair.counter(pair.d, "timeouts") == timeouts
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    assert tokens_of(got) == pair.local(f"{rid}-local", prompt)
    pair.assert_idle(timeout_s=KV_TIMEOUT_S + 5)  # P forgot D's request at the latest then


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("before_it_starts", [False, True])
def test_a_lost_prefill_node_means_recompute_at_once(pair, before_it_starts) -> None:
    """The router's PrefillLost reaches the receive inside vLLM's worker process: the decode
    node recomputes within a second, not at its KV timeout — also when the notice comes
    right behind the request, before vLLM has started the receive."""
    prompt = random_prompts(1, 100, 100, seed=51 + before_it_starts)[0]
    rid, tid = f"lost{before_it_starts}", f"lost-t{before_it_starts}"
    spec = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    pair.to_d.send(GenerateRequest(rid, prompt, spec,
                                   TransferSpec("remote_prefill", tid, pair.p.kv_address)))
    if not before_it_starts:
        time.sleep(0.5)  # its receive is waiting for a prefill that never comes
    pair.to_d.send(PrefillLost(rid, tid, "test: gone"))
    got = pair.to_d.collect({rid})[rid]
    assert time.monotonic() - started < KV_TIMEOUT_S - 1
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    assert tokens_of(got) == pair.local(f"{rid}-local", prompt)
    pair.assert_idle()


@pytest.mark.parametrize("holder_still_caches", [True, False])
def test_a_prefix_pulled_from_an_idle_vllm_node_gives_the_same_tokens(
        pair, holder_still_caches) -> None:
    """Global prefix reuse between vLLM nodes: the prefill node computed a prompt (and is idle
    now); the decode node, told that it holds the prompt's blocks, pulls them instead of
    computing them. A stale hint (the holder's cache emptied) costs only compute."""
    prompt = random_prompts(1, 4 * BLOCK + 7, 4 * BLOCK + 7, seed=61 + holder_still_caches)[0]
    spec = SamplingSpec(max_tokens=6, temperature=0.0, ignore_eos=True)
    pair.to_p.send(GenerateRequest("hold", prompt, spec))
    pair.to_p.collect({"hold"})
    if not holder_still_caches:
        assert pair.p.server.call(lambda e: e.reset_prefix_cache())
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    pulled = pair.d.engine.transfer_counters().get("blocks_pulled", 0)
    served = pair.p.engine.transfer_counters().get("blocks_served", 0)
    pair.to_d.send(GenerateRequest("puller", prompt, spec,
                                   prefix_source=PrefixSource(pair.p.kv_address, 4,
                                                              pair.tickets.sign(
                                       "puller", "d0", "p0", prompt, BLOCK, 4, None))))
    got = tokens_of(pair.to_d.collect({"puller"})["puller"])
    time.sleep(1.0)  # the workers' counters reach the nodes with vLLM's next stats
    expected_blocks = 4 if holder_still_caches else 0
    assert pair.d.engine.transfer_counters().get("blocks_pulled", 0) - pulled == expected_blocks
    assert pair.p.engine.transfer_counters().get("blocks_served", 0) - served == expected_blocks
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    assert got == pair.local("pull-local", prompt, max_tokens=6)
    pair.assert_idle()


def test_aborts_free_both_sides(pair) -> None:
    prompt = random_prompts(1, 100, 100, seed=41)[0]
    spec = SamplingSpec(max_tokens=8, temperature=0.0)
    # D waits for KV that never comes (no prefill request): its client gives up
    pair.to_d.send(GenerateRequest("ab-d", prompt, spec,
                                   TransferSpec("remote_prefill", "ab", pair.p.kv_address)))
    time.sleep(1.0)
    pair.to_d.send(AbortRequest("ab-d"))
    # P computed a prefill that no decode node asks for: held until its timeout, then freed
    pair.to_p.send(GenerateRequest("ab2-p", prompt, SamplingSpec(max_tokens=1),
                                   TransferSpec("remote_decode", "ab2")))
    pair.to_p.collect({"ab2-p"})
    pair.assert_idle(timeout_s=KV_TIMEOUT_S + 10)
    # and the pair still serves
    again = random_prompts(1, 50, 50, seed=42)[0]
    pair.d.server.call(lambda e: e.reset_prefix_cache())
    assert tokens_of(pair.disaggregated("after", again)) == pair.local("after-l", again)
