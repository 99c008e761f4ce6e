"""Two processes, real Mooncake over TCP on 127.0.0.1, the ZMQ side channel: a prefill engine
in a child process and a decode engine here, connected only through `transfer/`."""

from __future__ import annotations

import itertools

import pytest

from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill
from pdcluster.engine import SamplingParams
from pdcluster.transfer.transport import MooncakeTransport
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import drive, idle, make_engine
from tests.transfer.node_process import NodeProcess

N_OUT = 8
_ids = itertools.count()


@pytest.fixture(scope="module")
def prefill_node(model_dirs):
    node = NodeProcess(model_dirs["llama-gqa"])
    yield node
    node.stop()


@pytest.fixture
def decode(model_dirs):
    engine = make_engine(model_dirs["llama-gqa"], MooncakeTransport(curve=TEST_CURVE))
    yield engine
    engine.close()


def disagg(prefill_node, decode, prompt):
    """One request through P (child) and D (here); returns D's tokens."""
    n = next(_ids)
    rid, tid = f"r{n}", f"t{n}"
    decode.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=N_OUT,
                                                   ignore_eos=True),
                       kv_transfer=RemotePrefill(tid, prefill_node.address))
    prefill_node.send("add", f"p{n}", prompt, 1, "decode", tid, None)
    final = drive([decode], lambda: idle(decode))
    drive([], lambda: prefill_node.call("idle"))  # P released its pinned blocks
    return final[rid]


def test_exact_tokens_with_and_without_prefix_hits(prefill_node, decode, model_dirs,
                                                   hf_reference):
    model = model_dirs["llama-gqa"]
    base = random_prompts(1, 48, 48, seed=40)[0]
    cases = {
        "no hits": base,
        "hits on both": base[:32] + random_prompts(1, 20, 20, seed=41)[0],
    }
    only_d = random_prompts(1, 40, 40, seed=42)[0]
    decode.add_request("warm-d", only_d, SamplingParams(max_tokens=1))
    drive([decode], lambda: idle(decode))
    cases["hit on D only"] = only_d + random_prompts(1, 9, 9, seed=43)[0]
    only_p = random_prompts(1, 40, 40, seed=44)[0]
    prefill_node.send("add", "warm-p", only_p, 1, None, None, None)
    prefill_node.wait_for("warm-p")
    cases["hit on P only"] = only_p + random_prompts(1, 9, 9, seed=45)[0]
    sent = []
    for name, prompt in cases.items():
        out = disagg(prefill_node, decode, prompt)
        assert out.token_ids == hf_reference(model, prompt, N_OUT), name
        sent.append(out.num_cached_tokens)
    assert sent == [0, 32, 40, 0]  # D's own prefix hit: fewer blocks come over the wire
    assert decode.connector.worker.stats.recvs_ok == 4
    assert_pool_clean(decode.block_pool)


def test_kv_arrives_byte_identical(prefill_node, decode):
    prompt = random_prompts(1, 64, 64, seed=46)[0]
    disagg(prefill_node, decode, prompt)
    theirs = prefill_node.call("block_bytes", prompt)
    for h, sent in zip(hash_block_tokens(prompt, 8), theirs, strict=True):
        block = decode.block_pool.get_cached_block(h)
        assert sent is not None and block is not None
        assert decode.kv_cache.block_bytes(block.block_id) == sent
    assert any(any(b) for b in theirs), "KV should not be all zeros"


def test_prefill_dies_mid_transfer_decode_recomputes(model_dirs, hf_reference):
    node = NodeProcess(model_dirs["llama-gqa"])
    decode = make_engine(model_dirs["llama-gqa"], MooncakeTransport(curve=TEST_CURVE),
                         timeout_s=2.0)
    try:
        prompt = random_prompts(1, 30, 30, seed=47)[0]
        decode.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=N_OUT,
                                                       ignore_eos=True),
                           kv_transfer=RemotePrefill("t-dead", node.address))
        decode.step()  # the request reaches P, which never prefills: it dies
        node.kill()
        final = drive([decode], lambda: idle(decode), timeout_s=20)
        assert final["r"].token_ids == hf_reference(model_dirs["llama-gqa"], prompt, N_OUT)
        assert decode.connector.worker.stats.recvs_failed == 1
        decode.add_request("after", prompt[:10], SamplingParams(max_tokens=2))
        assert "after" in drive([decode], lambda: idle(decode))
        assert_pool_clean(decode.block_pool)
    finally:
        decode.close()
        node.kill()


def test_decode_dies_prefill_releases_and_keeps_serving(model_dirs):
    node = NodeProcess(model_dirs["llama-gqa"])
    prefill = make_engine(model_dirs["llama-gqa"], MooncakeTransport(curve=TEST_CURVE),
                          timeout_s=2.0)
    try:
        prompt = random_prompts(1, 30, 30, seed=48)[0]
        node.send("add", "d", prompt, N_OUT, "prefill", "t-d", prefill.connector.worker
                  .transport.reply_address)
        worker = prefill.connector.worker
        drive([prefill], lambda: worker.num_pending_sends, timeout_s=30)  # D's request came
        node.kill()
        prefill.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1),
                            kv_transfer=RemoteDecode("t-d"))
        drive([prefill], lambda: idle(prefill), timeout_s=20)
        assert prefill.connector.worker.stats.sends_failed == 1
        prefill.add_request("after", prompt, SamplingParams(max_tokens=3))
        assert "after" in drive([prefill], lambda: idle(prefill))
        assert_pool_clean(prefill.block_pool)
    finally:
        prefill.close()
        node.kill()
