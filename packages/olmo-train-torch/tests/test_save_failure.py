"""A checkpoint that cannot be written (a full disk) stops the torch trainer at once, in one line.

The real entry point in this process (one process, tiny model, 6 steps, checkpoints at 2, 4 and
6, the embedded sample mixture). The step-4 checkpoint's data file is a link to ``/dev/full``,
where every write fails with ENOSPC from the kernel: torch.save's zip writer turns that into
"RuntimeError: [enforce fail at inline_container.cc] unexpected pos N vs M", with the errno lost,
as on a real full disk. With ``checkpoint.async_save`` (the default) step 5 runs while that save
is in flight and waits for its end, as a step slower than the write would; its poll must stop
the run.

Asserted: exit status 5 and exactly one stderr line naming the step-4 checkpoint and "No space
left on device"; no train line past step 4 and no step 6; step 2 the only complete checkpoint,
which resume picks; the partial step-4 folder still there without meta.json. Then the rerun
without the fault: it removes the partial folder at start, resumes from step 2, logs each step
once, and steps 3-4 are bitwise the failed run's (same process, same kernels, restored state).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from cli_checks import full_disk_then_rerun
from torch.distributed.checkpoint.filesystem import FileSystem

from olmo_run.checkpoints import checkpoint_dir
from olmo_train_torch.cli import main
from olmo_train_torch.train import TorchTrainModule

# The fixture (one_torch_thread) lives in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAIL_AT = 4
ARGS = [
    "--model=tiny",
    "--train.sequence_length=64",
    "--train.global_batch_tokens=512",
    "--train.steps=6",
    "--train.precision=fp32",
    "--checkpoint.every=2",
    "--eval.every=1000",
    "--log.progress=false",
    "--torch.parallel=none",
]


@pytest.fixture
def disk_full_at_step_4(monkeypatch):
    """The step-4 checkpoint's data file is a link to /dev/full, made as DCP creates the folder;
    step 5 waits for the save to end."""
    step_dir = checkpoint_dir(Path("x"), FAIL_AT).name
    mkdir = FileSystem.mkdir

    def mkdir_on_a_full_disk(self, path):
        mkdir(self, path)
        if Path(path).name == step_dir:
            (Path(path) / "__0_0.distcp").symlink_to("/dev/full")  # DCP's file of rank 0

    monkeypatch.setattr(FileSystem, "mkdir", mkdir_on_a_full_disk)
    step = TorchTrainModule.train_step

    def step_outlasting_the_save(self, batch, n, lr, guard, metrics):
        if n == FAIL_AT + 1 and self.checkpointer.pending is not None:
            concurrent.futures.wait([self.checkpointer.pending[0]])
        return step(self, batch, n, lr, guard, metrics)

    monkeypatch.setattr(TorchTrainModule, "train_step", step_outlasting_the_save)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_full_disk_stops_at_once_in_one_line_and_a_rerun_resumes(
    disk_full_at_step_4, monkeypatch, tmp_path, capsys, async_save
):
    run = tmp_path / "run"
    args = [*ARGS, f"--checkpoint.async_save={async_save}", f"--run_dir={run}"]
    full_disk_then_rerun(main, "olmo-train-torch", args, run, capsys, monkeypatch, FAIL_AT)


def test_another_ranks_cut_short_file_is_one_line_too(tmp_path):
    """Rank 1's disk filled: rank 0 gets DCP's CheckpointException holding rank 1's zip-writer
    error, with no errno in this process; still a one-line CheckpointWriteError naming it."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from olmo_run.errors import CheckpointWriteError
    from olmo_train_torch.checkpoint import _local_writer, _save_failure

    ckpt = checkpoint_dir(tmp_path, FAIL_AT)
    cut = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    failure = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (cut, traceback.StackSummary())})
    err = _save_failure(failure, ckpt, tmp_path, _local_writer(ckpt))
    assert isinstance(err, CheckpointWriteError) and "\n" not in str(err)
    assert str(err).startswith(f"saving checkpoint {ckpt} failed: a file was cut short (torch.save's writer: "), err
    assert "unexpected pos 704 vs 598" in str(err) and "no checkpoint was committed yet" in str(err)
    bug = ValueError("a bug, not a write")
    assert _save_failure(bug, ckpt, tmp_path, _local_writer(ckpt)) is bug
