"""Limits in bytes, against real nodes: a prefill node P and a decode node D (engines, Mooncake
over TCP, ZMQ side channels, node servers, each with its own key, registered with a real
metadata service). The attacker is a registered member — a decode node's credentials, its
own key — in another process, as another pod would be. While it floods P's side channel and
request socket, a normal disaggregated request (D asks P for the prompt's KV over that same
side channel) keeps its latency within 2x of the idle node's (idle measured on both sides of
the attack: the machine is shared), and the process's memory stays bounded:

- a 16 MiB transfer id (ZMQ drops the frame before decrypting it: MAXMSGSIZE);
- a msgpack bomb (nested empty lists: the schema bounds what decoding may build);
- 10,000 distinct reply addresses (refused: a reply address must be the sender's registered
  one; in the shared-key mode, tests/transfer/test_side_channel.py bounds the sockets);
- a dead reply address (the member's own registered one, dead: P's answers wait on the
  sender thread, never on its receive loop or the engine thread);
- 60 transfer requests for made-up transfer ids, each naming 131,072 blocks (~5 MB of Python
  ints decoded): P holds a peer's pending requests within a budget (its share by entries and
  by weight) and refuses the rest at once (before, it held all 60, ~300 MB, for the
  transfer timeout).
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import time

import pytest
import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TransferSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.node.client import tokens_of
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime
from tests.cluster_secret import TEST_SECRET, node_token
from tests.identity import router_clients
from tests.security import attacks

pytestmark = pytest.mark.slow
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(model_dirs):
    from pdcluster.metadata_service.server import ServerThread
    from tests.metadata_service.helpers import make_config

    engine = EngineConfig(model_dirs["llama-gqa"], num_kv_blocks=128, block_size=8)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as service:
        nodes = [NodeRuntime(NodeConfig(node_id=node_id, role=role, engine=engine,
                                        metadata_address=service.address, kv_timeout_s=10,
                                        bootstrap_token=node_token(node_id))).start()
                 for node_id, role in (("p0", "prefill"), ("d0", "decode"))]
        clients = router_clients(service.address, TEST_SECRET,
                                 {n.config.node_id: n.server.address for n in nodes})
        member = CurveKeys.generate()
        with MetadataClient(service.address, token=node_token("m0")) as client:
            client.register(make_node_info("m0", "decode", kv_address=attacks.DEAD,
                                           kv_session="127.0.0.1:1",
                                           curve_public_key=member.public), 300)
        yield nodes, [clients["p0"], clients["d0"]], member
        for client in clients.values():
            client.close()
        for node in nodes:
            node.stop(drain=False, timeout_s=5)


_ids = iter(range(10**9))
# The bound is 2x idle. The flood of 10,000 reply addresses gets a margin for CI's noise: each
# of its 20,000 messages is CURVE-decrypted by ZMQ's I/O thread before any check can drop it,
# and here that thread shares 2 cores with P, D and the client (one process). Measured on a
# quiet machine since the side channel hands the GIL over between messages: 1.65-1.83x (34-39
# ms against ~20 ms idle); before that change 1.9-2.5x.
SLOWDOWN = {"10,000 reply addresses": 2.5}


def disaggregated_s(pair, hf_reference, model: str) -> float:
    """Seconds for one request prefilled on P, decoded on D; its tokens checked."""
    (p, _), (to_p, to_d), _ = pair
    n = next(_ids)
    prompt = [(7 * n + i) % 900 + 50 for i in range(40)]
    start = time.perf_counter()
    to_d.send(GenerateRequest(f"d{n}", prompt, GREEDY,
                              TransferSpec("remote_prefill", f"t{n}", p.kv_address)))
    to_p.send(GenerateRequest(f"p{n}", prompt, SamplingSpec(max_tokens=1, temperature=0.0),
                              TransferSpec("remote_decode", f"t{n}")))
    got = to_d.collect({f"d{n}"}, timeout_s=60)[f"d{n}"]
    elapsed = time.perf_counter() - start
    to_p.collect({f"p{n}"}, timeout_s=60)
    assert tokens_of(got) == hf_reference(model, prompt, GREEDY.max_tokens)
    return elapsed


def _until_drained(node, timeout_s: float = 30.0) -> None:
    """Until P's side channel has received nothing new for 0.3 s."""
    server = node.engine.connector.worker.transport._server
    deadline, seen = time.monotonic() + timeout_s, -1
    while server.num_received != seen and time.monotonic() < deadline:
        seen = server.num_received
        time.sleep(0.3)


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("attack", list(attacks.ATTACKS))
def test_an_attack_leaves_a_normal_request_within_2x_of_idle(pair, hf_reference, model_dirs,
                                                             attack):
    model = model_dirs["llama-gqa"]
    disaggregated_s(pair, hf_reference, model)  # warm: connections, Mooncake peers
    idle = [disaggregated_s(pair, hf_reference, model) for _ in range(3)]
    rss_before = _max_rss_mib()
    p, member = pair[0][0], pair[2]
    server = p.engine.connector.worker.transport._server
    counted = (server.num_received, server.num_forbidden + server.num_dropped)
    # the attacker is another process, as another pod would be: its own CPU is not ours,
    # and it starts (imports) before the clock does
    spawn = multiprocessing.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    flood = spawn.Process(target=attacks.run, daemon=True, args=(
        attack, p.kv_address, p.server.address, member.public, member.secret,
        p.keys.public, ready, go))
    flood.start()
    assert ready.wait(120), "the attacker did not start"
    go.set()
    loaded = statistics.median(disaggregated_s(pair, hf_reference, model) for _ in range(5))
    flood.join(120)
    assert flood.exitcode == 0
    client = p.engine.connector.worker.transport._client
    deadline = time.monotonic() + 10
    while client._num_queued and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.num_sockets <= 256
    _until_drained(p)  # idle again: P has received (or dropped) everything sent to it
    # the machine is shared and noisy: idle is measured on both sides of the attack
    idle += [disaggregated_s(pair, hf_reference, model) for _ in range(3)]
    assert loaded <= SLOWDOWN.get(attack, 2.0) * statistics.median(idle), (attack, idle, loaded)
    # what decoding the attack kept: bounded by the schema, not by the frames' sizes
    assert _max_rss_mib() - rss_before < 256, (attack, rss_before, _max_rss_mib())
    if attack == "10,000 reply addresses":
        # every message arrived (the attacker lingers until delivered) and every transfer
        # request naming a foreign reply address was refused: the first ones each second
        # decoded and refused, the rest dropped undecoded. Aborts of unknown transfers are
        # harmless and may be let through; the few requests measured above add to received.
        received = server.num_received - counted[0]
        refused = server.num_forbidden + server.num_dropped - counted[1]
        assert received >= 20_000 and refused >= 10_000, (received, refused)
        assert server.num_forbidden >= 50 and server.num_dropped > 0
    if attack == "60 held requests":  # P held its share and refused the rest at once
        assert p.engine.connector.worker._state.budget.num_refused >= 40


def test_zmq_drops_an_oversize_frame_before_reading_it(pair):
    p, member = pair[0][0], pair[2]
    server = p.engine.connector.worker.transport._server
    before = server.num_received
    sock = attacks.dealer(p.kv_address, member, p.keys.public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.send(b"\x00" * (40 << 20))  # past MAXMSGSIZE: ZMQ disconnects the sender
    time.sleep(0.5)
    sock.close()
    assert server.num_received == before
