"""The JAX Olmo 3 model against transformers' Olmo3ForCausalLM, the float64 numpy reference
(olmo_model.reference) and identities derived by hand (windowing, document masking, init
statistics, bf16 error bound, remat, adapter errors).

Run: cd /work/main && uv run --frozen pytest packages/olmo-train-jax/tests/test_model.py -n 0 -q
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Olmo3Config, Olmo3ForCausalLM

from olmo_model import FULL, SLIDING, ModelSpec, get_preset, hf_config, hf_param_shapes, reference
from olmo_train_jax import CheckpointMismatchError, OlmoModel, build_model, load_hf, model_from_hf, to_hf
from olmo_train_jax.model import REMAT_POLICIES

jax.config.update("jax_enable_x64", False)  # float32 throughout, like the trainers

SEQ = 128  # > every tiny window (16, 32) and > tiny-yarn's original context (64)
_forward = nnx.jit(lambda model, ids: model(ids).logits)
_forward_docs = nnx.jit(lambda model, ids, doc_ids: model(ids, doc_ids).logits)


def _spec(name: str) -> ModelSpec:
    if name == "tiny-pattern":  # an explicit, non-periodic pattern: global first and last
        return get_preset("tiny").replace(layer_types=(FULL, SLIDING, SLIDING, FULL), name=name)
    return get_preset(name)


def _ids(spec: ModelSpec, batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, spec.vocab_size, (batch, seq)).astype(np.int32)


@functools.cache
def _built(name: str) -> tuple[ModelSpec, OlmoModel, np.ndarray, np.ndarray]:
    """One model, input batch and fp32 logits per spec, shared by the tests."""
    spec = _spec(name)
    model = build_model(spec, seed=0)
    ids = _ids(spec)
    return spec, model, ids, np.array(_forward(model, jnp.asarray(ids)))


def _hf_logits(spec: ModelSpec, tensors: dict[str, np.ndarray], ids: np.ndarray, no_qk_norm=False):
    """Logits of transformers' Olmo3ForCausalLM (eager attention, float32) with these weights."""
    config = Olmo3Config(**hf_config(spec))
    config._attn_implementation = "eager"
    hf = Olmo3ForCausalLM(config).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    if no_qk_norm:
        for layer in hf.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long()).logits.numpy()


def _assert_matches(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4
    log_p = torch.log_softmax(torch.from_numpy(np.array(ref, np.float64)), -1)
    log_q = torch.log_softmax(torch.from_numpy(np.array(ours, np.float64)), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    assert kl <= 1e-9
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def _perturb_norms(tensors: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Norm weights away from their init of one, so that their mapping is tested too."""
    rng = np.random.default_rng(seed)
    return {k: rng.uniform(0.5, 1.5, v.shape).astype(np.float32) if v.ndim == 1 else v for k, v in tensors.items()}


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "tiny-yarn", "tiny-pattern"])
def test_logits_match_transformers(name):
    spec, model, ids, _ = _built(name)
    tensors = _perturb_norms(to_hf(model, spec), seed=1)
    ours = np.asarray(_forward(model_from_hf(spec, tensors), jnp.asarray(ids)))
    assert ours.shape == (2, SEQ, spec.padded_vocab_size)
    _assert_matches(ours, _hf_logits(spec, tensors, ids))


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "tiny-yarn", "tiny-per-head"])
def test_logits_match_numpy_reference(name):
    if name == "tiny-per-head":  # transformers has no per-head QK-norm; the reference does
        spec = get_preset("tiny-gqa").replace(qk_norm="per_head", name=name)
    else:
        spec = get_preset(name)
    params = _perturb_norms(reference.init_params(spec, seed=11), seed=11)
    ids = _ids(spec, seed=11)
    ours = np.asarray(_forward(model_from_hf(spec, params), jnp.asarray(ids)))
    ref = reference.forward(spec, params, ids)
    _assert_matches(ours, ref)


def test_labels_give_the_fused_loss_sums_of_the_numpy_reference_instead_of_logits():
    spec = get_preset("tiny-gqa")
    params = reference.init_params(spec, seed=12)
    model = model_from_hf(spec, params)
    ids = _ids(spec, seq=64, seed=12)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[1, :7] = -100  # rows with different valid counts: sums, not means per row
    out = nnx.jit(lambda m, i, y: m(i, labels=y))(model, jnp.asarray(ids), jnp.asarray(labels))
    assert out.logits is None and out.moe is None and out.loss_sums.shape == (3,)
    ref = reference.loss(spec, params, ids, labels)
    n = int((labels != -100).sum())
    objective, ce, z = (float(v) for v in np.asarray(out.loss_sums, np.float64))
    # Logits are within 1e-4 of the reference (test_logits_match_numpy_reference), so a token's CE
    # (lse - target) moves by at most 2e-4 and its lse^2 by 2 |lse| 1e-4; the float32 sums of n
    # terms add at most n 2^-24 of their total on top.
    ref_logits = reference.forward(spec, params, ids)[labels != -100]
    top = ref_logits.max(-1)
    lse_max = float(np.abs(np.log(np.exp(ref_logits - top[:, None]).sum(-1)) + top).max())
    rounding = n * 2.0**-24
    assert abs(ce / n - ref["ce"]) <= 2e-4 + rounding * ref["ce"]
    assert abs(z / n - ref["z_loss"]) <= 2 * lse_max * 1e-4 + rounding * ref["z_loss"]
    assert abs(objective / n - ref["total"]) <= 2e-4 + 2 * spec.z_loss_weight * lse_max * 1e-4 + rounding * ref["total"]
    assert objective == pytest.approx(ce + spec.z_loss_weight * z, rel=1e-6)  # the same float32 sums
    without = model(jnp.asarray(ids))
    assert without.loss_sums is None and without.logits.shape == (*ids.shape, spec.padded_vocab_size)
    with pytest.raises(ValueError, match=r"labels shape \(2, 63\) differs from input_ids shape \(2, 64\)"):
        model(jnp.asarray(ids), labels=jnp.asarray(labels[:, :-1]))


def test_yarn_is_applied_beyond_original_context():
    spec, model, ids, ours = _built("tiny-yarn")
    plain = model_from_hf(spec.replace(yarn=None), to_hf(model, spec))
    diff = np.abs(np.asarray(_forward(plain, jnp.asarray(ids))) - ours).max()
    assert diff > 1e-3  # YaRN rescales frequencies and cos/sin: not a no-op on these layers


def test_sliding_layers_window_attention():
    spec, model, ids, ours = _built("tiny")
    global_only = spec.replace(sliding_window=None)
    assert set(global_only.layer_types) == {FULL}
    unwindowed = np.asarray(_forward(model_from_hf(global_only, to_hf(model, spec)), jnp.asarray(ids)))
    per_position = np.abs(unwindowed - ours).max(axis=(0, 2))
    window = spec.sliding_window
    # A query closer than `window` to the start sees every key either way; later ones lose keys.
    assert per_position[:window].max() <= 1e-6
    assert per_position[window:].min() > 1e-5
    assert per_position[window:].max() > 1e-3


def test_doc_ids_equal_running_each_document_alone():
    spec, model, ids, ours = _built("tiny-gqa")
    bounds = [(0, 64), (64, SEQ)]  # each document longer than the 32-token window
    doc_ids = np.zeros_like(ids)
    for d, (a, b) in enumerate(bounds):
        doc_ids[:, a:b] = d
    doc_ids[1] = 0  # second row: one document, so it must equal the unmasked forward
    masked = np.asarray(_forward_docs(model, jnp.asarray(ids), jnp.asarray(doc_ids)))
    for a, b in bounds:
        alone = np.asarray(_forward(model, jnp.asarray(ids[:1, a:b])))
        # RoPE scores depend on distance only, so the document's absolute offset does not matter.
        assert np.abs(masked[0, a:b] - alone[0]).max() <= 1e-5
    assert np.abs(masked[1] - ours[1]).max() <= 1e-6
    assert np.abs(masked[0, 64:] - ours[0, 64:]).max() > 1e-3


def test_init_statistics():
    spec, model, _, _ = _built("tiny")
    tensors = to_hf(model, spec)
    # Std of a unit normal truncated at +-c: sqrt(1 - 2 c phi(c) / (2 Phi(c) - 1)).
    c = spec.init_cutoff
    phi = math.exp(-c * c / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(c / math.sqrt(2))
    expected_std = spec.init_std * math.sqrt(1 - 2 * c * phi / mass)
    assert expected_std == pytest.approx(0.02 * 0.9866, rel=1e-4)
    # Pool each weight over its layers (4 x 4096+ samples): the std estimate then has a relative
    # spread of ~0.5%, so the 2% tolerance is a ~4-sigma bound.
    pooled: dict[str, list[np.ndarray]] = {}
    for name, value in tensors.items():
        pooled.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", name), []).append(value.ravel())
    for name, parts in pooled.items():
        value = np.concatenate(parts)
        if name.endswith("norm.weight"):
            assert (value == 1).all(), name
        else:
            assert abs(value.std() / expected_std - 1) < 0.02, name
            assert np.abs(value).max() <= c * spec.init_std * (1 + 1e-6), name
            assert abs(value.mean()) < 0.05 * expected_std, name
    again = to_hf(build_model(spec, seed=0), spec)
    other = to_hf(build_model(spec, seed=1), spec)
    assert all(np.array_equal(tensors[k], again[k]) for k in tensors)
    assert not np.array_equal(
        tensors["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"]
    )


def test_bf16_compute_close_to_fp32():
    spec, model, ids, ours = _built("tiny")
    bf16 = model_from_hf(spec, to_hf(model, spec), dtype=jnp.bfloat16)
    low = np.asarray(_forward(bf16, jnp.asarray(ids)))
    assert low.dtype == np.float32
    # bf16 keeps 8 significant bits: each rounding adds a relative error up to 2^-9. A block
    # rounds ~16 times on the way to its output (q/k/v, QK-norm, RoPE, probabilities, attention
    # out, o_proj, norm, residual, gate/up, SwiGLU product, down, norm, residual), so 4 blocks
    # plus the head give ~64 roundings; independent errors add like a random walk:
    # sqrt(64) * 2^-9 = 2^-6 (1.6%) of the logit scale. The bound allows twice that for
    # correlated errors (measured: 1.3% rms; the largest error is 2.0% of the largest logit).
    err = np.abs(low - ours)
    assert np.sqrt((err**2).mean()) <= 2 * 2**-6 * np.sqrt((ours**2).mean())
    assert err.max() <= 2 * 2**-5 * np.abs(ours).max()  # the extreme of 0.5M errors: ~5 rms
    # Random-init logits are nearly tied, so a few top-1 flips are expected, not many.
    assert (low.argmax(-1) == ours.argmax(-1)).mean() >= 0.9


def test_qk_norm_none_matches_transformers_without_qk_norm():
    spec = get_preset("tiny").replace(qk_norm="none")
    model = build_model(spec, seed=3)
    ids = _ids(spec, seq=64)
    tensors = to_hf(model, spec)
    assert not any("q_norm" in k for k in tensors)
    # Olmo3ForCausalLM always has the norms: give them placeholder ones, then bypass them.
    padded = dict(tensors)
    for i in range(spec.n_layers):
        padded[f"model.layers.{i}.self_attn.q_norm.weight"] = np.ones(spec.q_width, np.float32)
        padded[f"model.layers.{i}.self_attn.k_norm.weight"] = np.ones(spec.kv_width, np.float32)
    ref = _hf_logits(spec.replace(qk_norm="full"), padded, ids, no_qk_norm=True)
    _assert_matches(np.asarray(_forward(model, jnp.asarray(ids))), ref)


def test_remat_policies_change_what_is_saved_not_the_gradients():
    spec = get_preset("tiny").replace(n_layers=2)
    tensors = to_hf(build_model(spec, seed=5), spec)
    ids = jnp.asarray(_ids(spec, seq=48))
    seq = ids.shape[1] - 1

    def loss(model):
        logits = model(ids[:, :-1]).logits
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1).mean()

    # What the backward pass keeps, by shape only (traced, not run): the leaves of the vjp.
    saved = {}
    for remat in REMAT_POLICIES:
        graph, state = nnx.split(model_from_hf(spec, tensors, remat=remat))
        vjp = jax.eval_shape(lambda s, g=graph: jax.vjp(lambda s_: loss(nnx.merge(g, s_)), s)[1], state)
        saved[remat] = jax.tree.leaves(vjp)
    size = {remat: sum(math.prod(leaf.shape) for leaf in leaves) for remat, leaves in saved.items()}
    assert size["none"] > size["save_dots"] > size["block"]
    # No policy keeps float [.., S, S] attention probabilities: the blocked causal attention
    # saves its output and logsumexp and recomputes them in its backward.
    keeps_scores = {
        remat: any(leaf.shape[-2:] == (seq, seq) and jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves)
        for remat, leaves in saved.items()
    }
    assert keeps_scores == {"none": False, "block": False, "save_dots": False}

    grads = {
        remat: jax.tree.leaves(nnx.jit(nnx.grad(loss))(model_from_hf(spec, tensors, remat=remat)))
        for remat in ("none", "save_dots")
    }
    # Recomputation may fuse differently, so equal up to float32 rounding of the sums.
    for a, b in zip(grads["none"], grads["save_dots"], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    with pytest.raises(ValueError, match="remat='full'"):
        build_model(spec, remat="full")


def test_adapter_round_trip_is_exact():
    spec, model, _, _ = _built("tiny-gqa")
    tensors = to_hf(model, spec)
    assert {k: v.shape for k, v in tensors.items()} == hf_param_shapes(spec)
    other = build_model(spec, seed=7)
    load_hf(other, tensors)
    again = to_hf(other, spec)
    assert all(np.array_equal(tensors[k], again[k]) for k in tensors)


def _missing(t):
    del t["model.layers.2.mlp.up_proj.weight"]
    return "model.layers.2.mlp.up_proj.weight"


def _unexpected(t):
    t["model.layers.4.mlp.up_proj.weight"] = t["model.layers.3.mlp.up_proj.weight"]
    return "model.layers.4.mlp.up_proj.weight"


def _wrong_shape(t):
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:16]
    return "model.layers.1.self_attn.k_proj.weight"


def _vocab(t):
    t["model.embed_tokens.weight"] = np.zeros((50304, 64), np.float32)
    t["lm_head.weight"] = np.zeros((50304, 64), np.float32)
    return "vocab mismatch in 'model.embed_tokens.weight': checkpoint has 50304 rows"


@pytest.mark.parametrize("corrupt", [_missing, _unexpected, _wrong_shape, _vocab])
def test_adapter_rejects_bad_checkpoint_before_any_update(corrupt):
    spec, model, _, _ = _built("tiny-gqa")
    before = to_hf(model, spec)
    tensors = dict(before)
    expected_text = corrupt(tensors)
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf(model, tensors)
    message = str(err.value)
    assert expected_text in message and "\n" not in message
    after = to_hf(model, spec)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(CheckpointMismatchError):
        model_from_hf(spec, tensors)


def _vjp_leaves(f, *args):
    """What f's backward keeps (shapes and dtypes only, traced, not run)."""
    return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_and_swiglu_backward_keep_less_and_match_autodiff(dtype):
    """layers.rms_norm and layers.swiglu_down (imported through model) have their own VJPs so that the backward keeps x and
    1/rms (not two float32 copies of x), and g, u (not six [tokens, hidden] tensors): same
    gradients as autodiff of the plain formulas (float32: to rounding; the swiglu backward reuses
    autodiff's own arithmetic)."""
    from olmo_train_jax.layers import plain_rms_norm as plain_norm
    from olmo_train_jax.layers import plain_swiglu_down as plain_swiglu
    from olmo_train_jax.model import rms_norm, swiglu_down

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 24, 64)), dtype)
    w_norm = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    g, u = (jnp.asarray(rng.standard_normal((2, 24, 96)), dtype) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((96, 64)) / 10, dtype)
    dy = jnp.asarray(rng.standard_normal((2, 24, 64)), dtype)

    cases = [
        (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: plain_norm(x, w, 1e-6), (x, w_norm)),
        (swiglu_down, plain_swiglu, (g, u, w_down)),
    ]
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: the cotangents round to bf16 either way
    for ours, plain, args in cases:
        (y_a, vjp_a), (y_b, vjp_b) = jax.vjp(ours, *args), jax.vjp(plain, *args)
        np.testing.assert_array_equal(np.asarray(y_a, np.float32), np.asarray(y_b, np.float32))
        for a, b in zip(vjp_a(dy), vjp_b(dy), strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(a - b).max() <= tol * np.abs(b).max()

    norm_kept = _vjp_leaves(lambda x, w: rms_norm(x, w, 1e-6), x, w_norm)
    # x in its own dtype, the weight, one float32 1/rms per row; nothing of x's size in float32
    # beyond x itself when x is float32.
    assert sum(leaf.size for leaf in norm_kept) == x.size + w_norm.size + 2 * 24
    assert sum(leaf.size for leaf in _vjp_leaves(lambda x, w: plain_norm(x, w, 1e-6), x, w_norm)) >= 2 * x.size
    kept = _vjp_leaves(swiglu_down, g, u, w_down)
    assert sorted(leaf.size for leaf in kept) == sorted([g.size, u.size, w_down.size])
    assert sum(leaf.size for leaf in _vjp_leaves(plain_swiglu, g, u, w_down)) >= 3 * g.size + w_down.size
