"""Resuming a run: the newest checkpoint that verifies, checked against this run before anything
is written (its framework and spec, the recipe's maths, the loader state)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import TypeAdapter, ValidationError

from olmo_model.schedules import Schedule
from olmo_model.spec import ModelSpec

from .checkpoints import complete_checkpoints, read_verified_meta
from .errors import CheckpointDamagedError, TrainingStateError, loud
from .recipe import MoESection, OptimSection, Recipe, TrainSection
from .run_dir import RunPath

log = logging.getLogger(__name__)


def check_meta_fits(meta: dict[str, Any], ckpt: RunPath, spec: ModelSpec, framework: str | None = None) -> None:
    """Refuse a checkpoint of another framework or spec, naming the first differing field. A run
    dir of the other trainer is named as such, the fresh run's fix first (the usual intent: the
    same recipe in the other trainer), then the conversion that continues it."""
    theirs_framework = meta.get("framework")
    if framework is not None and theirs_framework != framework:
        run_dir, new_dir = ckpt.parent.parent, f"{ckpt.parent.parent}-{framework}"
        raise TrainingStateError(
            f"{run_dir} holds a {theirs_framework} run (a {theirs_framework} checkpoint cannot be resumed by the "
            f"{framework} trainer): for a new {framework} run pass --run_dir={new_dir} (or another --run_dir or "
            f"--name); to continue that run in {framework}, convert it with `olmo-convert "
            f"{theirs_framework}-run:{run_dir} {framework}-run:{new_dir}` and run "
            f"`olmo-train-{framework} {new_dir}/recipe.yaml`"
        )
    theirs = ModelSpec.model_validate(meta["spec"])
    if theirs != spec:
        mine = spec.model_dump()
        other = theirs.model_dump()
        diff = [k for k in mine if mine[k] != other.get(k) and k != "name"]
        if diff:
            k = diff[0]
            raise TrainingStateError(
                f"{ckpt}: checkpoint spec differs from the recipe's model in '{k}' "
                f"(checkpoint {other.get(k)!r}, recipe {mine[k]!r}); use the checkpoint's model or a new run_dir"
            )


# The recipe sections whose fields change the maths of a continued run: (section, schema, the
# fields compared, None for all). Everything else may change on resume: the layout (mesh,
# micro-batch, torch/jax sections, which an elastic resize changes), logging, eval and
# checkpoint cadence, run_dir, init, the spike guard and the data knobs (the mixture itself
# is checked by its fingerprint). train.steps/tokens are compared through the schedule.
_MATHS_SECTIONS: tuple[tuple[str, Any, tuple[str, ...] | None], ...] = (
    ("train", TrainSection, ("precision", "document_masking", "global_batch_tokens", "sequence_length")),
    # optim.sharded places the same AdamW state over ranks: a layout, not the maths.
    ("optim", OptimSection, tuple(k for k in OptimSection.model_fields if k != "sharded")),
    ("schedule", Schedule, None),
    ("moe", MoESection, None),  # MoE specs only
)


def _maths_changes(
    theirs: dict[str, Any], recipe: Recipe, spec: ModelSpec, sequence_length: int, step: int
) -> list[tuple[str, Any, Any, str]]:
    """(field, checkpoint's value, recipe's value, why) of every change ``recipe`` makes to the
    checkpoint's recipe ``theirs`` that changes the maths of the run continued at ``step``.
    A section is read with this schema's defaults for fields written before they existed."""
    ours = recipe.model_dump(mode="json")
    changes: list[tuple[str, Any, Any, str]] = []
    old_train: dict[str, Any] = {}
    for section, schema, fields in _MATHS_SECTIONS:
        if section == "moe" and spec.moe is None:
            continue
        try:
            old = TypeAdapter(schema).validate_python(theirs.get(section, {})).model_dump(mode="json")
        except ValidationError:  # a schema this one cannot read: compared as written
            old = theirs.get(section, {})
        new = ours[section]
        if section == "train":
            old_train = old
        keys = ("kind",) if section == "schedule" and old.get("kind") != new["kind"] else fields or tuple(new)
        for key in keys:
            a, b = old.get(key), new.get(key)
            if section == "train" and key == "sequence_length":  # null: the mixture's
                a, b = a or sequence_length, b or sequence_length
            if a != b:
                changes.append((f"{section}.{key}", a, b, ""))
    old_total = recipe.model_copy(update={"train": TrainSection.model_construct(**old_train)}).total_steps()
    new_total = recipe.total_steps()
    if old_total != new_total:
        # A new total is harmless when the schedule gives every step taken so far the same LR
        # under both (warmup, a constant LR, WSD's stable phase): the run is then exactly what
        # the new recipe would have produced. Elsewhere it bends the curve mid-run. Both LRs are
        # printed as Python's repr (the shortest text that reads back as the same float), so two
        # LRs that differ anywhere never print alike.
        sched, peak = recipe.schedule, recipe.optim.lr
        first = next(
            (s for s in range(1, step + 1) if sched.lr(s, peak, old_total) != sched.lr(s, peak, new_total)), None
        )
        key = "train.steps" if recipe.train.steps is not None else "train.tokens (in steps)"
        if first is None:
            log.info(
                f"{key}: {old_total} -> {new_total}; the {sched.kind} schedule gave steps 1-{step} the same "
                "LR under both, so the run continues as if planned that way"
            )
        else:
            changes.append(
                (
                    key,
                    old_total,
                    new_total,
                    (
                        f", which changes the LR the {sched.kind} schedule gives the {step} steps already taken "
                        f"(step {first}: {float(sched.lr(first, peak, new_total))!r} instead of "
                        f"{float(sched.lr(first, peak, old_total))!r})"
                    ),
                )
            )
    return changes


def check_recipe_continues(
    meta: dict[str, Any], ckpt: RunPath, recipe: Recipe, spec: ModelSpec, sequence_length: int, step: int
) -> None:
    """Refuse a resume whose recipe changes the maths of the run so far (precision, optimizer,
    schedule, batch, sequence length, the total steps where the schedule depends on it), naming
    the field, both values and the fix; with checkpoint.allow_recipe_change, say each loudly,
    except a new global batch size, which no resume can take (the data order is per step)."""
    changes = _maths_changes(meta["recipe"], recipe, spec, sequence_length, step)
    for key, old, new, _ in changes:
        if key == "train.global_batch_tokens":
            # Not even with allow_recipe_change: the data order maps step N to the sequences
            # [N*B, (N+1)*B) of one fixed order (contract 3), so step N at another batch size B
            # would skip or repeat data. A stage that changes the batch is a new run from here.
            raise TrainingStateError(
                f"{ckpt}: the recipe changes {key} from {old!r} (checkpoint) to {new!r}, which a resume cannot "
                "take, even with checkpoint.allow_recipe_change: the data order maps each step to its batch by "
                f"the batch size, so step {step} on would skip or repeat data; set it back to {old!r}, or start "
                f"a new stage from this checkpoint in a new run_dir (--init.checkpoint={ckpt} "
                "--init.load_optimizer=true; its data order starts at step 0)"
            )
    if changes and not recipe.checkpoint.allow_recipe_change:
        key, old, new, why = changes[0]
        raise TrainingStateError(
            f"{ckpt}: the recipe changes {key} from {old!r} (checkpoint) to {new!r}{why}; set it back to {old!r}, "
            f"use a new run_dir (init.checkpoint={ckpt} starts from its weights), or pass "
            "--checkpoint.allow_recipe_change=true to continue anyway"
        )
    for key, old, new, why in changes:
        loud(
            f"{ckpt}: {key} changed from {old!r} to {new!r}{why}; "
            "continuing because checkpoint.allow_recipe_change=true"
        )


def _newest_verified(
    run_dir: RunPath, done: list[tuple[int, RunPath]], fallback: bool
) -> tuple[int, RunPath, dict[str, Any]]:
    """(step, ckpt, meta) of the newest checkpoint that reads and verifies. A damaged newer one
    is an error naming the one a fallback would take, unless ``fallback``: then it is skipped
    loudly (and deleted once the resumed run commits its first checkpoint)."""
    damaged: list[tuple[RunPath, CheckpointDamagedError]] = []
    for step, ckpt in reversed(done):
        try:
            meta = read_verified_meta(ckpt)
        except CheckpointDamagedError as err:
            damaged.append((ckpt, err))
            continue
        if damaged and not fallback:
            raise CheckpointDamagedError(
                f"{damaged[0][1]}; --checkpoint.fallback=true resumes from step {step} ({ckpt.name}, the newest "
                f"checkpoint that verifies), or restore {damaged[0][0].name} from a copy"
            )
        for bad, bad_err in damaged:
            loud(
                f"{bad.name} skipped: {bad_err}; resuming from {ckpt.name} (step {step}) because "
                f"checkpoint.fallback=true; {bad.name} is deleted when this run commits its first checkpoint"
            )
        return step, ckpt, meta
    raise CheckpointDamagedError(
        f"{damaged[0][1]}; no older checkpoint of {run_dir} verifies either: restore one from a copy, "
        "or use a new run_dir"
    )


def find_resume(run_dir: RunPath, recipe: Recipe, spec: ModelSpec, framework: str, loader: Any, total_steps: int):
    """The latest complete checkpoint to resume from, verified against the checksums in its
    meta.json and checked against this run before anything is written: (step, ckpt, meta), or
    None for a fresh run. ``loader`` is the run's MixtureLoader; its state is restored here (a
    changed mixture fingerprint is an error unless the recipe allows it). A damaged newest
    checkpoint is an error, or with checkpoint.fallback skipped for the newest that verifies;
    a recipe that changes the maths of the run is an error unless checkpoint.allow_recipe_change."""
    done = complete_checkpoints(run_dir)
    if not done:
        return None
    if not recipe.checkpoint.resume:
        raise TrainingStateError(
            f"{run_dir}: has checkpoints up to step {done[-1][0]} but checkpoint.resume is false; "
            "use a new run_dir (or name), or set checkpoint.resume=true"
        )
    step, ckpt, meta = _newest_verified(run_dir, done, recipe.checkpoint.fallback)
    check_meta_fits(meta, ckpt, spec, framework)
    if step > total_steps:
        raise TrainingStateError(
            f"{ckpt}: the run is at step {step}, past this recipe's {total_steps} steps; "
            f"raise train.steps to at least {step} or use a new run_dir"
        )
    # The recipe before the loader state: a changed batch size is named as the recipe change it is.
    check_recipe_continues(meta, ckpt, recipe, spec, loader.mixture.sequence_length, step)
    loader.load_state_dict(meta["loader_state"], allow_fingerprint_mismatch=recipe.data.allow_fingerprint_mismatch)
    if loader.step != step:
        raise TrainingStateError(f"{ckpt}: loader state is at step {loader.step} but meta.json says {step}; damaged")
    return step, ckpt, meta
