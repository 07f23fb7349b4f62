"""A float64 numpy reference of the model: the third implementation that judges the others.

It is written for clarity, not speed, and only for tiny specs in tests. Parameters are a
dict keyed by the HF names of ``hf_param_shapes(spec)`` (linear weights stored (out, in),
as torch.nn.Linear does), so the same dict loads into transformers and into either trainer.

What it computes, block by block (Olmo 3, see docs/design.md):

- embedding lookup (optionally times ``embedding_scale``, then an RMSNorm); per layer the
  reordered norm h = x + RMSNorm(attn(x)), out = h + RMSNorm(mlp(h)) (or pre-norm, or peri-norm:
  both, see ``block``); a final RMSNorm; an untied output head;
- RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w;
- QK-norm over the full projected width before splitting heads ("full"), per head
  ("per_head"), or none; always before RoPE;
- RoPE in the rotate-half layout, inv_freq = 1 / theta^(arange(0, hd, 2) / hd); YaRN on
  the full-attention layers, with the ramp, truncation and cos/sin scaling transformers'
  ``_compute_yarn_parameters`` uses;
- causal GQA attention; a sliding layer's query q sees keys k with q - window < k <= q;
- SwiGLU down(silu(gate(x)) * up(x)), or an MoE block: router logits x @ gate.T,
  softmax (or sigmoid) scores, top-k (ties to the lower expert index), weights optionally
  renormalised (and then, with ``restore_weight_scale``, scaled by top_k to sum to k), plus
  shared experts on every token.

transformers computes RMSNorm, RoPE tables and the OLMoE router softmax in float32 even
in a float64 model; this module stays in float64 throughout.
"""

from __future__ import annotations

import math

import numpy as np

from .hf import hf_param_shapes
from .spec import ModelSpec, MoESpec

Params = dict[str, np.ndarray]


# ---- initialisation -------------------------------------------------------------------


def init_params(spec: ModelSpec, seed: int = 0) -> Params:
    """Olmo 3 init for tests: truncated normal (std spec.init_std, cut at
    +-spec.init_cutoff * std) for every linear, the embedding and the routers; RMSNorm
    weights one. float32 arrays, like the trainers' master weights.

    Uses numpy's Generator, so the values are a function of ``seed`` alone; the trainers
    draw their own init with their own RNGs and are compared to this model by loading
    these arrays, not by matching random streams.
    """
    rng = np.random.default_rng(seed)
    params: Params = {}
    bound = spec.init_cutoff * spec.init_std
    for name, shape in hf_param_shapes(spec).items():
        if len(shape) == 1:
            params[name] = np.ones(shape, dtype=np.float32)
            continue
        values = rng.normal(0.0, spec.init_std, size=shape)
        # Resampling the out-of-range draws gives exactly the truncated distribution.
        outside = np.abs(values) > bound
        while outside.any():
            values[outside] = rng.normal(0.0, spec.init_std, size=int(outside.sum()))
            outside = np.abs(values) > bound
        params[name] = values.astype(np.float32)
    return params


def _check_params(spec: ModelSpec, params: Params) -> None:
    for name, shape in hf_param_shapes(spec).items():
        if name not in params:
            raise ValueError(f"reference: parameter '{name}' is missing; build params with init_params(spec)")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"reference: parameter '{name}' has shape {tuple(params[name].shape)}, the spec needs {shape}; "
                "load weights made for this spec"
            )


# ---- building blocks ------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_inv_freq(spec: ModelSpec, layer: int) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2], cos/sin scale) of a layer, float64.

    Without YaRN the scale is 1. With YaRN (global layers only) this follows transformers'
    ``_compute_yarn_parameters``: blend the original and the factor-interpolated
    frequencies with a linear ramp between the dimensions that make beta_fast and
    beta_slow rotations over the original context (floored/ceiled, the default
    ``truncate=True``), and scale cos/sin by 0.1 ln(factor) + 1 unless attention_factor
    is given."""
    dim = spec.head_dim
    theta = spec.rope_theta
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    yarn = spec.rope_yarn_of(layer)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_share = 1.0 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_share
    if yarn.attention_factor is not None:
        scale = yarn.attention_factor
    else:
        scale = 0.1 * math.log(yarn.factor) + 1.0
    return inv_freq, scale


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [B, S, heads, hd]; cos/sin [S, hd]."""
    return x * cos[None, :, None, :] + _rotate_half(x) * sin[None, :, None, :]


def attention(spec: ModelSpec, p: Params, prefix: str, layer: int, x: np.ndarray) -> np.ndarray:
    """Self-attention of one layer (before its post-attention norm); x [B, S, d]."""
    b, s, _ = x.shape
    hd, n_h, n_kv = spec.head_dim, spec.n_heads, spec.kv_heads
    q = x @ p[prefix + "q_proj.weight"].T
    k = x @ p[prefix + "k_proj.weight"].T
    v = x @ p[prefix + "v_proj.weight"].T
    if spec.qk_norm == "full":
        q = rms_norm(q, p[prefix + "q_norm.weight"], spec.norm_eps)
        k = rms_norm(k, p[prefix + "k_norm.weight"], spec.norm_eps)
    q = q.reshape(b, s, n_h, hd)
    k = k.reshape(b, s, n_kv, hd)
    v = v.reshape(b, s, n_kv, hd)
    if spec.qk_norm == "per_head":
        q = rms_norm(q, p[prefix + "q_norm.weight"], spec.norm_eps)
        k = rms_norm(k, p[prefix + "k_norm.weight"], spec.norm_eps)

    inv_freq, scale = rope_inv_freq(spec, layer)
    angles = np.arange(s, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles) * scale, np.sin(angles) * scale
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    # Query head h reads kv head h // group, as transformers' repeat_kv lays them out.
    group = n_h // n_kv
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    qi = np.arange(s)[:, None]
    ki = np.arange(s)[None, :]
    visible = ki <= qi
    window = spec.window_of(layer)
    if window is not None:
        visible &= ki > qi - window
    scores = np.where(visible[None, None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, n_h * hd)
    return out @ p[prefix + "o_proj.weight"].T


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def route(moe: MoESpec, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Learned routing of router logits [T, E] -> (chosen experts [T, k], best first, their
    weights [T, k], router scores [T, E])."""
    if moe.gating == "softmax":
        scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    # A stable sort of the negated scores puts the lower index first among equal scores.
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, : moe.top_k]
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if moe.normalize_top_k:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if moe.restore_weight_scale:
        weights = weights * moe.top_k
    return chosen, weights, scores


def moe_block(moe: MoESpec, p: Params, prefix: str, x: np.ndarray) -> tuple[np.ndarray, float, float]:
    """One MoE feed-forward block on tokens x [T, d] -> (output [T, d], load-balancing loss,
    router z-loss) of this layer.

    Load balancing is the Switch/OLMoE form n_experts * sum_e f_e * P_e with f_e the share
    of the T * top_k (token, slot) assignments that went to e and P_e the mean router
    score of e; the z-loss is mean(logsumexp(router logits)^2)."""
    logits = x @ p[prefix + "gate.weight"].T
    chosen, weights, scores = route(moe, logits)

    out = np.zeros_like(x)
    for e in range(moe.n_experts):
        tokens, slots = np.nonzero(chosen == e)
        if tokens.size == 0:
            continue
        e_prefix = f"{prefix}experts.{e}."
        y = swiglu(
            x[tokens],
            p[e_prefix + "gate_proj.weight"],
            p[e_prefix + "up_proj.weight"],
            p[e_prefix + "down_proj.weight"],
        )
        np.add.at(out, tokens, y * weights[tokens, slots][:, None])
    for s in range(moe.n_shared_experts):
        s_prefix = f"{prefix}shared_experts.{s}."
        out += swiglu(
            x,
            p[s_prefix + "gate_proj.weight"],
            p[s_prefix + "up_proj.weight"],
            p[s_prefix + "down_proj.weight"],
        )

    n_tokens = x.shape[0]
    assigned = np.bincount(chosen.reshape(-1), minlength=moe.n_experts) / (n_tokens * moe.top_k)
    mean_score = scores.mean(axis=0)
    load_balancing = float(moe.n_experts * np.sum(assigned * mean_score))
    z_loss = float(np.mean(_logsumexp(logits) ** 2))
    return out, load_balancing, z_loss


# ---- the model ------------------------------------------------------------------------


def embed(spec: ModelSpec, p: Params, ids: np.ndarray) -> np.ndarray:
    """The embedding rows of ``ids``, times ``embedding_scale`` and then RMS-normalised with
    ``model.embed_norm`` where the spec says so (OLMo-core 3: scale first, then the norm)."""
    x = p["model.embed_tokens.weight"][ids]
    if spec.embedding_scale is not None:
        x = x * spec.embedding_scale
    if spec.embedding_norm:
        x = rms_norm(x, p["model.embed_norm.weight"], spec.norm_eps)
    return x


def block(spec: ModelSpec, p: Params, i: int, x: np.ndarray) -> tuple[np.ndarray, tuple[float, float] | None]:
    """Layer ``i`` on x [B, S, d]: the new residual stream and, for an MoE layer, its
    (load-balancing, router z) losses. reordered: h = x + norm(attn(x)), out = h + norm(mlp(h));
    pre: h = x + attn(norm(x)), out = h + mlp(norm(h)); peri: h = x + norm(attn(in_norm(x))),
    out = h + norm(mlp(in_norm'(h))), the input norms input_layernorm / pre_feedforward_layernorm."""
    eps = spec.norm_eps
    pre = f"model.layers.{i}."
    attn_norm, mlp_norm = p[pre + "post_attention_layernorm.weight"], p[pre + "post_feedforward_layernorm.weight"]
    placement = spec.norm_placement
    if placement == "pre":
        x = x + attention(spec, p, pre + "self_attn.", i, rms_norm(x, attn_norm, eps))
    else:
        a = rms_norm(x, p[pre + "input_layernorm.weight"], eps) if placement == "peri" else x
        x = x + rms_norm(attention(spec, p, pre + "self_attn.", i, a), attn_norm, eps)
    if placement == "pre":
        y = rms_norm(x, mlp_norm, eps)
    else:
        y = rms_norm(x, p[pre + "pre_feedforward_layernorm.weight"], eps) if placement == "peri" else x
    routing = None
    if spec.is_moe_layer(i):
        assert spec.moe is not None
        b, s, d = x.shape
        m, lb, z = moe_block(spec.moe, p, pre + "mlp.", y.reshape(b * s, d))
        m = m.reshape(b, s, d)
        routing = (lb, z)
    else:
        m = swiglu(y, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.up_proj.weight"], p[pre + "mlp.down_proj.weight"])
    return x + (m if placement == "pre" else rms_norm(m, mlp_norm, eps)), routing


def forward_with_aux(spec: ModelSpec, params: Params, input_ids: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Logits float64 [B, S, padded_vocab] and, for MoE specs, the unweighted auxiliary
    losses averaged over the MoE layers (keys load_balancing_loss, router_z_loss; empty
    for dense specs)."""
    _check_params(spec, params)
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"reference: input_ids must be an integer array [batch, seq], got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= spec.padded_vocab_size):
        raise ValueError(
            f"reference: input_ids must lie in [0, {spec.padded_vocab_size}) (padded_vocab_size); "
            f"got [{ids.min()}, {ids.max()}]"
        )
    p = {name: np.asarray(value, dtype=np.float64) for name, value in params.items()}
    x = embed(spec, p, ids)
    lb_losses: list[float] = []
    z_losses: list[float] = []
    for i in range(spec.n_layers):
        x, routing = block(spec, p, i, x)
        if routing is not None:
            lb_losses.append(routing[0])
            z_losses.append(routing[1])
    eps = spec.norm_eps
    x = rms_norm(x, p["model.norm.weight"], eps)
    logits = x @ p["lm_head.weight"].T
    aux: dict[str, float] = {}
    if lb_losses:
        aux = {"load_balancing_loss": float(np.mean(lb_losses)), "router_z_loss": float(np.mean(z_losses))}
    return logits, aux


def forward(spec: ModelSpec, params: Params, input_ids: np.ndarray) -> np.ndarray:
    """Logits float64 [B, S, padded_vocab_size]."""
    return forward_with_aux(spec, params, input_ids)[0]


def loss(
    spec: ModelSpec, params: Params, input_ids: np.ndarray, labels: np.ndarray, ignore_index: int = -100
) -> dict[str, float]:
    """Training loss terms: ce (mean cross-entropy over labels != ignore_index), z_loss
    (mean logsumexp(logits)^2 over the same tokens), total = ce + z_loss_weight * z_loss
    (+ the MoE load-balancing and router z-loss weights times their aux values; these
    keys are present for MoE specs).

    The logits of the padded vocab rows (vocab_size..padded_vocab_size) take part in the
    softmax and the logsumexp, unmasked, as in Olmo-core: they start small and are
    trained towards -inf because no label ever names them."""
    labels = np.asarray(labels)
    if labels.shape != np.asarray(input_ids).shape:
        raise ValueError(f"reference: labels shape {labels.shape} differs from input_ids {np.asarray(input_ids).shape}")
    logits, aux = forward_with_aux(spec, params, input_ids)
    keep = labels != ignore_index
    if not keep.any():
        raise ValueError(f"reference: every label equals ignore_index={ignore_index}; nothing to average")
    picked = logits[keep]
    target = labels[keep]
    if target.min() < 0 or target.max() >= spec.padded_vocab_size:
        raise ValueError(f"reference: labels must lie in [0, {spec.padded_vocab_size}) or equal ignore_index")
    lse = _logsumexp(picked)
    ce = float(np.mean(lse - picked[np.arange(target.size), target]))
    z_loss = float(np.mean(lse**2))
    out = {"ce": ce, "z_loss": z_loss, "total": ce + spec.z_loss_weight * z_loss}
    if aux:
        assert spec.moe is not None
        out.update(aux)
        out["total"] += (
            spec.moe.load_balancing_loss_weight * aux["load_balancing_loss"]
            + spec.moe.router_z_loss_weight * aux["router_z_loss"]
        )
    return out
