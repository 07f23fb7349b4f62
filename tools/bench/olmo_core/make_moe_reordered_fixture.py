"""Writes the fixture of OLMo-core's older MoE block, ``moe_reordered_norm`` (``MoETransformerBlock``
with a ``DroplessMoE``; still in ai2-olmo-core 3.0.0): the model saved as OLMo-core saves it and its
own fp32 logits on fixed tokens (tools/tests/test_olmo_core_moe.py reads it). Runs in the isolated
OLMo-core env of make_moe_fixture.py:

    /tmp/olmocore-env/bin/python tools/bench/olmo_core/make_moe_reordered_fixture.py \
        tools/tests/data/olmo_core_moe_reordered

DIR holds spec.json (``olmo_model.ModelSpec`` JSON: GQA, full-width QK-norm, window 32 on layers
0-1, a dense first layer, top-2 of 4 experts renormalised, no shared expert, vocab 256). The model is
``TransformerConfig(name=moe)`` with ``moe_reordered_norm`` blocks (default attention: separate
``w_q/w_k/w_v``; a ``DroplessMoE`` with a softmax ``MoERouterConfig``, ``normalize_expert_weights=1.0``)
and a ``reordered_norm`` override for block 0, its parameters redrawn at O(1) scale as in
make_moe_fixture.py. Its experts run on CPU (without the grouped_gemm package they loop over the
experts); the two Triton kernels around them (``olmo_core.ops.moe.gather`` / ``scatter``, the
megablocks permutation) are replaced by exact CPU equivalents: gather takes row ``indices[i] // k``
for the i-th routed row, scatter puts each routed row back at its token and sums a token's k rows
weighted by its router weights. Each block's output is checked against a re-computation from the
state dict (attention through the block's own module, the feed-forward by hand, token by token)
before saving. Its shared MLP, when configured, is mixed as shared / (k + 1) + routed x k / (k + 1),
which the spec cannot express: the fixture has none. Writes ``model_and_optim/``
(``save_model_and_optim_state``), ``reference.npz`` and ``provenance.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import numpy as np
import torch

# The same tokens, staging and provenance as the OLMoDDP fixture (run from this folder: the script's own dir is on sys.path).
from make_moe_fixture import BATCH, SEQ, write_fixture
from olmo_core.config import DType
from olmo_core.nn.attention import AttentionConfig, SlidingWindowAttentionConfig
from olmo_core.nn.attention.backend import AttentionBackendName
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.moe import MoEConfig, MoERouterConfig, MoEType, parallel_mlp
from olmo_core.nn.rope import RoPEConfig, RoPEType
from olmo_core.nn.transformer import TransformerBlockConfig, TransformerBlockType, TransformerConfig, TransformerType


def build_config(spec: dict) -> TransformerConfig:
    moe, dtype = spec["moe"], DType.float32
    assert moe["n_shared_experts"] == 0 and not moe["restore_weight_scale"], "not expressible by this block"
    norm = LayerNormConfig(name=LayerNormType.rms, eps=spec["norm_eps"], bias=False, dtype=dtype)
    pattern = [spec["sliding_window"] if t == "sliding_attention" else -1 for t in spec["layer_types"]]
    attention = AttentionConfig(
        n_heads=spec["n_heads"],
        n_kv_heads=spec["n_kv_heads"],
        bias=False,
        rope=RoPEConfig(name=RoPEType.default, theta=int(spec["rope_theta"])),
        qk_norm=norm,
        use_head_qk_norm=spec["qk_norm"] == "per_head",
        backend=AttentionBackendName.torch,
        sliding_window=SlidingWindowAttentionConfig(
            pattern=pattern, force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False
        ),
        dtype=dtype,
    )
    router = MoERouterConfig(top_k=moe["top_k"], normalize_expert_weights=1.0 if moe["normalize_top_k"] else None)
    block = TransformerBlockConfig(
        name=TransformerBlockType.moe_reordered_norm,
        sequence_mixer=attention,
        layer_norm=norm,
        feed_forward_moe=MoEConfig(
            name=MoEType.dropless,
            num_experts=moe["n_experts"],
            hidden_size=moe["expert_hidden"],
            router=router,
            lb_loss_weight=None,
            dtype=dtype,
        ),
    )
    dense = TransformerBlockConfig(
        name=TransformerBlockType.reordered_norm,
        sequence_mixer=attention,
        layer_norm=norm,
        feed_forward=FeedForwardConfig(hidden_size=spec["mlp_hidden"], bias=False, dtype=dtype),
    )
    return TransformerConfig(
        name=TransformerType.moe,
        d_model=spec["d_model"],
        vocab_size=spec["padded_vocab_size"],
        n_layers=spec["n_layers"],
        block=block,
        block_overrides={i: dense for i in range(spec["n_layers"]) if i not in moe["layers"]},
        lm_head=LMHeadConfig(layer_norm=norm, bias=False, dtype=dtype),
        dtype=dtype,
    )


def build(spec: dict, seed: int) -> torch.nn.Module:
    """OLMo-core's model for ``spec`` on CPU in fp32, every parameter redrawn at O(1) scale."""
    torch.manual_seed(seed)
    model = build_config(spec).build(init_device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:  # every matrix is used as x @ W.T over its last axis; the router is flat [E * d]
                fan_in = spec["d_model"] if name.endswith("router.weight") else p.shape[-1]
                if name.endswith("experts.mlp.w2"):  # [E * H, d] used as h @ W[e]: fan-in H
                    fan_in = spec["moe"]["expert_hidden"]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return model.eval()


def cpu_gather(x, indices, bin_ids, bins, top_k):
    return x.index_select(0, indices // top_k)


def cpu_scatter(x, indices, bin_ids, weights, bins, top_k):
    rows = torch.empty_like(x)
    rows[indices] = x
    rows = rows.view(-1, top_k, x.shape[-1])
    return (rows * weights.view(-1, top_k, 1).to(x.dtype)).sum(1) if weights is not None else rows.sum(1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def block_by_hand(block, x: torch.Tensor, spec: dict) -> torch.Tensor:
    """One block recomputed from its state dict: reordered norms, top-k of the softmax renormalised,
    each token through its k experts (w1 gate, w3 up, w2 down, each [E * H, d]) one at a time."""
    sd, eps, moe = block.state_dict(), spec["norm_eps"], spec["moe"]
    h = x + rms_norm(block.attention(x), sd["attention_norm.weight"], eps)
    if "feed_forward.w1.weight" in sd:
        w1, w2, w3 = (sd[f"feed_forward.{n}.weight"] for n in ("w1", "w2", "w3"))
        return h + rms_norm(
            (torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)) @ w2.T, sd["feed_forward_norm.weight"], eps
        )
    n_exp, k, hid = moe["n_experts"], moe["top_k"], moe["expert_hidden"]
    w1, w2, w3 = (sd[f"feed_forward_moe.experts.mlp.{n}"].view(n_exp, hid, -1) for n in ("w1", "w2", "w3"))
    router = sd["feed_forward_moe.router.weight"].view(n_exp, -1)
    out = torch.zeros_like(h)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            tok = h[b, t]
            scores = torch.softmax(router @ tok, dim=-1)
            top = sorted(range(n_exp), key=lambda e: -float(scores[e]))[:k]
            for e in top:
                weight = float(scores[e]) / sum(float(scores[j]) for j in top)
                out[b, t] += weight * ((torch.nn.functional.silu(w1[e] @ tok) * (w3[e] @ tok)) @ w2[e])
    return h + rms_norm(out, sd["feed_forward_norm.weight"], eps)


def forward(model: torch.nn.Module, tokens: np.ndarray, spec: dict) -> tuple[np.ndarray, float]:
    """OLMo-core's logits with the CPU gather / scatter, and the largest block difference from block_by_hand."""
    record: list = []
    hooks = [b.register_forward_hook(lambda m, a, o: record.append((m, a[0], o))) for b in model.blocks.values()]
    with (
        mock.patch.object(parallel_mlp.ops, "gather", cpu_gather),
        mock.patch.object(parallel_mlp.ops, "scatter", cpu_scatter),
    ):
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens)).float().numpy()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        worst = max(float((block_by_hand(b, x, spec) - out).abs().max()) for b, x, out in record)
    if not worst < 1e-4:
        raise SystemExit(f"make_moe_reordered_fixture: a block differs from the re-computation by {worst:.2e}")
    return logits, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="fixture folder holding spec.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = json.loads((args.dir / "spec.json").read_text())
    model = build(spec, args.seed)
    tokens = np.random.default_rng(args.seed).integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    logits, worst = forward(model, tokens, spec)
    write_fixture(
        args.dir,
        model,
        tokens,
        logits,
        worst,
        script="make_moe_reordered_fixture.py",
        description="TransformerConfig(moe, moe_reordered_norm blocks, DroplessMoE, block 0 reordered_norm)",
        seed=args.seed,
    )
    print(f"wrote {args.dir}: logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}, self-check {worst:.2e}")


if __name__ == "__main__":
    main()
