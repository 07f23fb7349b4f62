"""Training-state conversion between the two trainers: a run moves from torch to JAX and back.

    uv run --frozen olmo-convert torch-run:RUN_OR_CHECKPOINT jax-run:DIR
    uv run --frozen olmo-convert jax-run:runs/a/checkpoints/step_00000100 torch-run:runs/a-torch
    uv run --frozen olmo-train-jax DIR/recipe.yaml        # continues at the converted step

The source is a trainer checkpoint dir, ``RUN/checkpoints/latest`` or a run dir (its latest
complete checkpoint), verified first against the file checksums in its meta.json. Everything a
resume needs is carried over: parameters, AdamW's first and second moments and Adam's step
count (mapped through each trainer's own HF-name adapter, the same one its weights use), the
step, the loader state (the data position), the spike-guard history, the recipe and the spec.
The result is a complete checkpoint of the target trainer, written by that trainer's own
checkpoint code:

- DIR absent (or ``--overwrite``): a new run dir (recipe.yaml with ``run_dir`` = DIR, spec.json,
  the checkpoint) is built in a hidden sibling and renamed into place when complete;
- DIR an existing run dir: the checkpoint is added to it, if it fits that run (same model spec,
  same mixture fingerprint, and newer than its checkpoints); it is built in a hidden dir and
  renamed to ``checkpoints/step_N`` with its meta.json already written last inside.

A source of the other framework, a spec or mixture that does not fit the target, or an MoE
spec (expert weights and their moments are not mapped between the trainers yet) is one line
naming the file and the fix; nothing is written.
Parameters and moments stay float32 (the trainers keep float32 master weights and state).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from olmo_data import fileio
from olmo_model import ModelSpec, hf_param_shapes
from olmo_run.checkpoints import complete_checkpoints, training_meta
from olmo_run.errors import TrainingStateError
from olmo_run.init_source import resolve_checkpoint
from olmo_run.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict

from .checkpoint import CheckpointError, Location, parse_location, require_jax, spec_disagreement, verified_trainer_meta
from .dcp import DCP_METADATA, DCPDir
from .formats import atomic_destination

RUN_KINDS = ("torch-run", "jax-run")


@dataclass
class TrainingState:
    """A trainer-neutral training state: tensors under transformers' Olmo3 names, float32 numpy."""

    spec: ModelSpec
    recipe: Recipe
    step: int  # optimizer steps taken (skipped ones included: their batches were consumed)
    adam_count: int  # AdamW updates applied (bias correction); skipped steps excluded
    params: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]  # AdamW first moment (optax mu)
    exp_avg_sq: dict[str, np.ndarray]  # AdamW second moment (optax nu)
    meta: dict[str, Any]  # the source checkpoint's meta.json (loader state, spike guard, ...)
    origin: str


def is_run_location(text: str) -> bool:
    return text.partition(":")[0] in RUN_KINDS


def _framework(loc: Location) -> str:
    return loc.kind.removesuffix("-run")


# ---- reading ------------------------------------------------------------------------------


def read_training_state(text: str) -> TrainingState:
    """The training state of a ``torch-run:`` or ``jax-run:`` checkpoint (or run dir)."""
    loc = parse_location(text, RUN_KINDS)
    framework = _framework(loc)
    try:
        step, found = resolve_checkpoint(loc.path)
    except TrainingStateError as err:
        raise CheckpointError(str(err)) from None
    assert isinstance(found, Path)  # a local name resolves locally (olmo_tools.remote downloads URLs first)
    ckpt = found
    meta = verified_trainer_meta(ckpt)
    if meta.get("framework") != framework:
        raise CheckpointError(
            f"{ckpt}: meta.json says this is a {meta.get('framework')} checkpoint, not {framework}; "
            f"name it {meta.get('framework')}-run:{loc.path}"
        )
    spec = ModelSpec.model_validate(meta["spec"])
    if spec.moe is not None:
        raise CheckpointError(
            f"{ckpt}: an MoE model ({spec.moe.n_experts} experts); moving MoE training state (expert weights "
            "and their AdamW moments) between the trainers is not implemented yet; resume it in its own trainer"
        )
    try:
        recipe = recipe_from_dict(meta["recipe"], f"{ckpt}/meta.json recipe")
    except RecipeError as err:
        raise CheckpointError(str(err)) from None
    origin = f"{loc.kind}:{ckpt}"
    reader = _read_torch if framework == "torch" else _read_jax
    params, exp_avg, exp_avg_sq, count = reader(ckpt, spec, recipe)
    return TrainingState(spec, recipe, step, count, params, exp_avg, exp_avg_sq, meta, origin)


def _read_torch(ckpt: Path, spec: ModelSpec, recipe: Recipe):
    import torch

    from olmo_train_torch.hf_adapter import hf_to_local_names

    if not (ckpt / DCP_METADATA).is_file():
        raise CheckpointError(f"{ckpt}: no {DCP_METADATA}; not a torch trainer checkpoint (or a damaged one)")
    store = DCPDir(ckpt)

    def load(key: str) -> np.ndarray:
        if key not in store.tensors:
            raise CheckpointError(
                f"{ckpt}: no tensor '{key}'; the checkpoint does not hold this model's training state"
            )
        return store.load(key).to(torch.float32).numpy()

    params, exp_avg, exp_avg_sq, counts = {}, {}, {}, set()
    for hf_name, (local, _) in hf_to_local_names(spec).items():
        params[hf_name] = load(f"model.{local}")
        state = f"optim.state.{local}"
        if f"{state}.step" in store.tensors:
            exp_avg[hf_name] = load(f"{state}.exp_avg")
            exp_avg_sq[hf_name] = load(f"{state}.exp_avg_sq")
            counts.add(int(load(f"{state}.step")))
        else:  # AdamW creates its state at the first update: none yet means zero moments
            exp_avg[hf_name] = np.zeros_like(params[hf_name])
            exp_avg_sq[hf_name] = np.zeros_like(params[hf_name])
            counts.add(0)
    if len(counts) != 1:
        raise CheckpointError(f"{ckpt}: AdamW step counts differ between parameters ({sorted(counts)}); damaged")
    return params, exp_avg, exp_avg_sq, counts.pop()


def _jax_model(spec: ModelSpec, recipe: Recipe, tree: dict | None = None):
    """The JAX trainer's model, abstract (shapes only), or holding a params-shaped pure dict
    (the weights, or one AdamW moment: it has the weights' tree)."""
    from flax import nnx

    from olmo_train_jax.model import build_model

    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(spec, seed=recipe.train.seed)))
    if tree is not None:
        nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)


def _jax_to_hf(spec: ModelSpec, recipe: Recipe, tree: dict) -> dict[str, np.ndarray]:
    from olmo_train_jax.hf_adapter import to_hf

    return {k: np.asarray(v, np.float32) for k, v in to_hf(_jax_model(spec, recipe, tree), spec).items()}


def _hf_to_jax(spec: ModelSpec, recipe: Recipe, tensors: dict[str, np.ndarray]) -> dict:
    from flax import nnx

    from olmo_train_jax.hf_adapter import load_hf

    model = _jax_model(spec, recipe)
    load_hf(model, tensors)
    return nnx.to_pure_dict(nnx.split(model)[1])


def _jax_abstract(spec: ModelSpec, recipe: Recipe):
    """(abstract params, abstract AdamW state, tx) on one device, as the JAX trainer builds them."""
    import jax
    from flax import nnx

    from olmo_train_jax.checkpoint import abstract_like
    from olmo_train_jax.step import make_optimizer

    params = nnx.to_pure_dict(nnx.split(_jax_model(spec, recipe))[1])
    tx = make_optimizer(params, recipe)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def placed(tree):
        return abstract_like(tree, jax.tree.map(lambda _: device, tree))

    return placed(params), placed(jax.eval_shape(tx.init, params)), tx


def _read_jax(ckpt: Path, spec: ModelSpec, recipe: Recipe):
    import optax.tree_utils as otu

    from olmo_train_jax.checkpoint import STATE_DIR, load_checkpoint

    if not (ckpt / STATE_DIR).is_dir():
        raise CheckpointError(f"{ckpt}: no {STATE_DIR}/; not a JAX trainer checkpoint (or a damaged one)")
    abstract_params, abstract_opt, _ = _jax_abstract(spec, recipe)
    try:
        params, opt_state, _ = load_checkpoint(ckpt, abstract_params, abstract_opt)
    except (ValueError, KeyError, FileNotFoundError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{ckpt}: cannot read it as this model's JAX training state ({first})") from None
    return (
        _jax_to_hf(spec, recipe, params),
        _jax_to_hf(spec, recipe, otu.tree_get(opt_state, "mu")),
        _jax_to_hf(spec, recipe, otu.tree_get(opt_state, "nu")),
        int(otu.tree_get(opt_state, "count")),
    )


# ---- writing -------------------------------------------------------------------------------


def _write_torch(run_dir: Path, state: TrainingState, recipe: Recipe, meta: dict[str, Any]) -> None:
    import torch

    from olmo_train_torch.checkpoint import Checkpointer
    from olmo_train_torch.hf_adapter import hf_to_local_names, model_from_hf
    from olmo_train_torch.parallelize import Distributed
    from olmo_train_torch.step import make_optimizer

    cpu = torch.device("cpu")
    model = model_from_hf(state.spec, state.params, torch.float32, source=state.origin)
    optimizer = make_optimizer(model, recipe, cpu)
    if state.adam_count > 0:
        for hf_name, (local, _) in hf_to_local_names(state.spec).items():
            # AdamW's own state layout: a float32 scalar step per parameter and the two moments.
            optimizer.state[model.get_parameter(local)] = {
                "step": torch.tensor(float(state.adam_count), dtype=torch.float32),
                "exp_avg": torch.from_numpy(state.exp_avg[hf_name].copy()),
                "exp_avg_sq": torch.from_numpy(state.exp_avg_sq[hf_name].copy()),
            }
    single = Distributed(rank=0, world_size=1, local_rank=0, device=cpu, initialized=False)
    Checkpointer(run_dir, single, async_save=False, keep=1).save(state.step, model, optimizer, meta)


def _write_jax(run_dir: Path, state: TrainingState, recipe: Recipe, meta: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp
    import optax.tree_utils as otu

    from olmo_train_jax.checkpoint import Checkpointer

    abstract_params, abstract_opt, tx = _jax_abstract(state.spec, recipe)

    def placed(tree, like):
        return jax.tree.map(lambda x, a: jax.device_put(jnp.asarray(x, a.dtype), a.sharding), tree, like)

    params = placed(_hf_to_jax(state.spec, recipe, state.params), abstract_params)
    opt_state = otu.tree_set(
        tx.init(params),
        mu=placed(_hf_to_jax(state.spec, recipe, state.exp_avg), abstract_params),
        nu=placed(_hf_to_jax(state.spec, recipe, state.exp_avg_sq), abstract_params),
        count=jnp.asarray(state.adam_count, otu.tree_get(abstract_opt, "count").dtype),
    )
    checkpointer = Checkpointer(run_dir, keep=1, async_save=False)
    try:
        checkpointer.save(state.step, params, opt_state, meta)
    finally:
        checkpointer.close()


_WRITERS = {"torch": _write_torch, "jax": _write_jax}


# ---- where it goes ----------------------------------------------------------------------------


def _mixture_fits(state: TrainingState, recipe: Recipe, where: str) -> None:
    """The target recipe's mixture is the one the source's data position refers to."""
    from olmo_data import DataError, load_mixture

    try:
        raw = load_mixture(recipe.data.mixture)
    except DataError as err:
        raise CheckpointError(f"{where}: {err}") from None
    mixture = raw.with_sequence_length(recipe.sequence_length(raw.sequence_length))
    theirs = state.meta["loader_state"]["fingerprint"]
    if theirs != mixture.fingerprint() and not recipe.data.allow_fingerprint_mismatch:
        raise CheckpointError(
            f"{where}: mixture {recipe.data.mixture} (fingerprint {mixture.fingerprint()[:16]}) is not the one "
            f"{state.origin} was reading (fingerprint {str(theirs)[:16]}); convert into a run of the same mixture, "
            "or set data.allow_fingerprint_mismatch in the target recipe"
        )


def _target_meta(state: TrainingState, framework: str, recipe: Recipe) -> dict[str, Any]:
    extra = {
        "spike_guard": state.meta.get("spike_guard", {}),
        "converted_from": {"checkpoint": state.origin, "framework": state.meta["framework"]},
    }
    if "layout" in state.meta:
        extra["layout"] = state.meta["layout"]
    return training_meta(framework, state.step, state.spec, recipe, state.meta["loader_state"], extra)


def write_training_state(state: TrainingState, dst: str, *, overwrite: bool = False) -> Path:
    """Write ``state`` as a complete checkpoint of the ``dst`` trainer (``torch-run:DIR`` or
    ``jax-run:DIR``): a new run dir, or a checkpoint added to an existing run dir that it fits."""
    loc = parse_location(dst, RUN_KINDS)
    framework = _framework(loc)
    if framework == state.meta["framework"]:
        raise CheckpointError(f"{dst}: {state.origin} is already a {framework} checkpoint; copy the run dir instead")
    target = loc.path.absolute()
    if target.exists() and not overwrite:
        return _add_to_run(state, framework, target)
    recipe = state.recipe.model_copy(update={"run_dir": str(target)})
    _mixture_fits(state, recipe, str(target))
    with atomic_destination(target, overwrite) as tmp:
        tmp.mkdir(parents=True)
        fileio.write_text(tmp / "recipe.yaml", recipe.to_yaml())
        fileio.write_text(tmp / "spec.json", state.spec.model_dump_json(indent=2))
        _WRITERS[framework](tmp, state, recipe, _target_meta(state, framework, recipe))
    return target


def _add_to_run(state: TrainingState, framework: str, run_dir: Path) -> Path:
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise CheckpointError(
            f"{run_dir}: exists and is not a run dir (no recipe.yaml); choose a new path, or pass --overwrite"
        )
    try:
        recipe = load_recipe(recipe_file, [])
    except RecipeError as err:
        raise CheckpointError(str(err)) from None
    diff = spec_disagreement(state.spec, recipe.model_spec())
    if diff:
        raise CheckpointError(
            f"{recipe_file}: the run's model differs from {state.origin}'s ({'; '.join(diff[:3])}; checkpoint vs run); "
            "convert into a run of the same model, or into a new run dir"
        )
    _mixture_fits(state, recipe, str(recipe_file))
    done = complete_checkpoints(run_dir)
    if done and done[-1][0] >= state.step:
        raise CheckpointError(
            f"{run_dir}: already has a checkpoint at step {done[-1][0]} >= {state.step}, which a resume would take "
            "instead; convert into a new run dir"
        )
    final = run_dir / "checkpoints" / f"step_{state.step:08d}"
    staging = run_dir / "checkpoints" / f".convert-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _WRITERS[framework](staging, state, recipe, _target_meta(state, framework, recipe))
        shutil.rmtree(final, ignore_errors=True)  # an incomplete save of that step (no meta.json)
        os.replace(staging / "checkpoints" / final.name, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return run_dir


def convert_training_state(src: str, dst: str, *, overwrite: bool = False) -> ModelSpec:
    """``olmo-convert torch-run:SRC jax-run:DST`` (or the other way); returns the model's spec."""
    if not (is_run_location(src) and is_run_location(dst)):
        raise CheckpointError(
            f"{src} -> {dst}: a training state converts between torch-run: and jax-run: only; "
            "for weights alone use hf:/torch:/jax:"
        )
    for text in (src, dst):
        if text.startswith("jax-run:"):
            require_jax(text)
    state = read_training_state(src)
    expected = hf_param_shapes(state.spec)
    for name, shape in expected.items():
        for what, tensors in (
            ("parameter", state.params),
            ("exp_avg", state.exp_avg),
            ("exp_avg_sq", state.exp_avg_sq),
        ):
            if tensors[name].shape != shape:
                raise CheckpointError(
                    f"{state.origin}: {what} '{name}' has shape {tensors[name].shape}, expected {shape}"
                )
    write_training_state(state, dst, overwrite=overwrite)
    return state.spec
