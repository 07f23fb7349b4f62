"""Both trainers train OLMo-core 3's ``olmoe3-t001`` at test size (preset ``tiny-olmoe3``: its dense
leading block, GQA 4:1, per-head QK-norm, full attention, the top-4 router weights renormalised
and scaled back by k) on the embedded sample mixture, and stay twins within the bound
``olmo-parity train`` holds the dense twins to (per-step |loss difference| <= 1e-4, held-out
losses likewise, relative grad-norm difference <= 1e-4: tools/tests/test_train_parity.py).

The issue asks for the olmo-parity comparison; ``olmo-parity train`` itself cannot run an MoE
spec (it exports the shared start as an Olmo3 HF folder, which has no MoE layout, and OLMoE's
cannot hold restore_weight_scale), so both runs start from their own fresh weights instead,
which are the same: each trainer draws ``olmo_model.init`` for ``train.seed``
(tests/test_same_init.py), checked here by both step-1 losses against the float64 numpy
reference on those weights. The runs are compared with olmo-parity's own ``compare_runs`` and
``check_thresholds``. Each trainer's real entry point runs in this process, one after the other.

    uv run --frozen pytest tests/test_olmoe3_twins.py -n 0 -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from olmo_model import fp32_mean_tolerance, get_preset, hf_param_shapes, reference
from olmo_model.init import init_values
from olmo_tools.train_parity import check_thresholds, compare_runs

STEPS = 10
SEQ, ROWS = 64, 8
SEED = 7
RECIPE = [
    "--model=tiny-olmoe3",
    f"--train.sequence_length={SEQ}",
    f"--train.global_batch_tokens={SEQ * ROWS}",
    f"--train.steps={STEPS}",
    f"--train.seed={SEED}",
    "--train.precision=fp32",
    # lr 1e-3, as olmo-parity's acceptance run (at the toy default 3e-3 tiny models train at the
    # edge of stability and rounding differences grow: tools/README.md, "Parity").
    "--optim.lr=1e-3",
    f"--eval.every={STEPS}",
    "--log.every=1",
    "--log.progress=false",
    f"--checkpoint.every={STEPS}",
    "--checkpoint.async_save=false",
    "--torch.parallel=none",
]
# olmo-parity train's bound for the twins (tools/tests/test_train_parity.py).
PARITY_LOSS_DIFF = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_helpers) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("olmoe3-twins")
    for framework in ("torch", "jax"):
        run_helpers.train(framework, [*RECIPE, f"--run_dir={out / framework}"])
    return out / "torch", out / "jax"


def test_tiny_olmoe3_is_t001_at_test_size():
    """The architecture the issue names, shrunk: what the test below trains."""
    spec, t001 = get_preset("tiny-olmoe3"), get_preset("olmoe3-t001")
    assert spec.moe is not None and t001.moe is not None
    assert spec.moe.layers == tuple(range(1, spec.n_layers))  # one dense leading block, as t001
    assert t001.moe.layers == tuple(range(1, t001.n_layers))
    for field in ("qk_norm", "sliding_window", "norm_placement"):
        assert getattr(spec, field) == getattr(t001, field), field
    assert spec.n_heads // spec.kv_heads == t001.n_heads // t001.kv_heads == 4
    for field in ("top_k", "n_shared_experts", "gating", "normalize_top_k", "restore_weight_scale"):
        assert getattr(spec.moe, field) == getattr(t001.moe, field), field
    # The dense block's hidden is top_k x expert_hidden + shared hidden in both.
    for s in (spec, t001):
        assert s.mlp_hidden == s.moe.top_k * s.moe.expert_hidden + s.moe.shared_hidden


def test_twins_train_tiny_olmoe3_within_the_parity_bound(runs):
    """Measured: the losses at most 2.5e-6 apart over the 10 steps, the held-out losses 4.8e-7,
    the grad norms 2.1e-5 relative (the dense twins' 50 steps: 1.5e-5)."""
    result = compare_runs(*runs, STEPS)
    failures = check_thresholds(
        result, max_loss_diff=PARITY_LOSS_DIFF, max_grad_norm_diff=None, max_eval_diff=PARITY_LOSS_DIFF
    )
    assert failures == [], (failures, result["loss_torch"], result["loss_jax"])
    assert result["max_rel_grad_norm_diff"] <= 1e-4
    assert set(result["held_out"]) == {"code", "prose"}
    # A real curve, not a flat line: ln 4096 = 8.32 at the start, 0.15 lower after the ten steps
    # of the default warmup.
    assert result["loss_torch"][0] > 8.0 and result["loss_torch"][-1] < result["loss_torch"][0] - 0.1


def test_both_start_from_olmo_model_init(runs, run_helpers):
    """Step 1's loss (ce + z-loss + the MoE aux losses) is the numpy reference's on the weights
    ``olmo_model.init`` draws for the seed and global batch 0 of the sample mixture, within the
    rounding of an fp32 mean of its token losses against float64."""
    spec = get_preset("tiny-olmoe3")
    result = compare_runs(*runs, STEPS)
    params = {name: init_values(spec, SEED, name) for name in hf_param_shapes(spec)}
    batch = run_helpers.sample_batch(SEQ, ROWS)
    want = reference.loss(spec, params, batch["input_ids"], batch["labels"])["total"]
    tol = fp32_mean_tolerance(want, int(np.sum(batch["labels"] != -100)), both_fp32=False)
    assert result["loss_torch"][0] == pytest.approx(want, abs=tol)
    assert result["loss_jax"][0] == pytest.approx(want, abs=tol)
