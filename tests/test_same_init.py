"""Both trainers start from the same full weights for the same seed (``olmo_model.init``), whatever
their layout: the JAX trainer's fresh parameters on 1 device and sharded over 4 (FSDP; for the MoE
spec FSDP x expert axis), gathered, equal bit for bit the torch trainer's start-up on one process
(``initial_model``; its own tests show every torch layout gives the same)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_run.recipe import load_recipe

SCRIPT = Path(__file__).resolve().parent / "support" / "jax_initial_weights.py"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("devices", "overrides", "sharded"),
    [
        (1, ["--model=tiny"], False),
        (4, ["--model=tiny", "--jax.mesh.data=1", "--jax.mesh.fsdp=-1"], True),
        (4, ["--model=tiny-moe", "--jax.mesh.data=1", "--jax.mesh.fsdp=-1", "--jax.mesh.expert=2"], True),
    ],
)
def test_jax_trainer_starts_from_the_torch_trainers_weights(tmp_path, devices, overrides, sharded):
    from olmo_train_torch import initial_model, to_hf

    args = [*overrides, "--train.seed=23"]
    out = tmp_path / "jax.npz"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jax_weights = dict(np.load(out))
    assert int(jax_weights.pop("n_devices")) == devices
    assert (int(jax_weights.pop("n_sharded")) > 0) == sharded
    spec = load_recipe(None, args).model_spec()
    torch_weights = {k: v.numpy() for k, v in to_hf(initial_model(spec, seed=23), spec).items()}
    assert jax_weights.keys() == torch_weights.keys()
    for name, value in torch_weights.items():
        assert np.array_equal(jax_weights[name], value), name
