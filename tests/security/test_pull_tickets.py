"""Pull tickets (core.pull_ticket), against real nodes: holder h0 and puller p0 (engine, node
server, their own keys, registered with a real metadata service; Mooncake over TCP and the
KV side channel on 127.0.0.1), a registered router's ticket signer, and member m0, a
registered decode node with its own key, side channel and Mooncake memory.

Before tickets, a member could send a holder its own `PrefixPullRequest` for any tokens and
salt and read `XferDone.num_blocks_sent`: how much of that prompt the holder caches (and get
the KV written into its memory). Now the holder serves a pull only with a ticket a
registered router signed for exactly that holder, puller and chain, unexpired; any other is
answered at once as failed (no blocks, `num_blocks_sent` 0) and counted. Each refusal is
paired with the move that is served: the router-arranged pull (its tokens equal the unpulled
run's), and the member's own pull with a ticket made out to it."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.kv_transfer import PrefixPullRequest
from pdcluster.core.kv_transfer import encode as encode_kv
from pdcluster.core.node_wire import GenerateRequest, PrefixSource, SamplingSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.node.client import BlockingNodeClient, tokens_of
from pdcluster.node.config import NodeConfig
from pdcluster.node.runtime import NodeRuntime, registered_peers
from pdcluster.transfer.side_channel import SideChannelServer
from tests.cluster_secret import TEST_SECRET, node_token
from tests.identity import node_keys, registered_signer
from tests.models import random_prompts
from tests.security.served import Memory, block_nbytes, dealer

pytestmark = pytest.mark.timeout(300)
BLOCK = 8
NUM_BLOCKS = 4
GREEDY = SamplingSpec(max_tokens=6, temperature=0.0, ignore_eos=True)


class _Inbox:
    """Member m0's side channel: where holders send its XferDone."""

    def __init__(self, keys: CurveKeys, directory) -> None:
        self.messages: list = []
        self._server = SideChannelServer(self.messages.append, curve=keys, directory=directory)
        self.address = self._server.address

    def wait(self, timeout_s: float = 10.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.messages:
            time.sleep(0.01)
        messages, self.messages[:] = list(self.messages), []
        return messages

    def close(self) -> None:
        self._server.close()


@pytest.fixture(scope="module")
def plane(model_dirs):
    from pdcluster.core.credentials import SERVICE
    from pdcluster.core.identity import Directory
    from pdcluster.metadata_service.server import ServerThread
    from tests.metadata_service.helpers import make_config

    model = model_dirs["llama-gqa"]
    engine = EngineConfig(model, num_kv_blocks=64, block_size=BLOCK)
    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as service:
        nodes = {node_id: NodeRuntime(NodeConfig(
            node_id=node_id, role="prefill", engine=engine, metadata_address=service.address,
            bootstrap_token=node_token(node_id), kv_timeout_s=10.0)).start()
            for node_id in ("h0", "p0")}
        keys, signer = registered_signer(service.address, TEST_SECRET)
        server_keys = node_keys(service.address, TEST_SECRET)
        clients = {node_id: BlockingNodeClient(node.server.address, curve=keys,
                                               server_key=server_keys[node_id])
                   for node_id, node in nodes.items()}
        reader = MetadataClient(service.address, token=TEST_SECRET.metadata_token(SERVICE))
        directory = Directory(refresh=lambda: registered_peers(reader), min_refresh_s=0.05)
        member_keys, memory = CurveKeys.generate(), Memory(NUM_BLOCKS * block_nbytes(model,
                                                                                    BLOCK))
        inbox = _Inbox(member_keys, directory)
        with MetadataClient(service.address, token=node_token("m0")) as m0:
            m0.register(make_node_info("m0", "decode", kv_address=inbox.address,
                                       kv_session=memory.engine.session_id,
                                       curve_public_key=member_keys.public), 300)
        for node in nodes.values():  # every directory of this process knows m0 from here on
            node.directory.refresh_now(force=True)
        try:
            yield SimpleNamespace(nodes=nodes, clients=clients, signer=signer, model=model,
                                  server_keys=server_keys, member_keys=member_keys,
                                  memory=memory, inbox=inbox,
                                  nbytes=block_nbytes(model, BLOCK))
        finally:
            for client in clients.values():
                client.close()
            inbox.close()
            memory.close()
            reader.close()
            for node in nodes.values():
                node.stop(drain=False)


def _counters(node: NodeRuntime) -> dict:
    return node.server.call(lambda engine: engine.transfer_counters())


def _generate(client: BlockingNodeClient, request_id: str, prompt: list[int],
              source: PrefixSource | None = None) -> list[int]:
    client.send(GenerateRequest(request_id, prompt, GREEDY, prefix_source=source))
    return tokens_of(client.collect({request_id})[request_id])


def _hold(plane, prompt: list[int]) -> None:
    """h0 computes `prompt`: its blocks are in h0's prefix cache."""
    _generate(plane.clients["h0"], f"hold-{secrets.token_hex(3)}", prompt)


def _member_pull(plane, holder: str, prompt: list[int], ticket=None, salt=None):
    """m0's own PrefixPullRequest for the first NUM_BLOCKS blocks of `prompt`, straight to
    `holder`'s side channel: (its XferDone, whether any byte landed in m0's memory)."""
    plane.memory.buf[:] = 0
    sock = dealer(plane.nodes[holder].kv_address, plane.member_keys,
                  plane.server_keys[holder])
    nbytes = plane.nbytes
    sock.send(encode_kv(PrefixPullRequest(
        f"pull-{secrets.token_hex(4)}", "r", plane.inbox.address,
        plane.memory.engine.session_id, nbytes, BLOCK, 0, prompt[:NUM_BLOCKS * BLOCK],
        [plane.memory.addr(i * nbytes) for i in range(NUM_BLOCKS)], cache_salt=salt,
        ticket=ticket)))
    (done,) = plane.inbox.wait()
    sock.close()
    return done, plane.memory.touched


def _ticket(plane, prompt: list[int], puller: str = "m0", holder: str = "h0", **kw):
    return plane.signer.sign("r", puller, holder, prompt, BLOCK, NUM_BLOCKS, kw.pop("salt", None),
                             **kw)


def test_a_member_cannot_start_its_own_pull_and_the_routers_pull_still_works(
        plane, hf_reference):
    prompt = random_prompts(1, 6 * BLOCK, 6 * BLOCK, seed=91)[0]
    _hold(plane, prompt)
    h0 = plane.nodes["h0"]
    before = _counters(h0)
    # the attack: m0 asks h0 for the prompt's blocks without a ticket
    done, touched = _member_pull(plane, "h0", prompt)
    assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False)
    after = _counters(h0)
    assert after["pull_requests_refused"] - before["pull_requests_refused"] == 1
    assert after["blocks_served"] == before["blocks_served"]
    # the control: the router arranges p0's pull with its ticket; the tokens equal the
    # unpulled run's, and the blocks came from h0
    pulled_before = _counters(plane.nodes["p0"])["blocks_pulled"]
    source = PrefixSource(h0.kv_address, NUM_BLOCKS,
                          plane.signer.sign("pulled", "p0", "h0", prompt, BLOCK, NUM_BLOCKS,
                                            None))
    got = _generate(plane.clients["p0"], "pulled", prompt, source)
    assert _counters(plane.nodes["p0"])["blocks_pulled"] - pulled_before == NUM_BLOCKS
    assert got == hf_reference(plane.model, prompt, GREEDY.max_tokens)
    # and the same pull, made out to m0, is served to m0: the ticket is what decides
    done, touched = _member_pull(plane, "h0", prompt, _ticket(plane, prompt))
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)


def test_a_ticket_for_another_chain_puller_or_holder_is_refused(plane):
    prompt, other = random_prompts(2, 6 * BLOCK, 6 * BLOCK, seed=92)
    for held in (prompt, other):
        _hold(plane, held)
        _generate(plane.clients["p0"], f"p0-holds-{secrets.token_hex(3)}", held)
    ticket = _ticket(plane, prompt)
    replays = {
        "another chain": ("h0", other, ticket),
        "another salt": ("h0", prompt, ticket, "tenant-x"),
        "another holder": ("p0", prompt, ticket),
        "made out to p0": ("h0", prompt, _ticket(plane, prompt, puller="p0")),
        "a forged signature": ("h0", prompt, replace(ticket, signature=bytes(64))),
        "a longer chain claimed": ("h0", prompt, replace(ticket, num_blocks=NUM_BLOCKS + 1)),
    }
    for name, (holder, tokens, bad, *salt) in replays.items():
        done, touched = _member_pull(plane, holder, tokens, bad, *salt)
        assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False), name
    done, touched = _member_pull(plane, "h0", prompt, ticket)  # as made out: served
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)


def test_an_expired_ticket_is_refused(plane):
    prompt = random_prompts(1, 6 * BLOCK, 6 * BLOCK, seed=93)[0]
    _hold(plane, prompt)
    expired = _ticket(plane, prompt, now=time.time() - plane.signer.ttl_s - 60)
    done, touched = _member_pull(plane, "h0", prompt, expired)
    assert (done.ok, done.num_blocks_sent, touched) == (False, 0, False)
    fresh = _ticket(plane, prompt)
    done, touched = _member_pull(plane, "h0", prompt, fresh)
    assert (done.ok, done.num_blocks_sent, touched) == (True, NUM_BLOCKS, True)
