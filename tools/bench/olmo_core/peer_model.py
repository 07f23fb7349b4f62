"""OLMo-core's own Olmo 3 transformer for one of our model specs, checked field by field.

Imported by train_peer.py and make_layout_fixture.py, which run inside the isolated
OLMo-core env (``uv run --isolated --no-project --python 3.11 --with ai2-olmo-core``), so
this module sees OLMo-core and torch but none of this workspace's packages: the spec
arrives as the JSON of ``olmo_model.ModelSpec``.

Where OLMo-core names the shape (``TransformerConfig.olmo3_30M`` and friends) that config
is used as OLMo-core ships it, only with the attention backend switched from flash-attn to
torch SDPA (no GPU here); otherwise the config is built the way those presets build theirs
(``llama_like`` with the reordered-norm block, QK-norm, RMSNorm eps, RoPE theta) with our
MLP width and window pattern. Either way ``check_matches`` compares the built model
with the spec before anything is timed or saved, so a shape mismatch cannot pass silently.
"""

from __future__ import annotations

import torch
from olmo_core.nn.attention import SlidingWindowAttentionConfig
from olmo_core.nn.attention.backend import AttentionBackendName
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.transformer import Transformer, TransformerBlockType, TransformerConfig

# Our preset name -> OLMo-core's TransformerConfig classmethod for the same shape.
NAMED = {
    "olmo3-14m": "olmo3_14M",
    "olmo3-30m": "olmo3_30M",
    "olmo3-60m": "olmo3_60M",
    "olmo3-190m": "olmo3_190M",
    "olmo3-1b": "olmo3_1B",
    "olmo3-7b": "olmo3_7B",
    "olmo3-32b": "olmo3_32B",
}


def olmo3_config(spec: dict) -> tuple[TransformerConfig, str]:
    """(OLMo-core config, how it was made) for a dense spec with full-width QK-norm and no YaRN."""
    if spec["moe"] is not None or spec["yarn"] is not None or spec["qk_norm"] != "full":
        raise SystemExit(
            f"peer_model: spec {spec['name']!r} uses MoE, YaRN or per-head QK-norm; "
            "only dense Olmo 3 specs without YaRN are mapped to OLMo-core here"
        )
    backend = AttentionBackendName.torch  # flash-attn needs a GPU; SDPA is OLMo-core's CPU path
    if spec["name"] in NAMED:
        method = NAMED[spec["name"]]
        return getattr(TransformerConfig, method)(
            vocab_size=spec["padded_vocab_size"], attn_backend=backend
        ), f"TransformerConfig.{method}(vocab_size={spec['padded_vocab_size']}, attn_backend='torch')"
    # One window entry per layer (-1 = full attention): OLMo-core's pattern then equals our layer_types.
    pattern = [spec["sliding_window"] if t == "sliding_attention" else -1 for t in spec["layer_types"]]
    config = TransformerConfig.llama_like(
        d_model=spec["d_model"],
        vocab_size=spec["padded_vocab_size"],
        n_layers=spec["n_layers"],
        n_heads=spec["n_heads"],
        n_kv_heads=spec["n_kv_heads"],
        block_name=TransformerBlockType.reordered_norm,
        qk_norm=True,
        rope_theta=int(spec["rope_theta"]),
        layer_norm_eps=spec["norm_eps"],
        feed_forward=FeedForwardConfig(hidden_size=spec["mlp_hidden"], bias=False),
        sliding_window=SlidingWindowAttentionConfig(
            pattern=pattern, force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False
        ),
        attn_backend=backend,
    )
    return config, f"TransformerConfig.llama_like(reordered_norm, qk_norm, window pattern {pattern})"


def check_matches(model: Transformer, spec: dict, param_total: int | None) -> None:
    """Exit with the differing field unless OLMo-core's built model has exactly our spec's shape
    (``param_total`` None: the parameter count is left to the caller's own check)."""
    block = model.blocks["0"]
    head_dim = spec["d_model"] // spec["n_heads"]
    found = {
        "n_layers": len(model.blocks),
        "d_model": model.embeddings.weight.shape[1],
        "padded_vocab_size": model.embeddings.weight.shape[0],
        "q width (n_heads * head_dim)": block.attention.w_q.weight.shape[0],
        "kv width (n_kv_heads * head_dim)": block.attention.w_k.weight.shape[0],
        "mlp_hidden": block.feed_forward.w1.weight.shape[0],
        "norm_eps": block.attention_norm.eps,
        "q_norm width": block.attention.q_norm.weight.shape[0],
        "rope_theta": block.attention.rope.theta,
        "windows": [model.blocks[str(i)].attention.window_size for i in range(len(model.blocks))],
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    want = {
        "n_layers": spec["n_layers"],
        "d_model": spec["d_model"],
        "padded_vocab_size": spec["padded_vocab_size"],
        "q width (n_heads * head_dim)": spec["n_heads"] * head_dim,
        "kv width (n_kv_heads * head_dim)": (spec["n_kv_heads"] or spec["n_heads"]) * head_dim,
        "mlp_hidden": spec["mlp_hidden"],
        "norm_eps": spec["norm_eps"],
        "q_norm width": spec["n_heads"] * head_dim,
        "rope_theta": spec["rope_theta"],
        # OLMo-core stores None for full attention, the window length for sliding layers.
        "windows": [spec["sliding_window"] if t == "sliding_attention" else None for t in spec["layer_types"]],
        "parameters": param_total,
    }
    for key, value in want.items():
        if value is not None and found[key] != value:
            raise SystemExit(
                f"peer_model: OLMo-core's model has {key} = {found[key]}, spec {spec['name']!r} "
                f"has {value}; the configs differ, fix peer_model.olmo3_config"
            )


def build(spec: dict, param_total: int | None, seed: int) -> tuple[Transformer, str]:
    """OLMo-core's model for ``spec`` on CPU in fp32, initialised by OLMo-core's own init."""
    config, how = olmo3_config(spec)
    torch.manual_seed(seed)
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    check_matches(model, spec, param_total)
    return model, how
