"""Exact resume over two processes: 20 uninterrupted steps vs 10 steps + SIGKILL of rank 0
right after the step-10 checkpoint (tests/support/kill_after_checkpoint.py) + restart, both
under torchrun (FSDP2 over gloo, synchronous save). Steps 11-20 must be bitwise equal. The
one-process case, the same contract as the JAX trainer's, is the root
tests/test_trainer_contract.py."""

from __future__ import annotations

from olmo_model.runlog import complete_checkpoints


def _assert_resumed_bitwise(harness, reference, resumed_dir):
    ref = {r["step"]: r for r in harness.train_lines(reference)}
    got = harness.train_lines(resumed_dir)
    assert [r["step"] for r in got] == list(range(1, 21))  # killed run's 1-10, then 11-20, no repeats
    for r in got:
        want = ref[r["step"]]
        assert r["batch_digest"] == want["batch_digest"]
        # == on purpose: same process count, same kernels, restored fp32 state -> same bits.
        assert (r["loss"], r["grad_norm"], r["lr"]) == (want["loss"], want["grad_norm"], want["lr"]), r["step"]


def test_exact_resume_two_processes(harness, mixture, tmp_path):
    args = ("--torch.parallel=fsdp", "--checkpoint.async_save=false")
    reference = tmp_path / "reference"
    harness.check_ok(harness.run(harness.args(mixture, reference, *args), nproc=2))
    run_dir = tmp_path / "killed"
    killed = harness.run(harness.args(mixture, run_dir, *args), nproc=2, kill_after=10)
    assert killed.returncode != 0
    assert [s for s, _ in complete_checkpoints(run_dir)] == [10]
    harness.check_ok(harness.run(harness.args(mixture, run_dir, *args), nproc=2))
    _assert_resumed_bitwise(harness, reference, run_dir)
