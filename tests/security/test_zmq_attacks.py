"""Attacks on a real `pdcluster serve` (tiny model, secret and API keys set) from a peer on the
same network without the cluster's credentials, over the node request sockets and the KV side
channel (ZMQ), with the real router, Mooncake over TCP and node actors on a local Ray.

Each attack is paired with the same move made by a cluster member (holding the secret), so a
test shows the move would work, and that credentials are what stops it. These tests fail on a
cluster without CURVE: there, every stranger's message is served."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import openai
import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.kv_transfer import PrefixPullRequest, XferDone, XferRequest
from pdcluster.core.kv_transfer import encode as encode_kv
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TokenDelta, TransferSpec, decode
from pdcluster.core.node_wire import encode as encode_node
from tests.identity import registered_signer
from tests.security.conftest import own_engine_only
from tests.security.served import (
    API_KEY,
    Memory,
    block_nbytes,
    dealer,
    key_directory,
    node_member,
    node_member_leave,
    router_member,
    send_unless_refused,
    server_key,
)

# 900 s: the first test on each engine's cluster waits for it to start (vLLM's: minutes)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PROMPT = list(range(100, 228))  # 4 full blocks of vLLM's 32 tokens (8 of the own engine's 16)
QUIET_S = 2.0  # how long a refused stranger waits for an answer that never comes


def _member_node(served, memory, inbox_keys=None, with_id=False):
    """A registered decode node (its own key, its inbox's address, `memory`'s session): a
    cluster member's side channel. Returns (keys, inbox), and its node id `with_id`;
    closing the inbox deregisters the node (a later member may get the same transfer-engine
    port, and live registrations may not share a session)."""
    keys = inbox_keys or CurveKeys.generate()
    inbox = _Inbox(keys, key_directory(served))
    node_id = f"m-{secrets.token_hex(3)}"
    proof = node_member(served, node_id, inbox.address, memory.engine.session_id, keys)
    inbox.leave = lambda: node_member_leave(served, node_id, proof)
    return (keys, inbox, node_id) if with_id else (keys, inbox)


def _generate(request_id: str, **kw) -> bytes:
    return encode_node(GenerateRequest(request_id, PROMPT, SamplingSpec(max_tokens=4), **kw))


def _answer(sock, timeout_s: float = QUIET_S):
    return decode(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None


def _routed_text(served, prompt: str = "The capital of France is") -> str:
    client = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0,
                           timeout=60)
    out = client.completions.create(model=_model(served), prompt=prompt, max_tokens=8,
                                    temperature=0)
    return out.choices[0].text


def _model(served) -> str:
    from pathlib import Path

    return Path(served.model_dir).name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stranger_cannot_generate_on_a_node(served, role):
    address = served.nodes[role]["request_address"]
    strangers = {
        "plaintext": dealer(address),
        "the shared key of the test mode": dealer(address, served.secret.curve_keys()),
        # knows the node's public key (keys are not secret) but its own key is registered
        # nowhere: the node's ZAP handler refuses it
        "right server key, own key pair": dealer(
            address, CurveKeys.generate(), server_key(served, role)),
    }
    for name, sock in strangers.items():
        send_unless_refused(sock, _generate(f"attack-{role}-{name}"))
    for name, sock in strangers.items():
        assert _answer(sock) is None, f"a stranger ({name}) was served by the {role} node"
        sock.close()
    member = dealer(address, router_member(served), server_key(served, role))
    member.send(_generate(f"member-{role}"))
    reply = _answer(member, 30)
    assert isinstance(reply, TokenDelta), reply  # the same message from a member is served
    member.close()


def test_router_api_keys_cannot_be_bypassed(served):
    client = openai.OpenAI(base_url=served.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=_model(served), prompt="hi", max_tokens=2)
    assert _routed_text(served)  # with the key it answers


def test_a_stranger_cannot_poison_a_decode_nodes_cache(served):
    """The attack: ask D to take a prompt's KV from the attacker (remote_prefill pointing at
    an attacker's side channel), then forge the transfer's completion. Refused at the
    handshake, so D never hands out its block addresses and the cache stays clean."""
    before = _routed_text(served)
    attacker_kv = dealer(served.nodes["decode"]["kv_address"])  # no credentials
    decode_node = dealer(served.nodes["decode"]["request_address"])
    spec = TransferSpec("remote_prefill", "forged-t1", "tcp://127.0.0.1:9")
    decode_node.send(_generate("poison", transfer=spec))
    for tid in ("forged-t1", "poison"):
        attacker_kv.send(encode_kv(XferDone(tid, True, first_token=5, num_blocks_sent=4)))
    assert _answer(decode_node) is None
    attacker_kv.close()
    decode_node.close()
    assert _routed_text(served) == before


def test_side_channel_refuses_strangers(served):
    """XferRequest and PrefixPullRequest to P's side channel from a stranger, asking it to
    write a cached prompt's KV into the stranger's memory: nothing is written."""
    _ask_side_channel_for_kv(served, member_control=False)


@own_engine_only
def test_side_channel_serves_a_registered_member(served):
    """The control of the probe above: the same requests from a registered member node get
    the bytes (into its own registered session)."""
    _ask_side_channel_for_kv(served, member_control=True)


def _ask_side_channel_for_kv(served, member_control: bool) -> None:
    prefill = served.nodes["prefill"]
    member = dealer(prefill["request_address"], router_member(served),
                    server_key(served, "prefill"))
    member.send(_generate("cache-it"))  # P now caches PROMPT's blocks
    while not getattr(_answer(member, 30), "finished", True):
        pass
    member.close()
    nbytes = block_nbytes(served.model_dir, served.block_size)
    memory = Memory(8 * nbytes)
    ticket = None
    if member_control:
        # the pull a router arranged for this member (core.pull_ticket); the router's key is
        # registered first, so the directory refresh of the member's handshake brings it
        _, signer = registered_signer(served.metadata_address, served.secret)
        keys, replies, member_id = _member_node(served, memory, with_id=True)
        sock = dealer(prefill["kv_address"], keys, server_key(served, "prefill"))
        ticket = signer.sign("r", member_id, prefill["node_id"], PROMPT, served.block_size, 4,
                             None)
    else:
        replies, sock = _Inbox(None), dealer(prefill["kv_address"])
    pull = PrefixPullRequest("pull-1", "r", replies.address, memory.engine.session_id, nbytes,
                             served.block_size, 0, PROMPT[:4 * served.block_size],
                             [memory.addr(i * nbytes) for i in range(4)], ticket=ticket)
    xfer = XferRequest("xfer-1", "r", replies.address, memory.engine.session_id, nbytes, 4, 0,
                       [memory.addr((4 + i) * nbytes) for i in range(4)])
    for frame in (encode_kv(pull), encode_kv(xfer)):
        assert send_unless_refused(sock, frame) or not member_control, "a member's send"
    got = replies.wait(10 if member_control else QUIET_S)
    sock.close()
    try:
        if member_control:
            assert any(isinstance(m, XferDone) and m.num_blocks_sent == 4 for m in got), got
            assert memory.touched
        else:
            assert got == [] and not memory.touched
    finally:
        replies.close()
        memory.close()


@own_engine_only
def test_a_member_cannot_pull_another_tenants_blocks(served):
    """Pulls honour the cache salt: the same tokens without the tenant's salt name other
    blocks, so even a cluster member gets none of a salted tenant's KV."""
    prefill = served.nodes["prefill"]
    member = dealer(prefill["request_address"], router_member(served),
                    server_key(served, "prefill"))
    salted = [t + 1000 for t in PROMPT]  # cached only under the tenant's salt
    member.send(encode_node(GenerateRequest("salted", salted, SamplingSpec(max_tokens=4),
                                            cache_salt="tenant-a")))
    while not getattr(_answer(member, 30), "finished", True):
        pass
    member.close()
    nbytes = block_nbytes(served.model_dir, served.block_size)
    results = {}
    _, signer = registered_signer(served.metadata_address, served.secret)
    for salt in (None, "tenant-b", "tenant-a"):
        memory = Memory(4 * nbytes)
        keys, replies, member_id = _member_node(served, memory, with_id=True)
        # a router's ticket for each pull (core.pull_ticket): here the salt alone decides
        ticket = signer.sign("r", member_id, prefill["node_id"], salted, served.block_size, 4,
                             salt)
        sock = dealer(prefill["kv_address"], keys, server_key(served, "prefill"))
        sock.send(encode_kv(PrefixPullRequest(
            f"pull-{salt}", "r", replies.address, memory.engine.session_id, nbytes,
            served.block_size, 0, salted[:4 * served.block_size],
            [memory.addr(i * nbytes) for i in range(4)],
            cache_salt=salt, ticket=ticket)))
        (done,) = replies.wait(10)
        results[salt] = (done.num_blocks_sent, memory.touched)
        sock.close()
        replies.close()
        memory.close()
    # the tenant itself (its salt) gets its blocks: the refusals above are the salt's doing
    assert results == {None: (0, False), "tenant-b": (0, False), "tenant-a": (4, True)}


class _Inbox:
    """A side-channel server receiving the node's replies (CURVE when given keys)."""

    def __init__(self, keys, directory=None) -> None:
        from pdcluster.transfer.side_channel import SideChannelServer

        self.messages: list = []
        self.leave: Callable[[], None] | None = None  # run at close
        self._directory = directory
        self._server = SideChannelServer(self.messages.append, curve=keys, directory=directory)
        self.address = self._server.address

    def wait(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.messages:
            time.sleep(0.01)
        time.sleep(0.1)  # anything else in flight
        return list(self.messages)

    def close(self) -> None:
        self._server.close()
        if self.leave is not None:
            self.leave()
        if self._directory is not None:
            from pdcluster.core.curve import forget_directory

            forget_directory(self._directory)
