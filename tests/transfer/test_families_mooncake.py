"""Disaggregated prefill -> decode of a MoE model (Mixtral) and an MLA model (DeepSeek-V3:
latent KV blocks, sigmoid grouped routing, shared experts) over real Mooncake TCP and the ZMQ
side channel: P in a child process, D here. Exact tokens against transformers, the blocks that
arrive byte-identical to P's (MLA: latent + RoPE key per token, one plane), no leaks on
either side."""

from __future__ import annotations

import itertools

import pytest

from pdcluster.core.hashing import hash_block_tokens
from pdcluster.core.kv_transfer import RemotePrefill
from pdcluster.engine import SamplingParams
from pdcluster.transfer.transport import MooncakeTransport
from tests.cluster_secret import TEST_CURVE
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import drive, idle, make_engine
from tests.transfer.node_process import NodeProcess

N_OUT = 8
_ids = itertools.count()


def disagg(prefill_node, decode, prompt):
    n = next(_ids)
    rid, tid = f"fam-r{n}", f"fam-t{n}"
    decode.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=N_OUT,
                                                   ignore_eos=True),
                       kv_transfer=RemotePrefill(tid, prefill_node.address))
    prefill_node.send("add", f"fam-p{n}", prompt, 1, "decode", tid, None)
    final = drive([decode], lambda: idle(decode))
    drive([], lambda: prefill_node.call("idle"))  # P released its pinned blocks
    return final[rid]


def expected_block_nbytes(engine) -> int:
    mc, bs = engine.model_config, engine.config.block_size
    if mc.mla is not None:  # one plane: latent + RoPE key, no per-head K and V
        return mc.num_layers * bs * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim) * 4
    return mc.num_layers * 2 * bs * mc.num_kv_heads * mc.head_dim * 4


@pytest.mark.parametrize("variant", ["mixtral-4x2", "deepseek-v3-yarn-shared2"])
def test_disaggregated_exact_tokens_and_no_leaks(variant, model_dirs, hf_reference):
    model = model_dirs[variant]
    node = NodeProcess(model)
    decode = make_engine(model, MooncakeTransport(curve=TEST_CURVE))
    try:
        assert decode.kv_spec.block_nbytes == expected_block_nbytes(decode)
        base = random_prompts(1, 45, 45, seed=60)[0]
        prompts = [base, base[:32] + random_prompts(1, 19, 19, seed=61)[0]]
        outs = [disagg(node, decode, prompt) for prompt in prompts]
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_reference(model, prompt, N_OUT)
        assert [o.num_cached_tokens for o in outs] == [0, 32]  # D's own hit on the 2nd
        assert decode.connector.worker.stats.recvs_ok == 2
        theirs = node.call("block_bytes", base)
        for h, sent in zip(hash_block_tokens(base, 8), theirs, strict=True):
            block = decode.block_pool.get_cached_block(h)
            assert sent is not None and block is not None
            assert len(sent) == decode.kv_spec.block_nbytes
            assert decode.kv_cache.block_bytes(block.block_id) == sent
        assert_pool_clean(decode.block_pool)
        assert node.call("leaks") is None
    finally:
        decode.close()
        node.stop()
