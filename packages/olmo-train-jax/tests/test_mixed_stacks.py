"""Mixed dense / MoE layer stacks in the JAX model (``layer_stacks``): the scan plan against runs
derived by hand, the forward of three mixed specs against the float64 numpy reference (fp32),
the HF names' rows in each stack and their round trip; in a 4-device subprocess, the trainer's
step on an fsdp 2 x expert 2 mesh against the all-local data 4 run for 3 AdamW steps, the
initial weights drawn per shard (``hf_adapter.initial_params``), and a checkpoint written from
the expert-split layout and read back onto the data-parallel one. JAX against torch on the same
mixed specs: tests/test_moe_mixed_stacks.py (repository root).

    uv run --frozen pytest packages/olmo-train-jax/tests/test_mixed_stacks.py -n 0 -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from olmo_model import FULL, SLIDING, get_preset, layout_loss_tolerance, reference
from olmo_train_jax import model_from_hf, to_hf
from olmo_train_jax.layer_stacks import LayerRun, layer_runs, mlp_row

TINY_MOE = get_preset("tiny-moe")
ROWS, SEQ, STEPS = 4, 48, 3  # the subprocess's batch and steps


def _mixed(name: str, moe_layers: tuple[int, ...], **changes):
    return TINY_MOE.replace(moe=TINY_MOE.moe.model_copy(update={"layers": moe_layers}), name=name, **changes)


# Dense layer 0 then MoE, in Olmo 3's 3 sliding : 1 global pattern (one repeat of 4 layers
# holding both kinds); the same with full attention everywhere (OLMo-core 3's shape: a dense
# run, then an MoE run of 3 repeats); and dense layers in the middle of (sliding, full) x 3.
MIXED = {
    "dense-first": _mixed("dense-first", (1, 2, 3)),
    "dense-first-global": _mixed("dense-first-global", (1, 2, 3), sliding_window=None),
    "dense-middle": _mixed("dense-middle", (0, 1, 4, 5), n_layers=6, layer_types=(SLIDING, FULL) * 3),
}


def test_layer_runs_by_hand():
    F, T = False, True
    assert layer_runs(MIXED["dense-first"]) == (LayerRun(0, 4, 1, (F, T, T, T), 0, 0),)
    assert layer_runs(MIXED["dense-first-global"]) == (LayerRun(0, 1, 1, (F,), 0, 0), LayerRun(1, 1, 3, (T,), 1, 0))
    assert layer_runs(MIXED["dense-middle"]) == (
        LayerRun(0, 2, 1, (T, T), 0, 0),
        LayerRun(2, 2, 1, (F, F), 0, 2),
        LayerRun(4, 2, 1, (T, T), 2, 2),
    )
    # One run, as before mixed stacks: a dense model, an all-MoE one, an MoE layer every other layer.
    assert layer_runs(get_preset("olmo3-7b")) == (LayerRun(0, 4, 8, (F, F, F, F), 0, 0),)
    assert layer_runs(TINY_MOE) == (LayerRun(0, 4, 1, (T, T, T, T), 0, 0),)
    alternate = _mixed("alternate", (1, 3, 5, 7), n_layers=8)
    assert layer_runs(alternate) == (LayerRun(0, 4, 2, (F, T, F, T), 0, 0),)
    # 32 layers in the 3:1 pattern with 2 dense leading blocks: the MoE layers scan over 7 repeats
    # of 4 although the MoE stretch (30 layers) is no multiple of 4; 8 layers traced in all.
    deep = _mixed("deep", tuple(range(2, 32)), n_layers=32)
    assert layer_runs(deep) == (LayerRun(0, 4, 1, (F, F, T, T), 0, 0), LayerRun(4, 4, 7, (T, T, T, T), 2, 2))
    # OLMo-core's Ultra shape (63 layers, 2 dense, full attention): two runs whatever the depth.
    ultra = _mixed("ultra", tuple(range(2, 63)), n_layers=63, sliding_window=None)
    assert layer_runs(ultra) == (LayerRun(0, 1, 2, (F,), 0, 0), LayerRun(2, 1, 61, (T,), 2, 0))
    assert [mlp_row(MIXED["dense-middle"], i) for i in range(6)] == [0, 1, 0, 1, 2, 3]


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_forward_matches_numpy_reference(name):
    """fp32 against float64: the logits bound is test_moe.py's for the all-MoE tiny-moe, 1e-4 (logits
    of size ~1 after 4-6 fp32 layers of width 64-192; measured at most 6.2e-7 on all three); the aux
    losses average the MoE layers only (rel 1e-5, their fp32 sums of 96 tokens x 8 experts)."""
    spec = MIXED[name]
    params = reference.init_params(spec, seed=7)
    ids = np.random.default_rng(8).integers(0, spec.vocab_size, (2, SEQ)).astype(np.int32)
    out = nnx.jit(lambda m, x: m(x))(model_from_hf(spec, params), ids)
    ref_logits, ref_aux = reference.forward_with_aux(spec, params, ids)
    assert np.abs(np.asarray(out.logits) - ref_logits).max() <= 1e-4
    assert float(out.moe.load_balancing) == pytest.approx(ref_aux["load_balancing_loss"], rel=1e-5)
    assert float(out.moe.router_z) == pytest.approx(ref_aux["router_z_loss"], rel=1e-5)
    n_moe = len(spec.moe.layers)
    assert int(out.moe.tokens_per_expert.sum()) == n_moe * ids.size * spec.moe.top_k
    assert int(out.moe.dropped) == 0


def test_mixed_hf_rows_and_round_trip():
    """Each MLP kind's stack holds its own layers in depth order: dense-middle's layer 4 is row 2 of
    the MoE stack, layer 3 row 1 of the dense stack; to_hf gives back every tensor bit for bit."""
    for spec in MIXED.values():
        params = reference.init_params(spec, seed=11)
        model = model_from_hf(spec, params)
        n_moe = len(spec.moe.layers)
        assert model.layers.router.shape[0] == n_moe and model.layers.gate_proj.shape[0] == spec.n_layers - n_moe
        assert model.layers.q_proj.shape[0] == spec.n_layers
        back = to_hf(model, spec)
        assert list(back) == list(params)
        for n in params:
            np.testing.assert_array_equal(back[n], params[n], err_msg=f"{spec.name}: {n}")
    spec = MIXED["dense-middle"]
    params = reference.init_params(spec, seed=11)
    w = model_from_hf(spec, params).layers
    np.testing.assert_array_equal(w.router[2], params["model.layers.4.mlp.gate.weight"].T)
    np.testing.assert_array_equal(w.expert_up_proj[3, 5], params["model.layers.5.mlp.experts.5.up_proj.weight"].T)
    np.testing.assert_array_equal(w.down_proj[1], params["model.layers.3.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(w.q_proj[3], params["model.layers.3.self_attn.q_proj.weight"].T)


def test_build_model_shapes_follow_the_stacks():
    """The framework's own random init (abstract: nothing is drawn) has the adapter's shapes."""
    from olmo_train_jax.model import build_model

    spec = MIXED["dense-middle"]
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(spec)))
    loaded = nnx.state(model_from_hf(spec, reference.init_params(spec)))
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, loaded)


def _measure() -> dict:
    """The subprocess's part (4 simulated devices): losses, counts, and the checks of the initial
    weights and of the checkpoint round trip, as JSON."""
    import tempfile
    from pathlib import Path

    from olmo_model.init import init_values
    from olmo_run.checkpoints import checkpoint_dir
    from olmo_run.recipe import load_recipe
    from olmo_train_jax import parallelize
    from olmo_train_jax.checkpoint import Checkpointer, abstract_like, load_checkpoint
    from olmo_train_jax.hf_adapter import initial_params
    from olmo_train_jax.step import for_mesh, step_functions

    assert jax.device_count() == 4, jax.devices()
    spec = MIXED["dense-middle"]
    params0 = reference.init_params(spec, seed=3)
    recipe = load_recipe(None, ["--train.precision=fp32", "--optim.lr=1e-3"])

    def batch(step: int) -> dict[str, np.ndarray]:
        # A learnable stream (arithmetic progressions), one document per row.
        rng = np.random.default_rng(step)
        ids = (rng.integers(0, 4000, (ROWS, 1)) + rng.integers(1, 9, (ROWS, 1)) * np.arange(SEQ + 1)) % 4000 + 2
        ids = ids.astype(np.int32)
        return {
            "input_ids": ids[None, :, :-1],
            "labels": ids[None, :, 1:],
            "doc_ids": np.zeros((1, ROWS, SEQ), np.int32),
        }

    def prepared(axes: dict[str, int]):
        mesh = parallelize.build_mesh(axes)
        m = for_mesh(model_from_hf(spec, params0), spec, recipe, mesh)
        return m, step_functions(m, spec, recipe, mesh)

    out: dict = {}
    runs = {}
    for name, axes in (("local", {"data": 4}), ("ep", {"fsdp": 2, "expert": 2})):
        m, fns = prepared(axes)
        params = jax.device_put(m.params, m.params_sh)
        opt = jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)
        losses, counts = [], []
        for step in range(1, STEPS + 1):
            params, opt, stats = fns.fused(params, opt, batch(step), np.float32(1e-3), np.int32(step))
            losses.append(float(stats["loss"]))
            counts.append(np.asarray(stats["moe"].tokens_per_expert).tolist())
        out[name] = {
            "losses": losses,
            "counts": counts,
            "experts_split": str(m.params_sh["layers"]["expert_up_proj"].spec),
        }
        runs[name] = (m, params, opt)

    # Initial weights drawn per shard on the expert-split layout = olmo_model.init's tensors.
    m_ep = runs["ep"][0]
    drawn = initial_params(spec, 5, abstract_like(m_ep.params, m_ep.params_sh))
    want = nnx.to_pure_dict(nnx.state(model_from_hf(spec, {n: init_values(spec, 5, n) for n in params0})))
    out["initial_max_diff"] = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(want))
    )

    # A checkpoint of the expert-split state read back onto the data-parallel layout.
    m_local, _, _ = runs["local"]
    _, params_ep, opt_ep = runs["ep"]
    with tempfile.TemporaryDirectory() as tmp:
        writer = Checkpointer(Path(tmp), keep=2, async_save=False)
        writer.save(STEPS, params_ep, opt_ep, {"step": STEPS})
        writer.close()
        params, opt, saved = load_checkpoint(
            checkpoint_dir(Path(tmp), STEPS),
            abstract_like(m_local.params, m_local.params_sh),
            abstract_like(m_local.abstract_opt, m_local.opt_sh),
        )
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), (params, opt), (params_ep, opt_ep)
    )
    out["checkpoint"] = {"step": saved, "all_equal": all(jax.tree.leaves(same))}
    out["checkpoint_sharding"] = str(params["layers"]["expert_up_proj"].sharding.spec)
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    """The device count must be set before JAX starts: this file runs as a script in a
    subprocess with 4 simulated CPU devices (one compile per layout, ~30 s)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_expert_parallel_mixed_stack_follows_local(measured):
    """fsdp 2 x expert 2 against data 4 (every device all experts): the same steps within
    ``layout_loss_tolerance`` (4 rows of 48 next-token losses), the same expert counts."""
    local, ep = measured["local"], measured["ep"]
    assert "expert" in ep["experts_split"] and "expert" not in local["experts_split"]
    for s in range(1, STEPS + 1):
        a, b = local["losses"][s - 1], ep["losses"][s - 1]
        assert abs(a - b) <= layout_loss_tolerance(a, ROWS * SEQ, s), (s, local["losses"], ep["losses"])
    assert local["counts"] == ep["counts"]
    # 4 MoE layers x 192 tokens x top-4 per step, all dropless.
    assert [sum(c) for c in ep["counts"]] == [4 * ROWS * SEQ * TINY_MOE.moe.top_k] * STEPS


def test_initial_params_per_shard_match_olmo_model_init(measured):
    assert measured["initial_max_diff"] == 0.0


def test_checkpoint_of_mixed_stack_restores_onto_another_layout(measured):
    assert measured["checkpoint"] == {"step": STEPS, "all_equal": True}
    assert "expert" not in measured["checkpoint_sharding"]


if __name__ == "__main__":
    print(json.dumps(_measure()))
