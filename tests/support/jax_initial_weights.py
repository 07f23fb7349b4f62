"""Test-only: the JAX trainer's fresh parameters for a recipe, placed on its mesh as the trainer
places them (``train._initial_state`` without a run dir), gathered and written under HF names.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/support/jax_initial_weights.py \\
        OUT.npz [--key=value ...]
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from flax import nnx

from olmo_run.recipe import load_recipe
from olmo_train_jax import parallelize
from olmo_train_jax.checkpoint import abstract_like
from olmo_train_jax.hf_adapter import initial_params, to_hf
from olmo_train_jax.model import OlmoModel
from olmo_train_jax.step import for_mesh


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    recipe = load_recipe(None, overrides)
    spec = recipe.model_spec()
    mesh = parallelize.build_mesh(recipe.jax.mesh)
    model = nnx.eval_shape(lambda: OlmoModel(spec, rngs=nnx.Rngs(0)))
    prepared = for_mesh(model, spec, recipe, mesh)
    params = initial_params(spec, recipe.train.seed, abstract_like(prepared.params, prepared.params_sh))
    # Each parameter really is split over the devices as the trainer's shardings say.
    sharded = [p for p in jax.tree.leaves(params) if len(p.sharding.device_set) > 1 and not p.is_fully_replicated]
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, jax.device_get(params))
    np.savez(out, n_devices=len(jax.devices()), n_sharded=len(sharded), **to_hf(nnx.merge(graphdef, state), spec))


if __name__ == "__main__":
    main()
