"""Checkpoint integrity (``olmo_run.checkpoints``, ``olmo_run.resume``), framework-neutral (issue
23): the checksums commit_checkpoint records, their verification on resume, checkpoint.fallback, the recipe fields a
resume may not change, and the clean-up of what interrupted saves leave behind.

The checkpoints here are folders of random bytes committed exactly as the trainers commit theirs
(``commit_checkpoint`` after the framework's files are written); the trainers' own tests damage
real Orbax and DCP files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from olmo_data import fileio
from olmo_run.checkpoints import (
    CHECKPOINT_FORMAT,
    UNCHECKED_FORMAT,
    checkpoint_dir,
    clean_orphans,
    commit_checkpoint,
    complete_checkpoints,
    prune_checkpoints,
    read_meta,
    training_meta,
)
from olmo_run.errors import CheckpointDamagedError, TrainingStateError
from olmo_run.recipe import Recipe, load_recipe
from olmo_run.resume import find_resume
from olmo_run.terminal import show_on_terminal

ARRAY = "state/d/0123abcd"  # where a framework keeps tensor bytes
BASE = ["--model=tiny", "--train.steps=40", "--train.precision=fp32"]


class FakeLoader:
    """What find_resume uses of a MixtureLoader."""

    def __init__(self) -> None:
        self.step = 0
        self.mixture = SimpleNamespace(sequence_length=64)

    def load_state_dict(self, state: dict, allow_fingerprint_mismatch: bool = False) -> None:
        self.step = state["step"]


def recipe_for(run: Path, *args: str) -> Recipe:
    return load_recipe(None, [*BASE, f"--run_dir={run}", *args])


def commit(run: Path, step: int, recipe: Recipe) -> Path:
    ckpt = checkpoint_dir(run, step)
    (ckpt / ARRAY).parent.mkdir(parents=True)
    (ckpt / ARRAY).write_bytes(os.urandom(64 * 1024))
    (ckpt / "state" / "_METADATA").write_bytes(os.urandom(512))
    commit_checkpoint(ckpt, training_meta("jax", step, recipe.model_spec(), recipe, {"step": step}))
    return ckpt


@pytest.fixture(autouse=True)
def terminal() -> None:
    show_on_terminal()  # olmo_run's log lines reach the captured stdout / stderr, as under the CLI


@pytest.fixture
def run(tmp_path) -> Path:
    """A run dir with complete checkpoints at steps 10 and 20 of a 40-step fp32 cosine run."""
    run = tmp_path / "run"
    for step in (10, 20):
        commit(run, step, recipe_for(run))
    return run


def resume(run: Path, *args: str):
    recipe = recipe_for(run, *args)
    return find_resume(run, recipe, recipe.model_spec(), "jax", FakeLoader(), recipe.total_steps())


def flip_bytes(path: Path, n: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_commit_records_every_file_but_meta_json(run):
    ckpt = checkpoint_dir(run, 20)
    meta = read_meta(ckpt)
    assert meta["format"] == CHECKPOINT_FORMAT
    assert sorted(meta["files"]) == ["state/_METADATA", ARRAY]
    for rel, entry in meta["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    step, found, _ = resume(run)
    assert (step, found) == (20, ckpt)


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated", "missing array", "missing _METADATA", "meta.json"])
def test_a_damaged_newest_checkpoint_is_refused_in_one_line_naming_the_older_good_one(run, damage):
    ckpt = checkpoint_dir(run, 20)
    named = {"meta.json": ckpt / "meta.json", "missing _METADATA": ckpt / "state" / "_METADATA"}.get(
        damage, ckpt / ARRAY
    )
    if damage == "flipped bytes":
        flip_bytes(named)
    elif damage == "truncated":
        named.write_bytes(named.read_bytes()[:-1])
    elif damage == "meta.json":
        named.write_text(named.read_text()[:100])
    else:
        named.unlink()
    with pytest.raises(CheckpointDamagedError) as err:
        resume(run)
    message = str(err.value)
    assert "\n" not in message
    assert str(named) in message and "damaged" in message
    assert "--checkpoint.fallback=true resumes from step 10 (step_00000010" in message


def test_fallback_resumes_from_the_newest_checkpoint_that_verifies_and_says_so(run, capsys):
    commit(run, 30, recipe_for(run))
    flip_bytes(checkpoint_dir(run, 30) / ARRAY)
    (checkpoint_dir(run, 20) / "meta.json").write_text("{not json")
    step, ckpt, _ = resume(run, "--checkpoint.fallback=true")
    assert (step, ckpt) == (10, checkpoint_dir(run, 10))
    loud = [line for line in capsys.readouterr().err.splitlines() if line.startswith("!!!")]
    assert len(loud) == 2
    assert loud[0].startswith("!!! step_00000030 skipped: ") and "sha256" in loud[0]
    assert loud[1].startswith("!!! step_00000020 skipped: ") and "unreadable" in loud[1]
    assert all("resuming from step_00000010 (step 10)" in line for line in loud)

    # The resumed run's first commit deletes the skipped ones: left, they would outnumber the
    # new checkpoints in checkpoint.keep and be taken again by the next resume.
    commit(run, 15, recipe_for(run))
    prune_checkpoints(run, keep=3, committed=15)
    assert [s for s, _ in complete_checkpoints(run)] == [10, 15]

    flip_bytes(checkpoint_dir(run, 10) / ARRAY)
    flip_bytes(checkpoint_dir(run, 15) / ARRAY)
    with pytest.raises(CheckpointDamagedError, match="no older checkpoint of .* verifies either"):
        resume(run, "--checkpoint.fallback=true")


def test_a_checkpoint_from_before_checksums_resumes_with_a_warning(run, capsys):
    ckpt = checkpoint_dir(run, 20)
    meta = read_meta(ckpt)
    del meta["files"]
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": UNCHECKED_FORMAT}))
    assert resume(run)[0] == 20
    err = capsys.readouterr().err
    assert err.startswith(f"!!! {ckpt}: written before checkpoints carried checksums ({UNCHECKED_FORMAT})")
    # Without its list, a checkpoint of the checksummed format is damaged, not old.
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointDamagedError, match="no valid 'files' list"):
        resume(run)


@pytest.mark.parametrize(
    "override,field,old,new",
    [
        ("--train.precision=bf16", "train.precision", "'fp32'", "'bf16'"),
        ("--optim.lr=1e-3", "optim.lr", "0.003", "0.001"),
        ("--optim.betas=[0.9, 0.99]", "optim.betas", "[0.9, 0.95]", "[0.9, 0.99]"),
        ("--schedule.warmup_steps=5", "schedule.warmup_steps", "10", "5"),
        ("--schedule.kind=constant", "schedule.kind", "'cosine'", "'constant'"),
        ("--train.sequence_length=128", "train.sequence_length", "64", "128"),
        ("--train.document_masking=true", "train.document_masking", "False", "True"),
        ("--train.steps=60", "train.steps", "40", "60"),
    ],
)
def test_a_recipe_change_to_the_maths_is_refused_naming_field_values_and_fix(run, override, field, old, new):
    with pytest.raises(TrainingStateError) as err:
        resume(run, override)
    message = str(err.value)
    assert "\n" not in message
    assert f"changes {field} from {old} (checkpoint) to {new}" in message, message
    assert "new run_dir" in message and "--checkpoint.allow_recipe_change=true" in message


def test_allow_recipe_change_continues_and_names_each_change_loudly(run, capsys):
    assert resume(run, "--train.precision=bf16", "--optim.lr=1e-3", "--checkpoint.allow_recipe_change=true")[0] == 20
    loud = [line for line in capsys.readouterr().err.splitlines() if line.startswith("!!!")]
    assert [line.split(": ")[1].split(" changed")[0] for line in loud] == ["train.precision", "optim.lr"]
    assert all("checkpoint.allow_recipe_change=true" in line for line in loud)


@pytest.mark.parametrize("allow", [False, True])
def test_a_new_global_batch_size_is_refused_even_with_allow_recipe_change(run, allow):
    # The data order maps step N to the sequences [N*B, (N+1)*B): at another B, step 20 on would
    # skip or repeat data, so no flag lets it through; the fix is a new stage from the checkpoint.
    loader = FakeLoader()
    recipe = recipe_for(run, "--train.global_batch_tokens=4096", f"--checkpoint.allow_recipe_change={allow}")
    with pytest.raises(TrainingStateError) as err:
        find_resume(run, recipe, recipe.model_spec(), "jax", loader, recipe.total_steps())
    message = str(err.value)
    ckpt = checkpoint_dir(run, 20)
    assert "\n" not in message
    assert f"{ckpt}: the recipe changes train.global_batch_tokens from 8192 (checkpoint) to 4096" in message
    assert "even with checkpoint.allow_recipe_change" in message and "skip or repeat data" in message
    assert "set it back to 8192" in message
    assert f"new run_dir (--init.checkpoint={ckpt} --init.load_optimizer=true" in message
    assert loader.step == 0  # refused before the loader state was restored


def test_layout_and_cadence_stay_changeable(run, capsys):
    changed = [
        "--jax.mesh.fsdp=2",
        "--jax.mesh.data=-1",
        "--train.micro_batch_size=2",
        "--torch.parallel=ddp",
        "--log.every=5",
        "--eval.every=7",
        "--checkpoint.every=3",
        "--checkpoint.keep=9",
        "--data.prefetch=0",
        "--spike_guard.enabled=true",
        "--train.seed=5",
        "--train.sequence_length=64",  # the mixture's length, which null meant
        "--train.steps=",
        "--train.tokens=327680",  # the same 40 steps of 8192 tokens
    ]
    assert resume(run, *changed)[0] == 20
    out = capsys.readouterr()
    assert "!!!" not in out.err + out.out


@pytest.mark.parametrize(
    "schedule",
    [
        ["--schedule.kind=constant"],
        ["--schedule.kind=wsd", "--schedule.decay_fraction=0.25"],  # still stable at step 20 of 40 or 60
        ["--schedule.warmup_steps=20"],  # cosine, but every step so far was warmup
    ],
)
def test_more_steps_are_accepted_where_the_schedule_so_far_stays_the_same(tmp_path, schedule, capsys):
    run = tmp_path / "run"
    for step in (10, 20):
        commit(run, step, recipe_for(run, *schedule))
    assert resume(run, *schedule, "--train.steps=60")[0] == 20
    assert "train.steps: 40 -> 60; the" in capsys.readouterr().out


def test_clean_orphans_removes_what_interrupted_saves_and_writes_left(run, capsys):
    root = run / "checkpoints"
    gone, alive = dead_pid(), os.getpid()
    (root / "step_00000005" / "state").mkdir(parents=True)  # an interrupted prune or save, older
    # an interrupted or failed save, newer than the newest complete checkpoint: never resumed from
    (root / "step_00000030" / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    (root / f".convert-{gone}" / "checkpoints").mkdir(parents=True)
    stale = [
        run / f".recipe.yaml.tmp-{gone}",
        run / f".spec.json.tmp-{gone}",
        checkpoint_dir(run, 10) / f".meta.json.tmp-{gone}",
    ]
    live = run / f".metrics.jsonl.tmp-{alive}"
    for p in (*stale, live):
        p.write_text("partial")
    clean_orphans(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020"]
    assert not any(p.exists() for p in stale) and live.exists()
    assert len(capsys.readouterr().out.splitlines()) == 6
    assert [s for s, _ in complete_checkpoints(run)] == [10, 20]
    assert resume(run)[0] == 20


def test_clean_orphans_removes_the_temporaries_of_fileio_writes_whose_process_is_gone(run, capsys):
    gone = dead_pid()
    writer = fileio.AtomicWriter(run / "spec.json")  # open: its temporary is beside spec.json
    (temp,) = [name for name in os.listdir(run) if name.startswith(f".spec.json.tmp-{os.getpid()}-")]
    orphan = run / temp.replace(f".tmp-{os.getpid()}-", f".tmp-{gone}-")
    os.link(run / temp, orphan)  # the same temporary, as a process that died would have left it
    clean_orphans(run)
    assert not orphan.exists() and (run / temp).exists()  # a live writer's is kept
    assert capsys.readouterr().out == f"removed {orphan}: temporary file of a write that never finished\n"
    writer.abort()
    assert not (run / temp).exists()


def test_a_refused_new_total_prints_both_lrs_so_they_differ():
    """A linear decay from 3e-3 to 0 over 1000 or 1001 steps gives step 1 3e-3 x 999/1000 =
    0.002997 and 3e-3 x 1000/1001 = 0.002997003 (by hand): they differ in the 7th significant
    digit, so four digits printed both as 0.002997. Each must print as itself."""
    from olmo_run.resume import _maths_changes

    args = [
        "--model=tiny",
        "--schedule.kind=linear",
        "--schedule.warmup_steps=0",
        "--schedule.alpha=0",
        "--optim.lr=3e-3",
    ]
    old = load_recipe(None, [*args, "--train.steps=1000"])
    new = load_recipe(None, [*args, "--train.steps=1001"])
    [(key, a, b, why)] = _maths_changes(old.model_dump(mode="json"), new, new.model_spec(), 64, 5)
    assert (key, a, b) == ("train.steps", 1000, 1001)
    shown_new, shown_old = why.split("(step 1: ")[1].rstrip(")").split(" instead of ")
    assert shown_new != shown_old
    assert float(shown_new) == pytest.approx(3e-3 * 1000 / 1001, rel=1e-15)
    assert float(shown_old) == pytest.approx(3e-3 * 999 / 1000, rel=1e-15)
    assert f"{float(shown_new):.4g}" == f"{float(shown_old):.4g}" == "0.002997"  # what used to print


def test_turning_the_sharded_optimizer_on_or_off_is_a_layout_change_not_a_maths_change():
    """optim.sharded places the same AdamW state over the ranks (a layout); a resume may turn it
    on or off without --checkpoint.allow_recipe_change. Another optim key still counts."""
    from olmo_run.resume import _maths_changes

    old = load_recipe(None, ["--model=tiny"])
    sharded = load_recipe(None, ["--model=tiny", "--optim.sharded=true"])
    assert _maths_changes(old.model_dump(mode="json"), sharded, sharded.model_spec(), 64, 5) == []
    assert _maths_changes(sharded.model_dump(mode="json"), old, old.model_spec(), 64, 5) == []
    eps = load_recipe(None, ["--model=tiny", "--optim.sharded=true", "--optim.eps=1e-6"])
    [(key, a, b, _)] = _maths_changes(old.model_dump(mode="json"), eps, eps.model_spec(), 64, 5)
    assert (key, a, b) == ("optim.eps", 1e-8, 1e-6)
