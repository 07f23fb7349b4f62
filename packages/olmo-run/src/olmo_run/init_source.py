"""Where a run's first weights come from (``recipe.init``): the framework-neutral half.

``init.checkpoint`` names one of:

- ``hf:DIR``: an HF folder (*.safetensors, and config.json if it has one); weights only;
- a checkpoint dir of ours (``RUN/checkpoints/step_00000100``: a complete one, with meta.json);
- ``RUN/checkpoints/latest`` or a run dir ``RUN``: that run's latest complete checkpoint
  (a curriculum stage names the previous stage this way before it has run).

``init.load_optimizer`` also takes the AdamW moments and Adam's step count (the run's own step
and the data order still start at 0: a new stage has a new schedule and mixture).

Each trainer calls ``resolve_init`` during its start-up checks, before anything is written, and
then loads the weights in its own format. A checkpoint of ours is first verified against the
file checksums in its meta.json (``checkpoints.verify_checkpoint``). It must have the same parameters
(names and shapes) as the recipe's model; spec fields that change no parameter (RoPE/YaRN, context
length, window) may differ, which is how stage 3 adds YaRN. A checkpoint of the other
framework is refused with the olmo-convert command that turns it into one of this framework.

A checkpoint, ``RUN/checkpoints/latest`` or a run dir may be a ``gs://`` / ``s3://`` URL
(``fileio.URLPath``); the trainers' checkpointers read it from the bucket. An ``hf:`` folder
is local (download it first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_model.hf import hf_param_shapes, spec_from_hf_config
from olmo_model.presets import SpecError
from olmo_model.spec import ModelSpec

from .checkpoints import complete_checkpoints, read_meta, read_verified_meta
from .errors import CheckpointDamagedError, TrainingStateError
from .recipe import Recipe, RecipeError
from .run_dir import RunPath, run_path

HF_PREFIX = "hf:"
LATEST = "latest"


@dataclass(frozen=True)
class InitSource:
    """A resolved ``recipe.init``: what to load, checked to fit the recipe's model."""

    path: RunPath  # the checkpoint dir (local or a URL), or the local HF folder
    framework: str | None  # "torch" / "jax" for our checkpoints; None for an HF folder
    step: int | None  # the checkpoint's step (None for HF)
    load_optimizer: bool
    changed: tuple[str, ...]  # spec fields that differ from the checkpoint's model (no parameter changes)

    @property
    def is_hf(self) -> bool:
        return self.framework is None

    def safetensors_files(self) -> list[Path]:
        """An HF folder's ``*.safetensors`` files in name order (the shards of one model)."""
        assert isinstance(self.path, Path), "an HF folder is local"
        return sorted(self.path.glob("*.safetensors"))

    def describe(self) -> str:
        what = "weights and optimizer state" if self.load_optimizer else "weights only"
        where = (
            f"HF folder {self.path}" if self.is_hf else f"{self.framework} checkpoint {self.path} (step {self.step})"
        )
        note = f"; model changes: {', '.join(self.changed)}" if self.changed else ""
        return f"initialised from {where}, {what}{note}"


def resolve_checkpoint(path: RunPath) -> tuple[int, RunPath]:
    """(step, dir) of a complete checkpoint named by its dir, by ``RUN/checkpoints/latest`` or
    by a run dir (its latest complete checkpoint); local or a URL."""
    if path.name == LATEST:
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return _latest(run, str(path))
    if fileio.isfile(path / "meta.json"):
        meta = read_meta(path)
        return int(meta["step"]), path
    if path.name.startswith("step_") and fileio.isdir(path):
        raise TrainingStateError(
            f"{path}: no meta.json, so the save never finished; use an earlier complete checkpoint"
        )
    if fileio.isdir(path / "checkpoints"):
        return _latest(path, str(path))
    raise TrainingStateError(
        f"{path}: neither a checkpoint (no meta.json) nor a run dir (no checkpoints/); "
        "name a checkpoint dir, RUN/checkpoints/latest, RUN, or hf:DIR"
    )


def _latest(run: RunPath, named: str) -> tuple[int, RunPath]:
    done = complete_checkpoints(run)
    if not done:
        raise TrainingStateError(f"{named}: {run} has no complete checkpoint yet; run that stage first")
    return done[-1]


def weights_fit(theirs: ModelSpec, spec: ModelSpec, origin: str) -> tuple[str, ...]:
    """Raise unless both specs have the same parameters; return the other fields that differ."""
    mine, other = spec.model_dump(), theirs.model_dump()
    differing = tuple(k for k in mine if k != "name" and mine[k] != other.get(k))
    if hf_param_shapes(theirs) != hf_param_shapes(spec):
        k = next((k for k in _SHAPE_FIELDS if k in differing), differing[0] if differing else "parameters")
        raise TrainingStateError(
            f"{origin}: its model differs from the recipe's in '{k}' (checkpoint {other.get(k)!r}, recipe "
            f"{mine.get(k)!r}), which changes the parameters; start from a checkpoint of the recipe's model"
        )
    return differing


# The spec fields that decide parameter names and shapes, in the order a mismatch is reported.
_SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "mlp_hidden", "padded_vocab_size", "qk_norm", "moe")


def _hf_spec(folder: Path, source: str) -> ModelSpec | None:
    """The model of an HF folder's config.json; None without one (the trainer then checks the
    tensors' names and shapes against the recipe's model as it loads them)."""
    if not folder.is_dir() or not list(folder.glob("*.safetensors")):
        raise TrainingStateError(
            f"init.checkpoint={source}: {folder} holds no *.safetensors; point it at an HF model folder"
        )
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        return spec_from_hf_config(json.loads(config.read_text()), source=str(config))
    except json.JSONDecodeError as err:
        raise TrainingStateError(f"{config}: not valid JSON ({err}); re-export the model") from None
    except SpecError as err:
        raise TrainingStateError(str(err)) from None


def resolve_init(recipe: Recipe, spec: ModelSpec, framework: str) -> InitSource | None:
    """The checked ``recipe.init`` source for the ``framework`` trainer, or None without one.
    Raises RecipeError / TrainingStateError with one line; reads, never writes."""
    source = recipe.init.checkpoint
    if source is None:
        if recipe.init.load_optimizer:
            raise RecipeError("init.load_optimizer=true without init.checkpoint; name the checkpoint to take it from")
        return None
    if source.startswith(HF_PREFIX):
        if recipe.init.load_optimizer:
            raise RecipeError(
                f"init.checkpoint={source}: an HF folder holds no optimizer state; set init.load_optimizer=false"
            )
        if isinstance(run_path(source.removeprefix(HF_PREFIX)), URLPath):
            raise RecipeError(
                f"init.checkpoint={source}: an hf: folder must be local; download it first (e.g. gcloud storage cp -r "
                "/ aws s3 cp --recursive) and name the local folder"
            )
        folder = Path(source.removeprefix(HF_PREFIX))
        theirs = _hf_spec(folder, source)
        changed = weights_fit(theirs, spec, f"init.checkpoint={source}") if theirs is not None else ()
        return InitSource(folder, None, None, False, changed)
    try:
        step, ckpt = resolve_checkpoint(run_path(source))
        meta = read_verified_meta(ckpt)
    except CheckpointDamagedError as err:
        raise CheckpointDamagedError(
            f"init.checkpoint={source}: {err}; name an intact checkpoint (an older step of that run) or restore it "
            "from a copy"
        ) from None
    theirs = meta.get("framework")
    if theirs != framework:
        raise TrainingStateError(
            f"init.checkpoint={source}: a {theirs} checkpoint, and the {framework} trainer reads its own; convert it "
            f"with `olmo-convert {theirs}-run:{ckpt} {framework}-run:OUT` and set init.checkpoint=OUT"
        )
    changed = weights_fit(ModelSpec.model_validate(meta["spec"]), spec, f"init.checkpoint={source} ({ckpt})")
    return InitSource(ckpt, framework, step, recipe.init.load_optimizer, changed)
