"""No device-to-host read in a JAX training step except where the driver reads (issue 36): the
real entry point in this process (driver, loop, callbacks, module), one CPU device, fp32, on the
embedded sample mixture, dense (``tiny``) and MoE (``tiny-moe``), with ``log.every`` 3 and the
spike guard on (its decision and history on the device, ``step.guarded_update``).

From the start of a non-log step's ``train_step`` to the start of the next step's, every read
of a ``jax.Array``'s value to the host (``float``, ``int``, ``bool``, ``item``, ``tolist``,
``np.asarray``, ``jax.device_get``: all go through ``ArrayImpl._value``) raises and is noted,
and so does a call of ``jax.device_get``; none may happen. (``jax.transfer_guard`` cannot
see them here: on the CPU backend an array already is host memory.)

A ``log.every`` 3 run logs at steps 3 and 6 exactly the figures a ``log.every`` 1 run logs
there, skipped steps included (an LR that makes the hair-trigger guard skip some of them), and
the ``log.every`` 1 run's figures are, bitwise, those of the steps run as the trainer ran them
before: the gradients' program, each figure read with ``float``, ``SpikeGuard.decide`` on the
host and the update's own program (``apply_update``) only for an accepted step.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.array import ArrayImpl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_model.moe import MOE_KEYS
from olmo_run import read_inputs
from olmo_run.recipe import load_recipe
from olmo_run.spike_guard import SpikeGuard
from olmo_train_jax import parallelize
from olmo_train_jax.checkpoint import abstract_like
from olmo_train_jax.cli import main
from olmo_train_jax.hf_adapter import initial_params
from olmo_train_jax.model import build_model
from olmo_train_jax.moe import moe_metrics
from olmo_train_jax.step import BATCH_KEYS, apply_update, for_mesh, step_functions
from olmo_train_jax.train import JaxTrainModule

STEPS = 6
FIGURES = ("loss", "ce_loss", "z_loss", "grad_norm", "skipped")
GUARD = ["--optim.lr=0.3", "--spike_guard.enabled=true", "--spike_guard.min_history=2", "--spike_guard.sigma=1e-6"]


def args(model: str, run_dir: Path, every: int) -> list[str]:
    return [
        f"--model={model}",
        "--train.sequence_length=64",
        "--train.global_batch_tokens=512",
        f"--train.steps={STEPS}",
        "--train.precision=fp32",
        f"--log.every={every}",
        f"--checkpoint.every={STEPS}",
        f"--eval.every={STEPS}",
        "--log.progress=false",
        f"--run_dir={run_dir}",
        *GUARD,
    ]


def reference_lines(model: str) -> dict[int, dict]:
    """The steps as the trainer ran them before this change (see the module docstring)."""
    recipe = load_recipe(None, args(model, Path("unused"), 1))
    inputs = read_inputs(recipe)
    spec, layout = inputs.spec, inputs.batch_layout(1)
    mesh = parallelize.build_mesh(recipe.jax.mesh)
    make = partial(build_model, spec, seed=recipe.train.seed, dtype=jnp.float32, remat=recipe.jax.remat)
    m = for_mesh(nnx.eval_shape(partial(make, attention=recipe.jax.attention)), spec, recipe, mesh)
    params = initial_params(spec, recipe.train.seed, abstract_like(m.params, m.params_sh))
    opt_state = jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)
    fns = step_functions(m, spec, recipe, mesh)
    replicated = NamedSharding(mesh, P())
    update = jax.jit(
        partial(apply_update, tx=m.tx, clip=recipe.optim.grad_clip),
        in_shardings=(m.params_sh, m.opt_sh, m.params_sh, replicated, replicated),
        out_shardings=(m.params_sh, m.opt_sh),
        donate_argnums=(0, 1),
    )
    guard, out = SpikeGuard.from_recipe(recipe), {}
    for s in range(1, STEPS + 1):
        rows = inputs.mixture.order.global_batch(s - 1, layout.global_batch)
        batch = {
            k: parallelize.global_batch_array(rows[k], mesh, layout.accumulation_steps, layout.global_batch)
            for k in BATCH_KEYS
        }
        grads, stats = fns.grads(params, batch, np.int32(s))
        line = {k: float(stats[k]) for k in ("loss", "ce_loss", "z_loss", "grad_norm")}
        line["skipped"] = guard.decide(s, line["loss"], line["grad_norm"])
        if not line["skipped"]:
            lr = recipe.schedule.lr(s, recipe.optim.lr, STEPS)
            params, opt_state = update(params, opt_state, grads, stats["grad_norm"], np.float32(lr))
        if "moe" in stats:
            line.update(moe_metrics(stats["moe"], ep_size=1))
        out[s] = line
    return out


def train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == "train"}


@pytest.fixture
def trapped(monkeypatch):
    """Trap reads of array values and device_get calls on the steps that are not multiples of
    ``log_every`` (its value in the dict returned, with the reads seen)."""
    seen: list[str] = []
    armed = [False]
    state = {"seen": seen, "log_every": 3}
    value = ArrayImpl._value

    def guarded_value(self):
        if armed[0]:
            caller = sys._getframe(1)
            seen.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            raise AssertionError("host read of a jax.Array on a non-log step")
        return value.fget(self)

    monkeypatch.setattr(ArrayImpl, "_value", property(guarded_value))
    device_get = jax.device_get

    def guarded_get(x):
        if armed[0]:
            seen.append("jax.device_get")
            raise AssertionError("jax.device_get on a non-log step")
        return device_get(x)

    monkeypatch.setattr(jax, "device_get", guarded_get)
    step = JaxTrainModule.train_step

    def marked(self, batch, n, lr, guard, metrics):
        armed[0] = n % state["log_every"] != 0
        return step(self, batch, n, lr, guard, metrics)

    monkeypatch.setattr(JaxTrainModule, "train_step", marked)
    yield state
    armed[0] = False


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_non_log_steps_read_nothing_and_train_lines_keep_todays_numbers(model, trapped, tmp_path):
    assert main(args(model, tmp_path / "every3", 3)) == 0
    assert trapped["seen"] == []
    every3 = train_lines(tmp_path / "every3")
    assert sorted(every3) == [3, 6]
    trapped["log_every"] = 1  # every step reads
    assert main(args(model, tmp_path / "every1", 1)) == 0
    every1 = train_lines(tmp_path / "every1")
    assert any(r["skipped"] for r in every1.values()) and not all(r["skipped"] for r in every1.values())
    keys = FIGURES + (MOE_KEYS if model == "tiny-moe" else ())
    for s, line in every3.items():
        assert {k: line[k] for k in keys} == {k: every1[s][k] for k in keys}, s
    want = reference_lines(model)
    for s, line in every1.items():
        assert {k: line[k] for k in keys} == {k: want[s][k] for k in keys}, s
