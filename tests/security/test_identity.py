"""Attacks by a compromised member on a real `pdcluster serve` (router, metadata service, node
actors on a local Ray, Mooncake over TCP): a pod holding only a decode node's credentials —
its bootstrap token (node/d9), its own key pair registered under d9 — and what a router's
credential allows. Each attack is paired with its member control: the same move by the
principal it belongs to is served. On a cluster where every member holds the one secret and
one shared key pair, every attack below succeeds."""

from __future__ import annotations

import time

import grpc
import pytest

from pdcluster.core.credentials import SERVICE, CurveKeys, node_principal
from pdcluster.core.kv_transfer import XferDone, XferRequest
from pdcluster.core.kv_transfer import encode as encode_kv
from pdcluster.core.node_wire import (
    AbortRequest,
    GenerateRequest,
    RequestError,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.core.node_wire import encode as encode_node
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError
from tests.security.conftest import own_engine_only
from tests.security.served import (
    BLOCK_SIZE,
    Memory,
    block_nbytes,
    dealer,
    router_member,
    server_key,
)
from tests.security.test_zmq_attacks import PROMPT, _answer, _member_node

# 900 s: the first test on each engine's cluster waits for it to start (vLLM's: minutes)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LONG = SamplingSpec(max_tokens=200, temperature=0.0, ignore_eos=True)
# the XferDone test leaves D caching blocks nobody wrote (the node asked is trusted for the
# KV it sends: docs/security.md's residual risks): a prompt of its own
OTHER_PROMPT = list(range(300, 300 + 4 * BLOCK_SIZE))


def _client(served, token: str) -> MetadataClient:
    return MetadataClient(served.metadata_address, token=token)


def _collect(sock, request_id: str, timeout_s: float = 60) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = _answer(sock, 5)
        if msg is None or msg.request_id != request_id:
            continue
        got.append(msg)
        if isinstance(msg, RequestError) or msg.finished:
            return got
    raise AssertionError(f"{request_id} did not finish: {got}")


def test_a_decode_nodes_credential_cannot_register_another_node(served):
    d9 = _client(served, served.secret.metadata_token(node_principal("d9")))
    attacker = "tcp://127.0.0.1:6666"
    info = make_node_info("p0", "prefill", request_address=attacker, kv_address=attacker,
                          curve_public_key=CurveKeys.generate().public)
    with pytest.raises(MetadataAuthError, match="may not act as node 'p0'"):
        d9.register(info, 30)
    own = make_node_info("d9", "decode", request_address=attacker, kv_address=attacker,
                         curve_public_key=CurveKeys.generate().public)
    proof = d9.register(own, 30).registration_secret
    assert proof  # member control: its own id
    d9.deregister("d9", proof)
    d9.close()
    with _client(served, served.secret.metadata_token(SERVICE)) as reader:
        assert reader.list_nodes("prefill")[0].request_address != attacker


def test_not_even_p0s_own_credential_takes_over_the_live_p0(served):
    """A stolen bootstrap token (or the secret itself) cannot re-register a live node at a
    new address or key: that needs its registration's proof, or an operator's release."""
    token = served.secret.metadata_token(node_principal("p0"))
    live = next(n for n in _client(served, token).list_nodes() if n.node_id == "p0")
    hijack = make_node_info("p0", "prefill", request_address="tcp://127.0.0.1:6666",
                            kv_address="tcp://127.0.0.1:6667", epoch=live.epoch,
                            curve_public_key=CurveKeys.generate().public)
    with _client(served, token) as client, pytest.raises(MetadataAuthError,
                                                          match="needs that registration's"):
        client.register(hijack, 30)
    with _client(served, token) as client:  # the unchanged registration refreshes fine
        assert client.register(live, 30).lease_ttl_s > 0
        assert [n.request_address for n in client.list_nodes() if n.node_id == "p0"] == [
            live.request_address]


def test_the_routers_credential_cannot_register_a_node(served):
    keys = CurveKeys.generate()
    info = make_node_info("d7", "decode", request_address="tcp://127.0.0.1:6666",
                          curve_public_key=keys.public)
    with _client(served, served.secret.metadata_token(SERVICE)) as router, \
            pytest.raises(MetadataAuthError) as refused:
        router.register(info, 30)
    assert refused.value.status == grpc.StatusCode.PERMISSION_DENIED.name


def test_a_decode_node_cannot_send_a_generate_request_to_a_prefill_node(served):
    memory = Memory(block_nbytes(served.model_dir, served.block_size))
    keys, inbox = _member_node(served, memory)  # a registered decode node
    try:
        attacker = dealer(served.nodes["prefill"]["request_address"], keys,
                          server_key(served, "prefill"))
        attacker.send(encode_node(GenerateRequest("from-d9", PROMPT, SamplingSpec(max_tokens=2))))
        reply = _answer(attacker, 10)
        assert isinstance(reply, RequestError) and reply.code == "forbidden", reply
        attacker.close()
        router = dealer(served.nodes["prefill"]["request_address"], router_member(served),
                        server_key(served, "prefill"))
        router.send(encode_node(GenerateRequest("from-router", PROMPT,
                                                SamplingSpec(max_tokens=2))))
        assert isinstance(_answer(router, 30), TokenDelta)  # member control: a router
        router.close()
    finally:
        inbox.close()
        memory.close()


def test_only_the_submitter_aborts_a_request(served):
    address, key = served.nodes["decode"]["request_address"], server_key(served, "decode")
    owner = dealer(address, router_member(served), key)
    other_router = dealer(address, router_member(served), key)
    memory = Memory(block_nbytes(served.model_dir, served.block_size))
    d9_keys, inbox = _member_node(served, memory)
    d9 = dealer(address, d9_keys, key)
    try:
        owner.send(encode_node(GenerateRequest("victim", PROMPT, LONG)))
        assert isinstance(_answer(owner, 30), TokenDelta)  # running
        d9.send(encode_node(AbortRequest("victim")))
        other_router.send(encode_node(AbortRequest("victim")))
        got = _collect(owner, "victim")
        assert got[-1].finish_reason == "length"  # neither abort touched it
        assert sum(len(m.token_ids) for m in got) + 1 >= LONG.max_tokens
        owner.send(encode_node(GenerateRequest("mine", PROMPT, LONG)))
        assert isinstance(_answer(owner, 30), TokenDelta)
        owner.send(encode_node(AbortRequest("mine")))  # member control: the submitter
        streamed = 0
        while (msg := _answer(owner, 2)) is not None:
            assert not getattr(msg, "finished", False)
            streamed += len(msg.token_ids)
        assert streamed < LONG.max_tokens - 1  # aborted: its stream stopped early
    finally:
        for sock in (owner, other_router, d9):
            sock.close()
        inbox.close()
        memory.close()


@own_engine_only
def test_a_member_cannot_make_a_prefill_node_write_elsewhere(served):
    """d9 asks P for a prompt's KV but names a third party's memory as the destination (a
    confused deputy): refused, the third party untouched. The same request naming d9's own
    registered session is served."""
    nbytes = block_nbytes(served.model_dir, served.block_size)
    prefill = served.nodes["prefill"]
    router = dealer(prefill["request_address"], router_member(served),
                    server_key(served, "prefill"))
    own, third = Memory(4 * nbytes), Memory(4 * nbytes)
    keys, inbox = _member_node(served, own)
    sock = dealer(prefill["kv_address"], keys, server_key(served, "prefill"))
    try:
        for tid, memory in (("to-third", third), ("to-own", own)):
            router.send(encode_node(GenerateRequest(
                f"p-{tid}", PROMPT, SamplingSpec(max_tokens=1),
                TransferSpec("remote_decode", tid))))
            sock.send(encode_kv(XferRequest(tid, "r", inbox.address, memory.engine.session_id,
                                            nbytes, 4, 0,
                                            [memory.addr(i * nbytes) for i in range(4)])))
        got = inbox.wait(15)
        assert [m.transfer_id for m in got if isinstance(m, XferDone) and m.ok] == ["to-own"]
        assert own.touched and not third.touched
    finally:
        for closer in (router, sock, inbox, own, third):
            closer.close()


@own_engine_only
def test_xfer_done_is_accepted_only_from_the_node_asked(served):
    """D waits for KV from the node its request names. A forged XferDone from another
    member is refused (the request gets no first token); the node asked completes it."""
    nbytes = block_nbytes(served.model_dir, served.block_size)
    memory = Memory(4 * nbytes)
    asked_keys, asked = _member_node(served, memory)  # the node D is told to take KV from
    forger_memory = Memory(nbytes)
    forger_keys, forger_inbox = _member_node(served, forger_memory)
    decode_kv = served.nodes["decode"]["kv_address"]
    router = dealer(served.nodes["decode"]["request_address"], router_member(served),
                    server_key(served, "decode"))
    forger = dealer(decode_kv, forger_keys, server_key(served, "decode"))
    rightful = dealer(decode_kv, asked_keys, server_key(served, "decode"))
    try:
        router.send(encode_node(GenerateRequest(
            "waits", OTHER_PROMPT, SamplingSpec(max_tokens=2, temperature=0.0, ignore_eos=True),
            TransferSpec("remote_prefill", "t-asked", asked.address))))
        asked.wait(10)  # D's XferRequest reached the node asked
        forger.send(encode_kv(XferDone("t-asked", True, first_token=7, num_blocks_sent=4)))
        assert _answer(router, 3) is None  # refused: no first token
        rightful.send(encode_kv(XferDone("t-asked", True, first_token=7, num_blocks_sent=4)))
        reply = _answer(router, 10)  # member control: the node asked completes it
        assert isinstance(reply, TokenDelta) and reply.token_ids[0] == 7, reply
    finally:
        for closer in (router, forger, rightful, asked, forger_inbox, memory, forger_memory):
            closer.close()

