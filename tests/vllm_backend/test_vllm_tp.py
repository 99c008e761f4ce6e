"""vLLM nodes of different tensor-parallel sizes (vLLM's CPU build, TP over gloo in worker
processes, pdcluster's connector in every rank): a prompt prefilled by a node at TP=2 and
decoded by one at TP=1, and the other way round, gives exactly transformers' greedy tokens;
so does a prompt whose prefix a node pulls from a holder of the other TP size.
Each rank's KV heads move rank to rank over Mooncake (TCP on 127.0.0.1) as the head map plans
(transfer/head_map.py), after one side-channel handshake per request with rank 0; vLLM's
KV events (one stream per engine, from its scheduler, whatever its TP) reach the index."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from pdcluster.core.hashing import hash_block_tokens  # noqa: E402
from pdcluster.core.node_wire import (  # noqa: E402
    GenerateRequest,
    PrefixSource,
    SamplingSpec,
    TokenDelta,
    TransferSpec,
)
from pdcluster.node.client import tokens_of  # noqa: E402
from tests.models import random_prompts  # noqa: E402
from tests.vllm_backend.test_vllm_nodes import BLOCK, Pair, metadata  # noqa: E402, F401

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
# A receive waits for the prefill too: at TP=2 three vLLM processes share the 2 cores with
# the other node's, and on a loaded machine a prefill took longer than the other vLLM tests'
# 6 s (seen: the first transfer timed out, then recomputed).
KV_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pair(model_dirs, metadata):  # noqa: F811
    pair = Pair(model_dirs["llama-vllm"], metadata[0].address, tp=(2, 1),
                kv_timeout_s=KV_TIMEOUT_S)
    # each engine's first step (one-time set-up) before any transfer waits on it
    for rid, client in (("warm-p", pair.to_p), ("warm-d", pair.to_d)):
        client.send(GenerateRequest(rid, list(range(5, 45)), SamplingSpec(max_tokens=2)))
        client.collect({rid})
    yield pair
    pair.close()


def _disaggregated(pair: Pair, rid: str, prompt: list[int], prefill: str, decode: str
                   ) -> list[int]:
    """`prefill` node computes the prompt's KV, `decode` node receives it and decodes."""
    to = {"p0": pair.to_p, "d0": pair.to_d}
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    source = pair.nodes[prefill].kv_address
    to[decode].send(GenerateRequest(f"{rid}-d", prompt, spec,
                                    TransferSpec("remote_prefill", rid, source)))
    to[prefill].send(GenerateRequest(f"{rid}-p", prompt, SamplingSpec(
        max_tokens=1, temperature=0.0), TransferSpec("remote_decode", rid)))
    to[prefill].collect({f"{rid}-p"})
    got = to[decode].collect({f"{rid}-d"})[f"{rid}-d"]
    assert all(isinstance(m, TokenDelta) for m in got), got
    return tokens_of(got)


@pytest.mark.parametrize(("prefill", "decode"), [("p0", "d0"), ("d0", "p0")],
                         ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_kv_moved_between_tp_sizes_gives_transformers_tokens(pair, hf_reference, model_dirs,
                                                             prefill, decode) -> None:
    receiver = pair.nodes[decode].engine
    before = receiver.transfer_counters()
    prompts = random_prompts(2, BLOCK + 1, 3 * BLOCK + 9, seed=5 + (prefill == "d0"))
    for i, prompt in enumerate(prompts):
        got = _disaggregated(pair, f"{prefill}{i}", prompt, prefill, decode)
        assert got == hf_reference(model_dirs["llama-vllm"], prompt, MAX_TOKENS), i
    time.sleep(1.0)  # the workers' counters reach the nodes with vLLM's next stats
    after = receiver.transfer_counters()
    assert after["recvs_failed"] == before.get("recvs_failed", 0)
    # rank 0 reports each block once for its whole group
    assert after["blocks_received"] - before.get("blocks_received", 0) == \
        sum(-(-len(p) // BLOCK) for p in prompts)
    pair.assert_idle()


def test_a_tp2_nodes_kv_events_reach_the_index(pair, metadata) -> None:  # noqa: F811
    _, client = metadata
    prompt = random_prompts(1, 2 * BLOCK + 3, 2 * BLOCK + 3, seed=13)[0]
    _disaggregated(pair, "ev", prompt, "p0", "d0")
    chain = hash_block_tokens(prompt, BLOCK, config=pair.p.engine.hash_config)
    deadline = time.monotonic() + 10
    while dict(client.query(chain)) != {"p0": 2, "d0": 2}:
        assert time.monotonic() < deadline, dict(client.query(chain))
        time.sleep(0.05)


@pytest.mark.parametrize(("holder", "puller"), [("p0", "d0"), ("d0", "p0")],
                         ids=["from-tp2", "from-tp1"])
def test_a_prefix_pulled_between_tp_sizes_gives_transformers_tokens(
        pair, hf_reference, model_dirs, holder, puller) -> None:
    to = {"p0": pair.to_p, "d0": pair.to_d}
    prompt = random_prompts(1, 3 * BLOCK + 7, 3 * BLOCK + 7, seed=17 + (holder == "d0"))[0]
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    to[holder].send(GenerateRequest(f"hold-{holder}", prompt, spec))
    to[holder].collect({f"hold-{holder}"})
    receiver = pair.nodes[puller].engine
    pulled = receiver.transfer_counters().get("blocks_pulled", 0)
    rid = f"pull-{puller}"
    ticket = pair.tickets.sign(rid, puller, holder, prompt, BLOCK, 3, None)
    to[puller].send(GenerateRequest(rid, prompt, spec, prefix_source=PrefixSource(
        pair.nodes[holder].kv_address, 3, ticket)))
    got = tokens_of(to[puller].collect({rid})[rid])
    assert got == hf_reference(model_dirs["llama-vllm"], prompt, MAX_TOKENS)
    time.sleep(1.0)  # the workers' counters reach the nodes with vLLM's next stats
    assert receiver.transfer_counters().get("blocks_pulled", 0) - pulled == 3
    pair.assert_idle()


def test_generate_with_vllm_at_tp2_gives_transformers_tokens(model_dirs, hf_reference,
                                                             tmp_path) -> None:
    """`pdcluster generate --engine vllm --tensor-parallel-size 2`: vLLM's own TP (two worker
    processes, gloo), from a folder outside the checkout."""
    model = model_dirs["llama-vllm"]
    prompt = random_prompts(1, 2 * BLOCK + 5, 2 * BLOCK + 5, seed=31)[0]
    pdcluster = Path(sys.executable).with_name("pdcluster")
    proc = subprocess.run(
        [str(pdcluster), "generate", "--engine", "vllm", "--model", model,
         "--tensor-parallel-size", "2", "--prompt-ids", ",".join(map(str, prompt)),
         "--max-tokens", str(MAX_TOKENS), "--dtype", "float32"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout.split("output: ", 1)[1].rstrip("\n")
    expected = AutoTokenizer.from_pretrained(model).decode(
        hf_reference(model, prompt, MAX_TOKENS), skip_special_tokens=True)
    assert expected and output == expected
