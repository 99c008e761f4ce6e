"""DeepSeek-V2 and -V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): the decoder of
`engine.models.llama` with Multi-head Latent Attention (`engine.models.mla`) and DeepSeek's
MoE (`engine.models.moe`: shared + routed experts, grouped top-k; the first
`first_k_dense_replace` layers dense). V2 and V3 differ only in config: routing (softmax
greedy or group-limited vs. sigmoid with score correction), and V3's `rope_interleave` flag.
"""

from __future__ import annotations

from pdcluster.engine.models.llama import CausalLM
from pdcluster.engine.models.mla import MLAttention, mla_config
from pdcluster.engine.models.model_config import ModelConfig


class DeepseekForCausalLM(CausalLM):
    attention_cls = MLAttention

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        return mla_config(cfg).qk_rope_head_dim
