"""The shared recipe schema, dotted overrides, batch layout and run plumbing."""

import json
import math
from pathlib import Path

import pytest
import yaml

from olmo_model import get_preset
from olmo_run.checkpoints import commit_checkpoint, complete_checkpoints, prune_checkpoints, training_meta
from olmo_run.errors import TrainingStateError
from olmo_run.recipe import RecipeError, batch_layout, load_recipe
from olmo_run.resume import check_meta_fits
from olmo_run.spike_guard import SpikeGuard


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": "tiny",
                "optim": {"lr": 1e-3},
                "train": {"tokens": 10_000, "global_batch_tokens": 1024},
                "schedule": {"kind": "linear", "warmup_steps": 3},
            }
        )
    )
    r = load_recipe(path, ["--optim.weight_decay=0.05", "--train.seed", "7", "--model.sliding_window=16"])
    assert r.optim.lr == 1e-3 and r.optim.weight_decay == 0.05 and r.train.seed == 7
    # 10_000 tokens / 1024 per step, rounded up
    assert r.total_steps() == 10
    assert r.schedule.kind == "linear" and r.schedule.warmup_steps == 3
    spec = r.model_spec()
    assert spec.sliding_window == 16 and spec.d_model == 64
    # the default step budget gave way to the token budget
    assert r.train.steps is None


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe(None, ["--optim.lr=6e-4", "--schedule.kind=wsd", "--schedule.decay_fraction=0.2"])
    path = tmp_path / "resolved.yaml"
    path.write_text(r.to_yaml())
    assert load_recipe(path) == r


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--optim.lrr=1"], "unknown recipe key 'optim.lrr'; did you mean 'optim.lr'?"),
        (["--optimizer.lr=1"], "unknown recipe key 'optimizer'"),
        (["--optim.lr=abc"], "key 'optim.lr'"),
        (["--train.precision=fp8"], "key 'train.precision'"),
        (["--train.steps=10", "--train.tokens=100"], "exactly one of train.steps and train.tokens"),
        (["--model=nope"], "unknown preset 'nope'"),
        (["--jax.mesh.pipeline=2"], "unknown mesh axes"),
        (["--optim.lr"], "has no value"),
    ],
)
def test_bad_recipe_is_one_clear_line(overrides, needle):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_top_level_key_in_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("modle: tiny\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown recipe key 'modle'; did you mean 'model'\?"):
        load_recipe(path)


def test_batch_layout_keeps_global_batch():
    # 512 sequences on 512 devices, then on a quarter of them: per-device batch grows 4x.
    full = batch_layout(512, 512)
    quarter = batch_layout(512, 128)
    assert (full.per_device_batch, full.accumulation_steps) == (1, 1)
    assert (quarter.per_device_batch, quarter.accumulation_steps) == (4, 1)
    acc = batch_layout(512, 128, micro_batch_size=1)
    assert (acc.per_device_batch, acc.accumulation_steps) == (1, 4)
    for layout in (full, quarter, acc):
        assert layout.per_device_batch * layout.dp_size * layout.accumulation_steps == 512
    with pytest.raises(RecipeError, match="cannot be split over 6"):
        batch_layout(64, 6)
    with pytest.raises(RecipeError, match="micro_batch_size=3 does not divide"):
        batch_layout(64, 4, micro_batch_size=3)


def test_global_batch_tokens_must_be_multiple_of_sequence():
    r = load_recipe(None, ["--train.global_batch_tokens=1000"])
    with pytest.raises(RecipeError, match="multiple of 512"):
        r.global_batch_sequences(512)
    assert load_recipe(None).global_batch_sequences(512) == 16


def test_spike_guard_skips_far_outliers_only():
    g = SpikeGuard(enabled=True, window=50, sigma=6.0, min_history=20)
    # history: losses alternate 2.0 +- 0.1 (mean 2.0, std 0.1); grad norms 1.0 +- 0.05
    for i in range(40):
        sign = 1 if i % 2 else -1
        g.record(2.0 + 0.1 * sign, 1.0 + 0.05 * sign)
    assert not g.should_skip(2.5, 1.2)  # 5 sigma: kept
    assert g.should_skip(2.0 + 0.61, 1.0)  # loss 6.1 sigma above the mean
    assert g.should_skip(2.0, 1.0 + 0.31)  # grad norm 6.2 sigma above
    assert g.should_skip(math.nan, 1.0)
    assert not SpikeGuard(enabled=False).should_skip(1e9, 1e9)
    fresh = SpikeGuard(enabled=True, min_history=20)
    assert not fresh.should_skip(1e9, 1e9)  # no history yet: never skip
    restored = SpikeGuard(enabled=True, window=50, sigma=6.0, min_history=20)
    restored.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert restored.should_skip(2.61, 1.0) and not restored.should_skip(2.5, 1.2)


def test_each_trainer_has_its_own_default_run_dir_and_a_named_recipe_shares_one():
    default = load_recipe(None, [])
    assert default.run_dir is None  # as --print-recipe shows it
    assert default.for_framework("jax").resolved_run_dir() == Path("runs/default-jax")
    assert default.for_framework("torch").resolved_run_dir() == Path("runs/default-torch")
    # A named recipe keeps runs/<name> in either trainer: a curriculum stage's init.checkpoint
    # names the previous stage's run dir that way.
    named = load_recipe(None, ["--name=toy-stage1"])
    assert named.for_framework("jax").resolved_run_dir() == Path("runs/toy-stage1")
    assert named.for_framework("torch").resolved_run_dir() == Path("runs/toy-stage1")
    given = load_recipe(None, ["--run_dir=elsewhere/a"])
    assert given.for_framework("torch").resolved_run_dir() == Path("elsewhere/a")


def test_a_run_dir_of_the_other_trainer_is_named_with_the_fresh_run_first(tmp_path):
    spec = get_preset("tiny")
    run_dir = tmp_path / "runs" / "toy"
    ckpt = run_dir / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    commit_checkpoint(ckpt, training_meta("jax", 10, spec, load_recipe(None, ["--model=tiny"]), {"step": 10}))
    meta = json.loads((ckpt / "meta.json").read_text())
    with pytest.raises(TrainingStateError) as refused:
        check_meta_fits(meta, ckpt, spec, "torch")
    assert str(refused.value) == (
        f"{run_dir} holds a jax run (a jax checkpoint cannot be resumed by the torch trainer): for a new torch "
        f"run pass --run_dir={run_dir}-torch (or another --run_dir or --name); to continue that run in torch, "
        f"convert it with `olmo-convert jax-run:{run_dir} torch-run:{run_dir}-torch` and run "
        f"`olmo-train-torch {run_dir}-torch/recipe.yaml`"
    )


def test_checkpoint_meta_commit_and_checks(tmp_path):
    spec = get_preset("tiny")
    recipe = load_recipe(None, ["--model=tiny"])
    for step in (10, 20, 30):
        ckpt = tmp_path / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        commit_checkpoint(ckpt, training_meta("jax", step, spec, recipe, {"step": step}))
    # an interrupted save (no meta.json) never counts
    (tmp_path / "checkpoints" / "step_00000040").mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [10, 20, 30]
    prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20, 30]

    _, latest = complete_checkpoints(tmp_path)[-1]
    meta = json.loads((latest / "meta.json").read_text())
    check_meta_fits(meta, latest, spec, "jax")
    with pytest.raises(TrainingStateError, match="jax checkpoint cannot be resumed by the torch trainer"):
        check_meta_fits(meta, latest, spec, "torch")
    with pytest.raises(TrainingStateError, match="differs from the recipe's model in 'd_model'"):
        check_meta_fits(meta, latest, get_preset("small"), "jax")
