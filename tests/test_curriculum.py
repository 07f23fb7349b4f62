"""The Olmo 3 curriculum at toy scale (issue 9 item 2), end to end in either trainer.

recipes/toy/stage1.yaml -> stage2.yaml (init from stage 1's latest checkpoint, weights only,
linear anneal) -> stage3.yaml (sequence 128 instead of 64, YaRN on the global layers), run
exactly as written (from a scratch working dir, so their ``runs/...`` paths resolve there).

- Stage 2 really starts from stage 1's weights: its step-1 loss equals transformers'
  Olmo3ForCausalLM loss of stage 1's final weights on stage 2's first batch, far below a fresh
  model's ln(4096) = 8.32.
- Stage 3 really uses YaRN: the run's spec has it, its step-1 loss is transformers' loss with the
  same YaRN rope parameters, and the trained model's logits in the trainer's framework equal
  transformers' YaRN logits, which differ from plain RoPE's beyond the original 64 tokens.
- Weights only means a fresh AdamW (its step count restarts); init.load_optimizer carries it on.
The framework-neutral resolution of ``init.checkpoint`` (olmo_run.init_source) is tested
directly at the end.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import Olmo3Config, Olmo3ForCausalLM

from olmo_model import ModelSpec, hf_config, load_spec
from olmo_run.checkpoints import checkpoint_dir, commit_checkpoint, training_meta
from olmo_run.errors import TrainingStateError
from olmo_run.init_source import resolve_checkpoint, resolve_init
from olmo_run.metrics import read_metrics
from olmo_run.recipe import load_recipe
from olmo_tools.train_state import read_training_state

transformers.logging.set_verbosity_error()  # YaRN factor != max_pos / original context warns; intended

TOY = Path(__file__).resolve().parents[1] / "recipes" / "toy"
RUN_ARGS = ["--log.progress=false", "--torch.parallel=none", "--checkpoint.async_save=false"]
# The fixtures (one_torch_thread, run_helpers) live in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["torch", "jax"])
def curriculum(request, tmp_path_factory, run_helpers):
    """All three stages in one trainer, run from a scratch working dir; yields (framework, root)."""
    framework = request.param
    root = tmp_path_factory.mktemp(f"curriculum-{framework}")
    here = Path.cwd()
    os.chdir(root)
    try:
        for stage in (1, 2, 3):
            run_helpers.train(framework, [str(TOY / f"stage{stage}.yaml"), *RUN_ARGS])
        # Stage 2 again for 2 steps, taking stage 1's AdamW state too.
        run_helpers.train(
            framework,
            [
                str(TOY / "stage2.yaml"),
                *RUN_ARGS,
                "--init.load_optimizer=true",
                "--train.steps=2",
                "--run_dir=runs/stage2-with-optimizer",
            ],
        )
    finally:
        os.chdir(here)
    yield framework, root


def first_loss(run: Path) -> float:
    return next(r["loss"] for r in read_metrics(run) if r["kind"] == "train" and r["step"] == 1)


def reference_model(spec, params: dict[str, np.ndarray]) -> Olmo3ForCausalLM:
    cfg = Olmo3Config(**hf_config(spec))
    cfg._attn_implementation = "eager"
    model = Olmo3ForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)
    return model


def reference_logits(model: Olmo3ForCausalLM, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.from_numpy(batch["input_ids"].astype(np.int64))).logits.double()


def test_stage2_starts_from_stage1_weights(curriculum, run_helpers):
    framework, root = curriculum
    stage1 = read_training_state(f"{framework}-run:{root / 'runs/toy-stage1'}")
    assert stage1.step == 20
    spec = load_recipe(TOY / "stage2.yaml").model_spec()
    batch = run_helpers.sample_batch(64, 8)
    logits = reference_logits(reference_model(spec, stage1.params), batch)
    expected = run_helpers.loss_from_logits(logits, batch, spec.z_loss_weight)
    got = first_loss(root / "runs/toy-stage2")
    assert got == pytest.approx(expected, abs=1e-4)
    assert got < math.log(spec.vocab_size) - 0.7  # a fresh model starts at ln(4096) = 8.32
    # The stage-2 schedule is its own: a linear anneal from its 2e-3 peak, reaching 0 at its step 6.
    lrs = [r["lr"] for r in read_metrics(root / "runs/toy-stage2") if r["kind"] == "train"]
    assert lrs == pytest.approx([2e-3 * (1 - s / 6) for s in range(1, 7)])


def test_weights_only_restarts_adam_and_load_optimizer_continues_it(curriculum):
    framework, root = curriculum
    assert read_training_state(f"{framework}-run:{root / 'runs/toy-stage2'}").adam_count == 6
    assert read_training_state(f"{framework}-run:{root / 'runs/toy-stage3'}").adam_count == 4
    carried = read_training_state(f"{framework}-run:{root / 'runs/stage2-with-optimizer'}")
    assert carried.step == 2 and carried.adam_count == 20 + 2
    # Its first step used stage 1's weights too.
    assert first_loss(root / "runs/stage2-with-optimizer") == pytest.approx(
        first_loss(root / "runs/toy-stage2"), abs=1e-6
    )


def framework_logits(framework: str, spec, params: dict[str, np.ndarray], batch) -> torch.Tensor:
    """Logits of the trainer framework's own model holding ``params``."""
    ids = batch["input_ids"].astype(np.int64)
    if framework == "torch":
        from olmo_train_torch import model_from_hf

        with torch.no_grad():
            return model_from_hf(spec, params).eval()(torch.from_numpy(ids)).logits.double()
    import jax.numpy as jnp

    from olmo_train_jax import model_from_hf

    return torch.from_numpy(np.asarray(model_from_hf(spec, params)(jnp.asarray(ids, jnp.int32)).logits, np.float64))


def test_stage3_trains_longer_sequences_with_yarn(curriculum, run_helpers):
    framework, root = curriculum
    recipe_spec = load_recipe(TOY / "stage3.yaml").model_spec()
    run_spec = ModelSpec.model_validate_json((root / "runs/toy-stage3/spec.json").read_text())
    assert run_spec == recipe_spec and run_spec.yarn.original_max_position_embeddings == 64
    train = [r for r in read_metrics(root / "runs/toy-stage3") if r["kind"] == "train"]
    assert [r["tokens_seen"] for r in train] == [s * 8 * 128 for s in range(1, 5)]
    evals = [r for r in read_metrics(root / "runs/toy-stage3") if r["kind"] == "eval"]
    assert evals and all(v["tokens"] == 16 * 128 for v in evals[-1]["eval"].values())

    # Its first step: stage 2's weights under YaRN, as transformers computes the loss.
    stage2 = read_training_state(f"{framework}-run:{root / 'runs/toy-stage2'}")
    batch = run_helpers.sample_batch(128, 8)
    with_yarn = reference_logits(reference_model(run_spec, stage2.params), batch)
    assert first_loss(root / "runs/toy-stage3") == pytest.approx(
        run_helpers.loss_from_logits(with_yarn, batch, run_spec.z_loss_weight), abs=1e-4
    )
    # The trained stage-3 model in the trainer's framework: transformers' YaRN logits, which
    # differ from plain RoPE's beyond the original 64 tokens far more than the frameworks differ.
    # (This barely trained model attends weakly, so the loss alone cannot tell the two apart.)
    stage3 = read_training_state(f"{framework}-run:{root / 'runs/toy-stage3'}")
    ours = framework_logits(framework, run_spec, stage3.params, batch)
    with_yarn = reference_logits(reference_model(run_spec, stage3.params), batch)
    plain = reference_logits(reference_model(run_spec.replace(yarn=None), stage3.params), batch)
    ours_vs_yarn = (ours - with_yarn).abs().max().item()
    yarn_vs_plain = (with_yarn[:, 64:] - plain[:, 64:]).abs().max().item()
    assert ours_vs_yarn <= 1e-4
    assert yarn_vs_plain > 20 * ours_vs_yarn, (yarn_vs_plain, ours_vs_yarn)


# ---- olmo_run.init_source: resolving init.checkpoint -------------------------------------------


def fake_checkpoint(run: Path, step: int, framework: str, spec_name: str = "tiny") -> Path:
    recipe = load_recipe(None, [f"--model={spec_name}", f"--run_dir={run}"])
    ckpt = checkpoint_dir(run, step)
    ckpt.mkdir(parents=True)
    loader = {"fingerprint": "x", "seed": 0, "step": step, "tokens_consumed": 0}
    commit_checkpoint(ckpt, training_meta(framework, step, recipe.model_spec(), recipe, loader))
    return ckpt


def test_latest_and_run_dirs_resolve_to_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 10, "jax")
    newest = fake_checkpoint(run, 20, "jax")
    checkpoint_dir(run, 30).mkdir()  # a save that never finished (no meta.json)
    assert resolve_checkpoint(run / "checkpoints" / "latest") == (20, newest)
    assert resolve_checkpoint(run) == (20, newest)
    assert resolve_checkpoint(newest) == (20, newest)
    with pytest.raises(TrainingStateError, match="save never finished"):
        resolve_checkpoint(checkpoint_dir(run, 30))
    with pytest.raises(TrainingStateError, match="has no complete checkpoint yet; run that stage first"):
        resolve_checkpoint(tmp_path / "empty" / "checkpoints" / "latest")


def test_init_refuses_what_does_not_fit(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 5, "torch")
    spec = load_spec("tiny")

    def recipe(*extra: str):
        return load_recipe(None, ["--model=tiny", *extra])

    with pytest.raises(
        TrainingStateError,
        match=r"a torch checkpoint, and the jax trainer reads its own; convert it with `olmo-convert torch-run:",
    ):
        resolve_init(recipe(f"--init.checkpoint={ckpt}"), spec, "jax")
    with pytest.raises(TrainingStateError, match=r"differs from the recipe's in 'n_kv_heads'"):
        resolve_init(recipe(f"--init.checkpoint={ckpt}"), load_spec("tiny-gqa"), "torch")
    with pytest.raises(ValueError, match="HF folder holds no optimizer state"):
        resolve_init(recipe("--init.checkpoint=hf:x", "--init.load_optimizer=true"), spec, "torch")
    with pytest.raises(ValueError, match="without init.checkpoint"):
        resolve_init(recipe("--init.load_optimizer=true"), spec, "torch")
    # A change that keeps every parameter (stage 3's YaRN) is allowed, and named.
    yarn = load_spec("tiny").replace(yarn={"factor": 2.0, "original_max_position_embeddings": 64})
    source = resolve_init(recipe(f"--init.checkpoint={tmp_path / 'run'}"), yarn, "torch")
    assert source.step == 5 and source.changed == ("yarn",) and not source.load_optimizer
    # An HF folder: its config.json decides.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "config.json").write_text(json.dumps(hf_config(load_spec("tiny-gqa"))))
    with pytest.raises(TrainingStateError, match="n_kv_heads"):
        resolve_init(recipe(f"--init.checkpoint=hf:{hf}"), spec, "jax")
    assert resolve_init(recipe(f"--init.checkpoint=hf:{hf}"), load_spec("tiny-gqa"), "jax").is_hf
