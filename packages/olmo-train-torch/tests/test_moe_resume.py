"""Exact resume of an MoE run (tiny-moe, one process, the real entry point): 4 uninterrupted
steps vs 2 steps + SIGKILL right after the step-2 checkpoint + restart; steps 3-4 must be
bitwise equal, routing included (the per-expert token counts)."""

from __future__ import annotations

from olmo_run.checkpoints import complete_checkpoints


def test_moe_exact_resume_one_process(harness, mixture, tmp_path):
    def args(run_dir):
        base = [a for a in harness.args(mixture, run_dir) if not a.startswith("--model=")]
        return [*base, "--model=tiny-moe", "--train.steps=4", "--checkpoint.every=2"]

    reference = tmp_path / "reference"
    harness.check_ok(harness.run(args(reference)))
    run_dir = tmp_path / "killed"
    killed = harness.run(args(run_dir), kill_after=2)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]
    resumed = harness.run(args(run_dir))
    harness.check_ok(resumed)
    assert "resumed from" in resumed.stdout

    keys = ("batch_digest", "loss", "grad_norm", "moe_tokens_per_expert", "moe_lb_loss", "moe_router_z_loss")
    harness.assert_resumed_bitwise(run_dir, reference, keys, steps=[1, 2, 3, 4])
