"""A checkpoint that cannot be written (a full disk) stops the JAX trainer at once, in one line.

The real entry point in this process (one CPU device, tiny model, 6 steps, checkpoints at 2, 4
and 6, the embedded sample mixture). The disk fills while Orbax writes the step-4 arrays: the
array write raises what TensorStore raises then (``ValueError: RESOURCE_EXHAUSTED: ... No space
left on device [os_error_code='28']``, copied from a run on a full 3 MiB tmpfs), injected into
Orbax's own array-serialization call, so it surfaces through Orbax's background thread as the
real one does. With ``checkpoint.async_save`` (the default) step 5 runs while that save is in
flight and waits for its end, as a step slower than the write would; its poll must stop the run.

Asserted: exit status 5 and exactly one stderr line naming the step-4 checkpoint and "No space
left on device"; no train line past step 4 and no step 6; step 2 the only complete checkpoint,
which resume picks; the partial step-4 folder still there without meta.json. Then the rerun
without the fault: it removes the partial folder at start, resumes from step 2, logs each step
once, and steps 3-4 are bitwise the failed run's (same process, same kernels, restored state).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_checks import full_disk_then_rerun

from olmo_run.checkpoints import checkpoint_dir
from olmo_train_jax.cli import main
from olmo_train_jax.train import JaxTrainModule

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
]


@pytest.fixture
def disk_full_at_step_4(monkeypatch):
    """Every array write of the step-4 checkpoint fails as TensorStore's does on a full disk;
    step 5 waits for the background save to end."""
    from orbax.checkpoint._src.serialization import serialization

    write = serialization.async_serialize_from_host
    step_dir = checkpoint_dir(Path("x"), FAIL_AT).name

    async def full_disk(rslices, tensorstore_spec, **kwargs):
        if step_dir in str(tensorstore_spec):
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing in OCDBT database at local file "{step_dir}": Failed to '
                "write 3371008 bytes to file 4: No space left on device [os_error_code='28']"
            )
        return await write(rslices, tensorstore_spec, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    step = JaxTrainModule.train_step

    def step_outlasting_the_save(self, batch, n, lr, guard, metrics):
        if n == FAIL_AT + 1 and self.checkpointer._commit is not None:
            self.checkpointer._commit.join()
        return step(self, batch, n, lr, guard, metrics)

    monkeypatch.setattr(JaxTrainModule, "train_step", step_outlasting_the_save)


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_full_disk_stops_at_once_in_one_line_and_a_rerun_resumes(
    disk_full_at_step_4, monkeypatch, tmp_path, capsys, async_save
):
    run = tmp_path / "run"
    args = [*ARGS, f"--checkpoint.async_save={async_save}", f"--run_dir={run}"]
    full_disk_then_rerun(main, "olmo-train-jax", args, run, capsys, monkeypatch, FAIL_AT)
