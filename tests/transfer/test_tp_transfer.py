"""KV transfers between tensor-parallel groups of different sizes, over real Mooncake (TCP on
127.0.0.1) and the CURVE side channel: a prefill engine (or a prefix holder) in a child
process, the other engine here, each rank of each group in a process of its own with its own
transfer engine. The tiny Llama has 2 KV heads: at TP=2 one per rank, at TP=4 each held by two
ranks (replicated); DeepSeek-V2's MLA latent is one "head" every rank holds. Checked: greedy
tokens equal transformers', every copy of every KV head of every block moved is byte-identical
to the sender's, each destination rank got its share from the sender's ranks, and no block is
left held. A sender rank killed mid-transfer fails
the transfer: the decode side recomputes, and the sender's engine is lost.

Kept small (2 cores): every engine of TP=N starts N-1 processes that import torch."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.kv_transfer import PrefixPull, RemotePrefill
from pdcluster.engine import SamplingParams
from pdcluster.transfer.transport import MooncakeTransport
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import drive, idle, make_engine
from tests.transfer.node_process import NodeProcess
from tests.transfer.tp_helpers import head_copies

N_OUT = 6
_ids = itertools.count()
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)


def _local(model: str, tp: int, **options):
    return make_engine(model, MooncakeTransport(curve=TEST_CURVE), device="cpu",
                       dtype="float32", tensor_parallel_size=tp, **options)


def _disagg(prefill: NodeProcess, decode, prompt: list[int]):
    n = next(_ids)
    decode.add_request(f"r{n}", prompt, GREEDY,
                       kv_transfer=RemotePrefill(f"t{n}", prefill.address))
    prefill.send("add", f"p{n}", prompt, 1, "decode", f"t{n}", None)
    final = drive([decode], lambda: idle(decode), timeout_s=60)
    drive([], lambda: prefill.call("idle"), timeout_s=30)  # P released its pinned blocks
    return final[f"r{n}"]


def _assert_same_heads(sender: list[dict | None], receiver, prompt: list[int],
                       num_blocks: int) -> None:
    """Every copy of every head of the first `num_blocks` blocks on the receiver equals the
    sender's copy of that head."""
    hashes = hash_block_tokens(prompt, receiver.config.block_size)[:num_blocks]
    for h, theirs in zip(hashes, sender, strict=False):
        block = receiver.block_pool.get_cached_block(h)
        assert theirs is not None and block is not None
        ours = head_copies(receiver, block.block_id)
        assert ours.keys() == theirs.keys()
        for head, copies in ours.items():
            assert all(copy == theirs[head][0] for copy in copies), f"head {head} differs"
    assert any(any(c[0]) for c in sender[0].values()), "KV should not be all zeros"


@pytest.mark.parametrize(("variant", "p_tp", "d_tp"), [
    ("llama-gqa", 2, 1), ("llama-gqa", 1, 2), ("llama-gqa", 4, 2),
    ("deepseek-v2-qlora-grouped", 1, 2),  # MLA: one copy of the latent per destination rank
])
def test_prefill_and_decode_of_different_tp(variant, p_tp, d_tp, model_dirs, hf_reference):
    model = model_dirs[variant]
    prefill = NodeProcess(model, timeout_s=20.0, device="cpu", dtype="float32",
                          tensor_parallel_size=p_tp)
    decode = _local(model, d_tp, timeout_s=20.0)
    try:
        prompt = random_prompts(1, 40, 40, seed=60 + p_tp)[0]
        out = _disagg(prefill, decode, prompt)
        assert out.token_ids == hf_reference(model, prompt, N_OUT)
        stats = decode.connector.worker.stats
        assert stats.recvs_ok == 1 and stats.recvs_failed == 0
        blocks = len(prompt) // decode.config.block_size
        _assert_same_heads(prefill.call("head_copies", prompt), decode, prompt, blocks)
        # each (source rank, destination rank, block) overlap one descriptor; the same
        # split on both sides (one rank to one rank) merges consecutive blocks
        sent = prefill.call("stats")
        assert sent["descriptors_sent"] <= blocks * max(p_tp, d_tp)
        assert sent["bytes_sent"] == stats.bytes_received
        assert prefill.call("leaks") is None
        assert_pool_clean(decode.block_pool)
    finally:
        decode.close()
        prefill.stop()


def _pull_four_blocks(holder: NodeProcess, requester, prompt: list[int],
                      held: list[dict | None], expected: list[int]) -> None:
    """The requester pulls the prompt's first 4 blocks from the holder: its tokens are
    `expected`, its heads equal the holder's copies `held`, and neither side leaks a block."""
    requester.add_request("r", prompt, GREEDY, prefix_pull=PrefixPull(holder.address, 4))
    final = drive([requester], lambda: idle(requester), timeout_s=60)
    assert final["r"].token_ids == expected
    assert requester.connector.worker.stats.blocks_pulled == 4
    assert final["r"].num_cached_tokens == 32
    _assert_same_heads(held, requester, prompt, 4)
    drive([], lambda: holder.call("idle"), timeout_s=30)
    assert holder.call("leaks") is None
    assert_pool_clean(requester.block_pool)


def test_a_prefix_pull_from_a_holder_of_other_tp(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    holder = NodeProcess(model, timeout_s=20.0, device="cpu", dtype="float32",
                         tensor_parallel_size=2)
    requester = _local(model, 1, timeout_s=20.0)
    try:
        shared = random_prompts(1, 32, 32, seed=70)[0]
        holder.send("add", "warm", shared + [5, 6, 7], 1, None, None, None)
        holder.wait_for("warm")
        prompt = shared + random_prompts(1, 9, 9, seed=71)[0]
        _pull_four_blocks(holder, requester, prompt, holder.call("head_copies", prompt),
                          hf_reference(model, prompt, N_OUT))
    finally:
        requester.close()
        holder.stop()


@pytest.mark.parametrize(("evict_tokens", "media"), [
    (72, ["host"] * 4),  # all 9 device blocks taken: every shared block demoted
    (64, ["device", "host", "host", "host"]),  # 8 taken: one pull from both tiers
])
def test_a_prefix_pull_served_from_the_host_tier_of_a_tp2_holder(evict_tokens, media,
                                                                  model_dirs, hf_reference):
    """The holder's blocks were demoted to its host tier (each rank's slice in its own host
    tier, registered with its own transfer engine): each rank writes its slice from there."""
    model = model_dirs["llama-gqa"]
    holder = NodeProcess(model, timeout_s=20.0, device="cpu", dtype="float32",
                         tensor_parallel_size=2, num_kv_blocks=9, num_host_blocks=16)
    requester = _local(model, 1, timeout_s=20.0)
    try:
        shared = random_prompts(1, 32, 32, seed=72)[0]
        holder.send("add", "warm", shared + [5, 6, 7], 1, None, None, None)
        holder.wait_for("warm")
        held = holder.call("head_copies", shared)
        evict = random_prompts(1, evict_tokens, evict_tokens, seed=73)[0]
        holder.send("add", "evict", evict, 1, None, None, None)
        holder.wait_for("evict")
        assert holder.call("media", shared) == media
        prompt = shared + random_prompts(1, 9, 9, seed=74)[0]
        _pull_four_blocks(holder, requester, prompt, held, hf_reference(model, prompt, N_OUT))
    finally:
        requester.close()
        holder.stop()


def test_a_rank_killed_mid_transfer_the_decode_side_recomputes(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    prefill = NodeProcess(model, timeout_s=20.0, device="cpu", dtype="float32",
                          tensor_parallel_size=2,
                          rank_agent="tests.transfer.tp_helpers:DyingRankAgent")
    decode = _local(model, 1, timeout_s=20.0)
    try:
        prompt = random_prompts(1, 30, 30, seed=72)[0]
        started = time.monotonic()
        decode.add_request("r", prompt, GREEDY, kv_transfer=RemotePrefill("t-dies",
                                                                          prefill.address))
        prefill.send("add", "p", prompt, 1, "decode", "t-dies", None)
        final = drive([decode], lambda: idle(decode), timeout_s=60)
        assert final["r"].token_ids == hf_reference(model, prompt, N_OUT)
        stats = decode.connector.worker.stats
        assert stats.recvs_failed == 1 and stats.timeouts == 0  # told at once, not timed out
        assert time.monotonic() - started < 20
        assert_pool_clean(decode.block_pool)
        # the prefill engine is lost: its next step raises, and its process ends
        prefill.process.join(30)
        assert prefill.process.exitcode not in (None, 0)
    finally:
        decode.close()
        prefill.kill()


def test_bench_tp_transfer_prices_each_heterogeneous_move_against_a_same_tp_move():
    done = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "bench",
                           "tp-transfer", "--quick", "--json"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["all_transferred"] is True
    assert result["p2_to_d1_over_p2_to_d2"] > 0 and result["p1_to_d2_over_p1_to_d1"] > 0
    blocks = result["tokens_per_request"] // 16
    # a descriptor per (source rank, destination rank, block) overlap, at most
    assert result["p2_to_d1_descriptors"] == result["p1_to_d2_descriptors"] == 2 * blocks


def test_a_connector_that_cannot_span_ranks_is_refused_before_any_rank_starts(model_dirs):
    from tests.transfer.loopback import LoopbackFabric, LoopbackTransport

    transport = LoopbackTransport(LoopbackFabric(), "loop://a", "session-a")
    with pytest.raises(ValueError, match="cannot span tensor-parallel ranks"):
        make_engine(model_dirs["llama-gqa"], transport, tensor_parallel_size=2)
