"""``optim.sharded`` in the JAX trainer (MaxText's ``shard_optimizer_over_data``): the AdamW moments
of each tensor split over the data-parallel axes (``parallelize.state_shardings``) while the
parameters stay replicated; on 4 simulated CPU devices, fp32, in one process.

- optimizer-state bytes per device, measured from the arrays' shards, against the value written
  out below: a quarter of one device's moments for every tensor of 4096 elements or more, the
  whole of each smaller one, plus Adam's int32 count; for tiny on ``data=4`` and for tiny-moe on
  ``data=2, expert=2`` (dense moments over both axes; expert moments over ``data``, their
  ``expert`` split being the experts' own);
- 10 steps of the trainer's fused step on ``data=4`` with the sharded state follow one device
  within ``olmo_model.layout_loss_tolerance`` (4 devices reorder the fp32 sums);
- an Orbax checkpoint of the sharded state restores onto the replicated one and back, the
  same values (``checkpoint.load_checkpoint`` places each array with the target's sharding).

The device count must be set before JAX starts, so the measurements run in a subprocess (this
file run as a script) that prints them as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from olmo_model import layout_loss_tolerance

ROWS, SEQ, STEPS, LR = 8, 32, 10, 3e-3

# tiny: 738,368 parameters; under 4096 elements: the stacked norms (4 x 64 each for attn_norm,
# mlp_norm, q_norm, k_norm) and final_norm (64), 1,088 in all. Per device: mu and nu (4 bytes
# each) of a quarter of the other 737,280 and of all of those, plus the int32 count.
TINY_BYTES = 8 * (737_280 // 4 + 1_088) + 4
# tiny-moe: 1,035,328 parameters; under 4096 elements: the same norms and the stacked router
# (4 x 64 x 8 = 2,048), 3,136 in all.
MOE_BYTES = 8 * ((1_035_328 - 3_136) // 4 + 3_136) + 4


def _measure() -> dict:
    import tempfile
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from olmo_run.recipe import load_recipe
    from olmo_train_jax import parallelize
    from olmo_train_jax.checkpoint import STATE_DIR, abstract_like, load_checkpoint
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import for_mesh, step_functions

    assert jax.device_count() == 4, jax.devices()

    def prepared(model: str, axes: dict, sharded: bool, devices=None):
        recipe = load_recipe(None, [f"--model={model}", "--train.precision=fp32", f"--optim.sharded={sharded}"])
        spec = recipe.model_spec()
        mesh = parallelize.build_mesh(axes, devices)
        m = for_mesh(build_model(spec, seed=0, dtype=jnp.float32), spec, recipe, mesh)
        params = jax.device_put(m.params, m.params_sh)
        opt = jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)
        return recipe, spec, mesh, m, params, opt

    def device_bytes(tree) -> int:
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    out: dict = {}
    *_, opt = prepared("tiny", {"data": 4}, True)
    out["tiny_bytes"] = device_bytes(opt)
    *_, params, opt = prepared("tiny-moe", {"data": 2, "expert": 2}, True)
    out["moe_bytes"] = device_bytes(opt)
    out["moe_params_replicated"] = all(
        leaf.sharding.is_fully_replicated or "expert" in str(leaf.sharding.spec) for leaf in jax.tree.leaves(params)
    )

    def losses(axes: dict, sharded: bool, devices=None) -> list[float]:
        recipe, spec, mesh, m, params, opt = prepared("tiny", axes, sharded, devices)
        fns = step_functions(m, spec, recipe, mesh)
        got = []
        for step in range(1, STEPS + 1):
            rng = np.random.default_rng(step % 3)
            ids = rng.integers(2, 64, size=(1, ROWS, SEQ + 1)).astype(np.int32)
            batch = {"input_ids": ids[..., :-1], "labels": ids[..., 1:], "doc_ids": np.zeros_like(ids[..., 1:])}
            params, opt, stats = fns.fused(params, opt, batch, np.float32(LR), np.int32(step))
            got.append(float(stats["loss"]))
        return got

    out["one"] = losses({"data": 1}, False, jax.devices()[:1])
    out["four"] = losses({"data": 4}, True)

    _, _, _, m_sharded, params, opt = prepared("tiny", {"data": 4}, True)
    _, _, _, m_plain, _, _ = prepared("tiny", {"data": 4}, False)
    opt = jax.tree.map(lambda x: x + 1 if x.ndim else x + 3, opt)  # moments other than zeros
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        with ocp.StandardCheckpointer() as orbax:
            orbax.save(ckpt / STATE_DIR, {"params": params, "opt_state": opt, "step": 3})
        for name, m in (("plain", m_plain), ("sharded", m_sharded)):
            p2, o2, step = load_checkpoint(
                ckpt, abstract_like(m.params, m.params_sh), abstract_like(m.abstract_opt, m.opt_sh)
            )
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(o2))
            )
            placed = all(a.sharding == s for a, s in zip(jax.tree.leaves(o2), jax.tree.leaves(m.opt_sh)))
            out[f"restore_{name}"] = [same, placed, step, device_bytes(o2)]
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_moments_are_a_quarter_per_device(measured):
    assert TINY_BYTES == 1_483_268 and MOE_BYTES == 2_089_476
    assert measured["tiny_bytes"] == TINY_BYTES
    assert measured["moe_bytes"] == MOE_BYTES
    assert measured["moe_params_replicated"]  # the parameters keep their own placement


def test_sharded_state_follows_one_device_for_10_steps(measured):
    one, four = measured["one"], measured["four"]
    assert one[-1] < one[0] - 0.05, "the run does not learn"
    for step, (a, b) in enumerate(zip(one, four), start=1):
        assert abs(a - b) <= layout_loss_tolerance(a, ROWS * SEQ, step), (step, a, b)


def test_checkpoint_restores_onto_either_sharding(measured):
    full = 8 * 738_368 + 4  # the replicated moments and count on every device
    assert measured["restore_plain"] == [True, True, 3, full]
    assert measured["restore_sharded"] == [True, True, 3, TINY_BYTES]


if __name__ == "__main__":
    print(json.dumps(_measure()))
