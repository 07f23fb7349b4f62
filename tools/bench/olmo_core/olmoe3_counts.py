"""Prints OLMo-core's own parameter counts (``num_active_params``, ``num_params`` of
``OLMoDDPModelConfig``) of the OLMoE3 reference models, the figures
packages/olmo-model/tests/test_olmoe3_presets.py pins our counts to.

The scripts themselves (src/examples/olmo_ddp/OLMoE3-dev-*.py and moe_8l_ddp.py, branch olmo-ddp of
allenai/OLMo-core) import beaker and cluster plumbing at load; this builds the same model configs
from OLMo-core 3.0.0's config classes with the scripts' shapes (d_model, layers, attention width
n_heads * 128, GQA ratio, experts, expert and shared hidden, dense leading blocks of hidden
top_k * hidden + hidden, peri-norm, embedding norm) and leaves out what changes no parameter
(expert-parallel paths, FP8, recompute). Runs inside the isolated OLMo-core env, from the
repository root:

    uv run --isolated --no-project --python 3.11 --with ai2-olmo-core==3.0.0 \
        python tools/bench/olmo_core/olmoe3_counts.py
"""

from __future__ import annotations

import math
from copy import deepcopy

from olmo_core.config import DType
from olmo_core.nn.attention import AttentionConfig, AttentionType
from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.moe import MoELoadBalancingLossGranularity, MoERouterGatingFunction
from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
from olmo_core.nn.moe.v2.router import MoERouterConfigV2
from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
from olmo_core.nn.rope import RoPEConfig, RoPEType
from olmo_core.nn.transformer import OLMoDDPModelConfig, TransformerBlockType, TransformerType

TOP_K = 4
FP32 = DType.float32

# preset: (d_model, layers, attention width, heads per kv head, experts, hidden, dense leading, peri-norm)
MODELS = {
    "olmoe3-t001": (2048, 16, 2048, 4, 64, 2048, 1, True),
    "olmoe3-s001": (2560, 32, 3072, 4, 64, 2560, 1, True),
    "olmoe3-m001": (3072, 39, 4096, 4, 96, 3072, 2, True),
    "olmoe3-m002": (3072, 39, 4096, 4, 128, 3072, 2, True),
    "olmoe3-l001": (4096, 47, 5120, 4, 128, 4096, 2, True),
    "olmoe3-u001": (6144, 63, 8192, 2, 128, 8192, 2, True),
    "olmoe3-u002": (6144, 63, 8192, 2, 256, 8192, 2, True),
    **{f"olmoe3-bench-e{n}": (4096, 8, 4096, 4, n, 4096, 1, False) for n in (8, 32, 64, 128)},
}


def _block(d: int, heads: int, kv_ratio: int, experts: int, hidden: int, peri: bool, dense: bool):
    norm = LayerNormConfig(name=LayerNormType.rms, eps=1e-6, bias=False, dtype=FP32)
    attention = AttentionConfig(
        name=AttentionType.default,
        n_heads=heads,
        head_dim=128,
        n_kv_heads=heads // kv_ratio,
        bias=False,
        rope=RoPEConfig(name=RoPEType.default, theta=500_000),
        qk_norm=norm,
        use_head_qk_norm=True,
        dtype=FP32,
    )
    shared_hidden = TOP_K * hidden + hidden if dense else hidden
    routed = {}
    if not dense:
        routed = dict(
            routed_experts=RoutedExpertsConfig(
                d_model=d, hidden_size=hidden, num_experts=experts, bias=False, dtype=FP32
            ),
            routed_experts_router=MoERouterConfigV2(
                d_model=d,
                num_experts=experts,
                top_k=TOP_K,
                gating_function=MoERouterGatingFunction.softmax,
                lb_loss_granularity=MoELoadBalancingLossGranularity.local_batch,
                normalize_expert_weights=1.0,
                restore_weight_scale=True,
                dtype=FP32,
            ),
        )
    return OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2,
        use_peri_norm=peri,
        sequence_mixer=attention,
        layer_norm=norm,
        shared_experts=SharedExpertsConfig(d_model=d, hidden_size=shared_hidden, num_experts=1, bias=False, dtype=FP32),
        **routed,
    )


def build(d, layers, width, kv_ratio, experts, hidden, n_dense, peri) -> OLMoDDPModelConfig:
    norm = LayerNormConfig(name=LayerNormType.rms, eps=1e-6, bias=False, dtype=FP32)
    heads = width // 128
    config = OLMoDDPModelConfig(
        d_model=d,
        vocab_size=100_352,
        n_layers=layers,
        embed_scale=math.sqrt(d),
        embedding_norm=norm,
        block=_block(d, heads, kv_ratio, experts, hidden, peri, dense=False),
        lm_head=LMHeadConfig(layer_norm=norm, bias=False, dtype=FP32),
        name=TransformerType.moe_fused_v2,
        init_std=0.01,
        dtype=FP32,
    )
    dense = _block(d, heads, kv_ratio, experts, hidden, peri, dense=True)
    config.block_overrides = {i: deepcopy(dense) for i in range(n_dense)}
    return config


if __name__ == "__main__":
    for name, shape in MODELS.items():
        config = build(*shape)
        print(f"{name} active {config.num_active_params} total {config.num_params}")
