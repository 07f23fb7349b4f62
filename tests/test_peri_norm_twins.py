"""OLMo-core 3's peri-norm blocks and scaled, normalised embedding (``norm_placement: peri``,
``embedding_scale``, ``embedding_norm``) through both trainers' whole model: ``tiny-olmoe3`` (t001 at
test size, which uses both) against the float64 numpy reference, and both HF adapters' names for the
new weights (each one lands where the model reads it, and back).

    uv run --frozen pytest tests/test_peri_norm_twins.py -n 0 -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from olmo_model import get_preset, reference
from olmo_train_jax import model_from_hf as jax_model_from_hf
from olmo_train_jax.hf_adapter import to_hf as jax_to_hf
from olmo_train_torch import model_from_hf as torch_model_from_hf
from olmo_train_torch.hf_adapter import to_hf as torch_to_hf

TINY = get_preset("tiny-olmoe3")
# Logits of size ~1 in fp32 through four blocks and a 4096-wide head against float64: the bound of
# tests/test_moe_router_scale.py (the trainers' MoE tests' bound), which this twin of it shares;
# measured 1.9e-7 (torch) and 1.5e-7 (JAX) on an Intel Xeon host, |logits| up to 0.34.
LOGIT_TOL = 1e-4
NEW = ("model.embed_norm.weight", "input_layernorm.weight", "pre_feedforward_layernorm.weight")


@pytest.fixture(scope="module")
def case():
    """tiny-olmoe3's weights with every norm weight 1 +- 0.3 (so a norm mapped to another's slot,
    or an input norm used as an output norm, shows) and token ids past the window-free length."""
    assert TINY.norm_placement == "peri" and TINY.embedding_norm and TINY.embedding_scale == 8.0
    params = reference.init_params(TINY, seed=6)
    rng = np.random.default_rng(7)
    for name, value in params.items():
        if value.ndim == 1:
            params[name] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
    ids = rng.integers(0, TINY.vocab_size, size=(2, 24))
    return params, ids, reference.forward(TINY, params, ids)


def test_torch_model_matches_the_reference(case):
    params, ids, want = case
    model = torch_model_from_hf(TINY, params).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).logits.double().numpy()
    assert np.abs(got - want).max() <= LOGIT_TOL
    back = torch_to_hf(model, TINY)
    for name in params:
        if name.endswith(NEW):
            np.testing.assert_array_equal(back[name].numpy(), params[name])


def test_jax_model_matches_the_reference(case):
    params, ids, want = case
    model = jax_model_from_hf(TINY, params)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(jnp.asarray(ids, jnp.int32)).logits, np.float64)
    assert np.abs(got - want).max() <= LOGIT_TOL
    back = jax_to_hf(model, TINY)
    for name in params:
        if name.endswith(NEW):
            np.testing.assert_array_equal(np.asarray(back[name]), params[name])


def test_the_options_change_the_logits(case):
    """Each option moves the reference's logits by far more than the bound, so the two tests above
    check them: the input norms and the embedding norm left out (same other weights)."""
    params, ids, want = case
    reordered = {k: v for k, v in params.items() if not k.endswith(NEW[1:])}
    off = reference.forward(TINY.replace(norm_placement="reordered"), reordered, ids)
    assert np.abs(off - want).max() > 100 * LOGIT_TOL
    plain = {k: v for k, v in params.items() if k != NEW[0]}
    off = reference.forward(TINY.replace(embedding_norm=False, embedding_scale=None), plain, ids)
    assert np.abs(off - want).max() > 100 * LOGIT_TOL
