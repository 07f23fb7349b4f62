"""Mixed dense / MoE layer stacks in both trainers (fp32, CPU): the torch model's logits and aux
losses against the float64 numpy reference and its HF names round trip, and the two trainers
against each other on the same weights: logits, the routed token counts, the loss and every
parameter's gradient. The JAX model's own checks (scan plan, reference, expert parallelism,
checkpoints): packages/olmo-train-jax/tests/test_mixed_stacks.py.

    uv run --frozen pytest tests/test_moe_mixed_stacks.py -n 0 -q
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from olmo_model import FULL, SLIDING, fp32_mean_tolerance, get_preset, reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_MOE = get_preset("tiny-moe")
SEQ = 48  # longer than the window of 32: sliding and global layers both matter


def _mixed(name: str, moe_layers: tuple[int, ...], **changes):
    return TINY_MOE.replace(moe=TINY_MOE.moe.model_copy(update={"layers": moe_layers}), name=name, **changes)


# A dense first layer (OLMo-core 3's dense leading block), in the 3:1 pattern and with full
# attention everywhere, and dense layers in the middle of a (sliding, full) x 3 stack.
MIXED = {
    "dense-first": _mixed("dense-first", (1, 2, 3)),
    "dense-first-global": _mixed("dense-first-global", (1, 2, 3), sliding_window=None),
    "dense-middle": _mixed("dense-middle", (0, 1, 4, 5), n_layers=6, layer_types=(SLIDING, FULL) * 3),
}


@functools.cache
def _case(name: str):
    spec = MIXED[name]
    params = reference.init_params(spec, seed=21)
    rng = np.random.default_rng(22)
    ids = rng.integers(0, spec.vocab_size, (2, SEQ + 1))
    return spec, params, ids[:, :-1], ids[:, 1:]


def _torch_run(name: str):
    """(logits, token counts, loss, {HF name: gradient}) of the torch model."""
    import torch

    from olmo_train_torch import model_from_hf, to_hf
    from olmo_train_torch.moe import aux_loss, routing_stats

    spec, params, ids, labels = _case(name)
    model = model_from_hf(spec, params)
    out = model(torch.from_numpy(ids))
    stats = routing_stats(out.moe)
    flat = out.logits.float().reshape(-1, out.logits.shape[-1])
    lse = torch.logsumexp(flat, -1)
    ce = torch.nn.functional.cross_entropy(flat, torch.from_numpy(labels).reshape(-1))
    loss = ce + spec.z_loss_weight * (lse**2).mean() + aux_loss(stats, spec.moe)
    loss.backward()
    grads = to_hf({n: p.grad for n, p in model.named_parameters()}, spec)
    return (
        out.logits.detach().numpy(),
        stats.tokens_per_expert.numpy(),
        float(loss.detach()),
        {n: g.numpy() for n, g in grads.items()},
    )


def _jax_run(name: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from olmo_train_jax import model_from_hf, to_hf
    from olmo_train_jax.moe import aux_loss

    spec, params, ids, labels = _case(name)
    graphdef, state = nnx.split(model_from_hf(spec, params))

    def loss_fn(st):
        out = nnx.merge(graphdef, st)(jnp.asarray(ids))
        lse = jax.nn.logsumexp(out.logits, -1)
        picked = jnp.take_along_axis(out.logits, jnp.asarray(labels)[..., None], -1)[..., 0]
        loss = jnp.mean(lse - picked) + spec.z_loss_weight * jnp.mean(lse**2) + aux_loss(out.moe, spec.moe)
        return loss, out

    (loss, out), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state)
    hf_grads = to_hf(nnx.merge(graphdef, grads), spec)
    return np.asarray(out.logits), np.asarray(out.moe.tokens_per_expert), float(loss), hf_grads


@pytest.mark.parametrize("name", list(MIXED))
def test_torch_mixed_forward_matches_reference_and_round_trips(name):
    """The torch model against float64 numpy: logits within 1e-4, the bound of its all-MoE test
    (packages/olmo-train-torch/tests/test_moe.py) for the same widths and depth; aux losses
    (averaged over the MoE layers only) within 1e-5. to_hf gives back every tensor bit for bit."""
    import torch

    from olmo_train_torch import model_from_hf, to_hf
    from olmo_train_torch.moe import routing_stats

    spec, params, ids, _ = _case(name)
    model = model_from_hf(spec, params)
    with torch.no_grad():
        out = model(torch.from_numpy(ids))
    ref_logits, ref_aux = reference.forward_with_aux(spec, params, ids)
    assert np.abs(out.logits.double().numpy() - ref_logits).max() <= 1e-4
    stats = routing_stats(out.moe)
    assert len(out.moe) == len(spec.moe.layers)
    assert abs(float(stats.load_balancing) - ref_aux["load_balancing_loss"]) < 1e-5
    assert abs(float(stats.router_z) - ref_aux["router_z_loss"]) < 1e-5
    back = to_hf(model, spec)
    assert list(back) == list(params)
    for n in params:
        np.testing.assert_array_equal(back[n].numpy(), params[n], err_msg=n)


# Two runs (OLMo-core's shape) and three with rows offset in both stacks; the one-run mixed
# repeat of dense-first is checked against the reference forward in both trainers above and in
# test_mixed_stacks.py (a JAX gradient compile per spec is the cost of each case).
@pytest.mark.parametrize("name", ["dense-first-global", "dense-middle"])
def test_jax_and_torch_agree_on_mixed_stacks(name):
    """The twins on the same weights and tokens: the same experts chosen (token counts equal);
    logits within 1e-5 (each model is within 6.2e-7 of the float64 reference,
    test_mixed_stacks.py; measured 7.2e-7 apart); the loss within ``fp32_mean_tolerance`` of its
    96 token losses (1.4e-5; measured at most 1.9e-6); each parameter's gradient within 1e-4 of
    its largest element (measured at most 3.1e-6 of it: fp32 rounding of two backwards summing in
    other orders). A gradient sent to the wrong row of a stack, or a dense layer's MLP left out,
    is off by O(1) of the largest element."""
    j_logits, j_counts, j_loss, j_grads = _jax_run(name)
    t_logits, t_counts, t_loss, t_grads = _torch_run(name)
    np.testing.assert_array_equal(j_counts, t_counts)
    assert np.abs(j_logits - t_logits).max() <= 1e-5
    assert abs(j_loss - t_loss) <= fp32_mean_tolerance(t_loss, j_logits.shape[0] * j_logits.shape[1])
    assert list(j_grads) == list(t_grads)
    for n, g in t_grads.items():
        scale = np.abs(g).max()
        assert scale > 0, n  # every parameter, dense and MoE, gets a gradient
        assert np.abs(j_grads[n] - g).max() <= 1e-4 * scale, n
