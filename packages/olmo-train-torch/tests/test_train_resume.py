"""Exact resume over two processes: 6 uninterrupted steps vs 3 steps + SIGKILL of rank 0 right
after the step-3 checkpoint (tests/support/kill_after_checkpoint.py) + restart, and vs SIGTERM
to rank 0 alone during step 2 (tests/support/signal_at_step.py: both ranks stop after step 2
with its checkpoint, exit status 4) + restart, all under torchrun's environment (FSDP2 over
gloo, synchronous save). The resumed steps must be bitwise equal:
equality of bits does not depend on how many steps follow the restored state, so a few steps on
each side of the checkpoint prove it. The one-process case, the same contract as the JAX
trainer's, is the root tests/test_trainer_contract.py."""

from __future__ import annotations

from olmo_run.checkpoints import complete_checkpoints

STEPS, KILL_AT = 6, 3


def _assert_resumed_bitwise(harness, reference, resumed_dir):
    ref = {r["step"]: r for r in harness.train_lines(reference)}
    got = harness.train_lines(resumed_dir)
    # the killed run's steps 1-3, then 4-6, no repeats
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        want = ref[r["step"]]
        assert r["batch_digest"] == want["batch_digest"]
        # == on purpose: same process count, same kernels, restored fp32 state -> same bits.
        assert (r["loss"], r["grad_norm"], r["lr"]) == (want["loss"], want["grad_norm"], want["lr"]), r["step"]


def test_exact_resume_two_processes(harness, mixture, tmp_path):
    args = (
        "--torch.parallel=fsdp",
        "--checkpoint.async_save=false",
        f"--train.steps={STEPS}",
        f"--checkpoint.every={KILL_AT}",
    )
    reference = tmp_path / "reference"
    harness.check_ok(harness.run(harness.args(mixture, reference, *args), nproc=2))
    run_dir = tmp_path / "killed"
    killed = harness.run(harness.args(mixture, run_dir, *args), nproc=2, kill_after=KILL_AT)
    assert killed.returncode != 0
    assert [s for s, _ in complete_checkpoints(run_dir)] == [KILL_AT]
    harness.check_ok(harness.run(harness.args(mixture, run_dir, *args), nproc=2))
    _assert_resumed_bitwise(harness, reference, run_dir)

    preempted = tmp_path / "preempted"
    stopped = harness.run(harness.args(mixture, preempted, *args), nproc=2, signal_at=2)
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("olmo-train-torch")]
    # Rank 0's line (only rank 0 reports); rank 1, never signalled, stopped at the same step.
    assert lines == [
        "olmo-train-torch: preempted: SIGTERM received: stopped after step 2 with its checkpoint committed "
        f"({preempted / 'checkpoints' / 'step_00000002'}); rerun the same command to resume"
    ], stopped.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(preempted)] == [2]
    assert [r["step"] for r in harness.train_lines(preempted)] == [1, 2]
    assert not (preempted / "RUN_LOCK").exists()
    harness.check_ok(harness.run(harness.args(mixture, preempted, *args), nproc=2))
    _assert_resumed_bitwise(harness, reference, preempted)
