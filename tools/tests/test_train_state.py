"""Switching frameworks mid-run: ``olmo-convert torch-run: jax-run:`` and back.

A 20-step run of one trainer is the reference; its step-10 checkpoint is converted and the
other trainer resumes it for steps 11-20. Per-step losses and the final held-out losses must
equal the uninterrupted run's within 1e-4 (they differ only by the two frameworks' rounding).
Model "tiny" (4 layers, window 32) on the sample mixture at sequence 64, global batch 8, fp32.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader

from olmo_run.checkpoints import complete_checkpoints, read_meta
from olmo_run.metrics import read_metrics
from olmo_tools.convert import main as convert_main

STEPS = 20
SWITCH = 10
RECIPE = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    f"--checkpoint.every={SWITCH}",
    f"--eval.every={STEPS}",
    "--log.progress=false",
    "--checkpoint.async_save=false",
    "--torch.parallel=none",
    "--schedule.warmup_steps=5",
]
# The fixtures (one_torch_thread, run_helpers) live in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def held_out(run_dir: Path) -> dict[str, float]:
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    return {name: v["loss"] for name, v in evals[-1]["eval"].items()}


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_helpers) -> dict[str, Path]:
    """Uninterrupted 20-step runs of both trainers, each switched to the other at step 10."""
    root = tmp_path_factory.mktemp("switch")
    out = {}
    for source, target in (("torch", "jax"), ("jax", "torch")):
        straight, switched = root / f"{source}-only", root / f"{source}-then-{target}"
        run_helpers.train(source, [*RECIPE, f"--run_dir={straight}"])
        assert convert_main([f"{source}-run:{ckpt(straight, SWITCH)}", f"{target}-run:{switched}"]) == 0
        run_helpers.train(target, [*RECIPE, f"--run_dir={switched}"])  # resumes the converted checkpoint: steps 11-20
        out[source], out[f"{source}->{target}"] = straight, switched
    return out


@pytest.mark.parametrize("source,target", [("torch", "jax"), ("jax", "torch")])
def test_switched_run_follows_the_uninterrupted_one(runs, source, target):
    straight, switched = runs[source], runs[f"{source}->{target}"]
    want, got = losses(straight), losses(switched)
    assert sorted(got) == list(range(SWITCH + 1, STEPS + 1))  # the target trained steps 11-20 only
    for s in got:
        assert abs(got[s] - want[s]) <= 1e-4, (s, got[s], want[s])
    assert want[STEPS] < want[1] - 0.5  # a run that learns, not a flat line
    want_eval, got_eval = held_out(straight), held_out(switched)
    assert set(got_eval) == {"code", "prose"}
    for name in want_eval:
        assert abs(got_eval[name] - want_eval[name]) <= 1e-4, (name, got_eval[name], want_eval[name])


def test_converted_checkpoint_carries_the_training_state(runs):
    """Read both checkpoints with the frameworks' own readers, not with train_state."""
    src, dst = ckpt(runs["torch"], SWITCH), ckpt(runs["torch->jax"], SWITCH)
    src_meta, dst_meta = read_meta(src), read_meta(dst)
    assert dst_meta["framework"] == "jax" and dst_meta["step"] == SWITCH
    assert dst_meta["loader_state"] == src_meta["loader_state"] and dst_meta["loader_state"]["step"] == SWITCH
    assert dst_meta["spec"] == src_meta["spec"] and dst_meta["spike_guard"] == src_meta["spike_guard"]
    assert yaml.safe_load((runs["torch->jax"] / "recipe.yaml").read_text())["run_dir"] == str(runs["torch->jax"])

    # Every tensor, by a name table written out here (JAX: layers stacked, kernels (in, out);
    # torch: one module per layer, Linear weights (out, in)).
    layer = {
        "attn.q_proj": ("q_proj", True),
        "attn.k_proj": ("k_proj", True),
        "attn.v_proj": ("v_proj", True),
        "attn.o_proj": ("o_proj", True),
        "attn.q_norm": ("q_norm", False),
        "attn.k_norm": ("k_norm", False),
        "attn_norm": ("attn_norm", False),
        "mlp.gate_proj": ("gate_proj", True),
        "mlp.up_proj": ("up_proj", True),
        "mlp.down_proj": ("down_proj", True),
        "mlp_norm": ("mlp_norm", False),
    }
    pairs = {"embed": (("embed",), False), "final_norm": (("final_norm",), False), "lm_head": (("lm_head",), True)}
    for i in range(4):
        pairs.update({f"blocks.{i}.{k}": (("layers", name, i), t) for k, (name, t) in layer.items()})
    jax_state = ocp.StandardCheckpointer().restore((dst / "state").absolute())
    adam = jax_state["opt_state"][0]
    meta = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    torch_keys = {
        f"{kind}{local}.weight{suffix}"
        for local in pairs
        for kind, suffix in (
            ("model.", ""),
            ("optim.state.", ".exp_avg"),
            ("optim.state.", ".exp_avg_sq"),
            ("optim.state.", ".step"),
        )
    }
    torch_state = {k: torch.empty(tuple(meta[k].size)) for k in torch_keys}
    dcp.load(torch_state, checkpoint_id=str(src), no_dist=True)
    for local, (path, transposed) in pairs.items():
        for tree, key in (
            (jax_state["params"], f"model.{local}.weight"),
            (adam["mu"], f"optim.state.{local}.weight.exp_avg"),
            (adam["nu"], f"optim.state.{local}.weight.exp_avg_sq"),
        ):
            value = np.asarray(tree[path[0]] if len(path) == 1 else tree[path[0]][path[1]][path[2]])
            np.testing.assert_array_equal(value.T if transposed else value, torch_state[key].numpy(), err_msg=key)
        assert int(torch_state[f"optim.state.{local}.weight.step"]) == SWITCH
    assert int(adam["count"]) == SWITCH
    assert np.abs(np.asarray(adam["nu"]["layers"]["q_proj"])).max() > 0


def fails(capsys, args: list[str], needle: str) -> None:
    capsys.readouterr()
    assert convert_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_checkpoints_that_do_not_fit_are_refused_and_nothing_is_written(runs, tmp_path, capsys):
    torch_ckpt = ckpt(runs["torch"], SWITCH)
    # A torch checkpoint named as a jax one.
    fails(capsys, [f"jax-run:{torch_ckpt}", f"torch-run:{tmp_path / 'a'}"], "is a torch checkpoint, not jax")
    # Same framework on both sides: nothing to convert.
    fails(capsys, [f"torch-run:{torch_ckpt}", f"torch-run:{tmp_path / 'b'}"], "already a torch checkpoint")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    # Existing target runs whose model, mixture or progress do not fit.
    def target_run(name: str, **changes) -> Path:
        run = tmp_path / name
        run.mkdir()
        recipe = yaml.safe_load((runs["torch"] / "recipe.yaml").read_text())
        for section, values in changes.items():
            recipe[section] = {**recipe[section], **values} if isinstance(values, dict) else values
        recipe["run_dir"] = str(run)
        (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        return run

    other_model = target_run("other-model", model="tiny-gqa")
    other_mixture = target_run("other-mixture", train={"sequence_length": 128, "global_batch_tokens": 1024})
    for run, needle in ((other_model, "n_kv_heads"), (other_mixture, "mixture")):
        before = snapshot(run)
        fails(capsys, [f"torch-run:{torch_ckpt}", f"jax-run:{run}"], needle)
        assert snapshot(run) == before
    # A jax run already past the converted step: a resume would never take the new checkpoint.
    ahead = runs["torch->jax"]
    before = snapshot(ahead)
    fails(capsys, [f"torch-run:{torch_ckpt}", f"jax-run:{ahead}"], f"already has a checkpoint at step {STEPS}")
    assert snapshot(ahead) == before
    # A folder that is not a run dir.
    (tmp_path / "plain").mkdir()
    fails(capsys, [f"torch-run:{torch_ckpt}", f"jax-run:{tmp_path / 'plain'}"], "not a run dir")
    assert not any((tmp_path / "plain").iterdir())
    # A missing or incomplete source.
    fails(capsys, [f"torch-run:{tmp_path / 'nothing'}", f"jax-run:{tmp_path / 'c'}"], "neither a checkpoint")
    assert not (tmp_path / "c").exists()


def test_converting_into_a_fitting_run_adds_a_resumable_checkpoint(runs, tmp_path):
    """Into an existing jax run of the same recipe that is behind: the checkpoint is added."""
    run = tmp_path / "behind"
    run.mkdir()
    (run / "recipe.yaml").write_text(
        (runs["torch->jax"] / "recipe.yaml").read_text().replace(str(runs["torch->jax"]), str(run))
    )
    assert convert_main([f"torch-run:{ckpt(runs['torch'], SWITCH)}", f"jax-run:{run}"]) == 0
    assert [s for s, _ in complete_checkpoints(run)] == [SWITCH]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{SWITCH:08d}"]  # no staging left


def test_a_trainer_checkpoint_converts_to_hf_with_the_spec_from_its_meta(runs, tmp_path):
    """``torch:`` on one checkpoint folder of a run (no spec.json there: the spec is in meta.json)."""
    from safetensors.numpy import load_file

    src = ckpt(runs["torch"], STEPS)
    assert not (src / "spec.json").exists()
    assert convert_main([f"torch:{src}", f"hf:{tmp_path / 'hf'}"]) == 0
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    meta = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    pairs = {
        "model.embed_tokens.weight": "model.embed.weight",
        "lm_head.weight": "model.lm_head.weight",
        "model.layers.3.self_attn.q_proj.weight": "model.blocks.3.attn.q_proj.weight",
        "model.layers.0.post_feedforward_layernorm.weight": "model.blocks.0.mlp_norm.weight",
    }
    state = {k: torch.empty(tuple(meta[k].size)) for k in pairs.values()}
    dcp.load(state, checkpoint_id=str(src), no_dist=True)
    for hf_name, key in pairs.items():
        np.testing.assert_array_equal(hf[hf_name], state[key].numpy(), err_msg=hf_name)
