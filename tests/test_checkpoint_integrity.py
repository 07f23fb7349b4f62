"""Checkpoint integrity, the same contract for both trainers, through each real entry point
in-process (one process; torch saves with async DCP, JAX with Orbax).

One 6-step run per trainer (checkpoints at 2, 4, 6) is the reference; each test copies it, drops
step 6 so that step 4 is what a restart resumes, damages the copy and restarts it:

- flipped bytes in an array file, a missing array file, a missing index (Orbax ``_METADATA``,
  DCP ``.metadata``), an unreadable meta.json: a one-line error naming the file and
  ``--checkpoint.fallback=true`` with the older good step, and the run dir untouched;
- with ``--checkpoint.fallback=true`` the run resumes from step 2 and completes, its steps 3-6
  bitwise the reference's, and start-up removed the orphans planted in the run dir;
- a changed ``train.precision`` is refused in one line naming both values;
- a checkpoint of format /1 (before checksums) resumes unverified with a warning, and a file
  missing from it is still a one-line error (the framework's own).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_checks import refused

from olmo_run.checkpoints import UNCHECKED_FORMAT, complete_checkpoints, read_verified_meta
from olmo_run.metrics import read_metrics

# The fixture (one_torch_thread) lives in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6
ARGS = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    "--checkpoint.every=2",
    "--eval.every=1000",
    "--log.progress=false",
    "--torch.parallel=none",
]


@dataclass(frozen=True)
class Layout:
    """Where a trainer's checkpoint keeps what, and how its own loader words a missing file."""

    index: str  # the framework's index of the arrays, relative to the checkpoint
    array_glob: str  # the files holding the arrays
    missing_array_error: str  # the framework's error for an unverified checkpoint missing one

    def largest_array_file(self, checkpoint: Path) -> Path:
        return max(checkpoint.glob(self.array_glob), key=lambda p: p.stat().st_size)


LAYOUTS = {
    "jax": Layout("state/_METADATA", "state/ocdbt.process_*/d/*", "Orbax cannot restore it onto this model"),
    "torch": Layout(".metadata", "*.distcp", "cannot load it into this model/optimizer"),
}


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def flip_bytes(path: Path, n: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module", params=["jax", "torch"])
def trainer(request, tmp_path_factory):
    """(framework, its CLI main, its checkpoint layout, the reference run dir)."""
    framework = request.param
    main = importlib.import_module(f"olmo_train_{framework}.cli").main
    reference = tmp_path_factory.mktemp(f"{framework}-integrity") / "reference"
    assert main([*ARGS, f"--run_dir={reference}"]) == 0
    return framework, main, LAYOUTS[framework], reference


@pytest.fixture
def restarted(trainer, tmp_path) -> Path:
    """The reference run as a crash right after its step-4 checkpoint would have left it."""
    run = tmp_path / "run"
    shutil.copytree(trainer[3], run)
    shutil.rmtree(ckpt(run, 6))
    return run


def test_meta_json_records_every_file(trainer):
    _, _, layout, reference = trainer
    meta = read_verified_meta(ckpt(reference, 6))
    on_disk = {
        p.relative_to(ckpt(reference, 6)).as_posix(): p.stat().st_size
        for p in ckpt(reference, 6).rglob("*")
        if p.is_file() and p.name != "meta.json"
    }
    assert {rel: entry["bytes"] for rel, entry in meta["files"].items()} == on_disk
    assert layout.index in on_disk and any(ckpt(reference, 6).glob(layout.array_glob))
    for rel, entry in meta["files"].items():
        assert entry["sha256"] == hashlib.sha256((ckpt(reference, 6) / rel).read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["flipped array bytes", "missing array file", "missing index", "unreadable meta"])
def test_a_damaged_checkpoint_is_refused_in_one_line_and_nothing_is_written(trainer, restarted, capsys, damage):
    _, main, layout, _ = trainer
    four = ckpt(restarted, 4)
    if damage == "flipped array bytes":
        named = layout.largest_array_file(four)
        flip_bytes(named)
    elif damage == "missing array file":
        named = layout.largest_array_file(four)
        named.unlink()
    elif damage == "missing index":
        named = four / layout.index
        named.unlink()
    else:
        named = four / "meta.json"
        named.write_text(named.read_text()[:-200])
    before = snapshot(restarted)
    refused(
        main,
        capsys,
        [*ARGS, f"--run_dir={restarted}"],
        str(named),
        "damaged",
        "--checkpoint.fallback=true resumes from step 2",
    )
    assert snapshot(restarted) == before


def test_fallback_resumes_from_the_older_checkpoint_and_completes(trainer, restarted, capsys):
    _, main, layout, reference = trainer
    flip_bytes(layout.largest_array_file(ckpt(restarted, 4)))
    # Orphans of interrupted saves and writes, removed at start-up.
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphans = [
        ckpt(restarted, 1),
        restarted / f".recipe.yaml.tmp-{gone.pid}",
        restarted / f".spec.json.tmp-{gone.pid}",
        ckpt(restarted, 2) / f".meta.json.tmp-{gone.pid}",
    ]
    orphans[0].mkdir()
    (orphans[0] / "half-a-save").write_bytes(b"partial")
    for p in orphans[1:]:
        p.write_text("partial")
    capsys.readouterr()
    assert main([*ARGS, f"--run_dir={restarted}", "--checkpoint.fallback=true"]) == 0
    out = capsys.readouterr()
    assert any(line.startswith("!!! step_00000004 skipped: ") for line in out.err.splitlines()), out.err
    assert f"resumed from {ckpt(restarted, 2)} at step 2" in out.out
    want, got = losses(reference), losses(restarted)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(3, STEPS + 1)] == [want[s] for s in range(3, STEPS + 1)]  # bitwise
    assert [s for s, _ in complete_checkpoints(restarted)] == [2, 4, 6]
    for step in (2, 4, 6):
        read_verified_meta(ckpt(restarted, step))  # the rewritten step 4 verifies
    assert not any(p.exists() for p in orphans)


def test_a_checkpoint_from_before_checksums_still_fails_in_one_line_when_damaged(trainer, restarted, capsys):
    """Format /1 (no "files") is resumed unverified, with a warning; a file missing from it
    is then the framework's error, still one line."""
    _, main, layout, _ = trainer
    meta_file = ckpt(restarted, 4) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["files"]
    meta_file.write_text(json.dumps({**meta, "format": UNCHECKED_FORMAT}))
    layout.largest_array_file(ckpt(restarted, 4)).unlink()
    capsys.readouterr()
    assert main([*ARGS, f"--run_dir={restarted}"]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("!!! ") and "its files are not verified" in warning
    assert layout.missing_array_error in error and "damaged" in error, error


def test_a_changed_precision_is_refused(trainer, restarted, capsys):
    main = trainer[1]
    before = snapshot(restarted)
    refused(
        main,
        capsys,
        [*ARGS, f"--run_dir={restarted}", "--train.precision=bf16"],
        "train.precision from 'fp32' (checkpoint) to 'bf16'",
        "--checkpoint.allow_recipe_change=true",
    )
    assert snapshot(restarted) == before
