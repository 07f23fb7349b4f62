"""The sharded optimizer state through the real entry point (gloo CPU ranks, fp32, tiny-moe with
expert parallelism 2): processes because that is what the layout is (torchrun's ranks, DCP
checkpoints written by 4 and read by 2).

- DDP + EP 2 + ``optim.sharded`` on 4 ranks follows one process for 20 steps within
  ``olmo_model.layout_loss_tolerance`` (the rank count reorders the fp32 sums; lr 5e-4, as the
  other EP comparisons, test_moe_trainer.py, keeps learned routing's near-tie flips small);
- SIGKILL right after the step-5 checkpoint, then a restart: steps 6-7 bitwise those of the
  uninterrupted run (the same layout restores the same fp32 masters and moments);
- its step-10 checkpoint resumed on 2 ranks under FSDP2 (no sharded optimizer), and that run's
  step-15 checkpoint back on 2 ranks with the sharded optimizer: each step within that bound,
  counted from step 10, of the uninterrupted run.

The schedule is a constant LR, so a run of 7, 15 or 17 steps gives its steps the LR the 20-step run
gives them, and the shorter runs compare step by step with it.
"""

from __future__ import annotations

import shutil

import pytest

from olmo_model import layout_loss_tolerance
from olmo_run.checkpoints import checkpoint_dir, complete_checkpoints

TOKENS = 16 * 64  # the harness's global batch
COMMON = (
    "--model=tiny-moe",
    "--optim.lr=5e-4",
    "--schedule.kind=constant",
    "--checkpoint.async_save=false",
)
SHARDED = ("--torch.parallel=ddp", "--torch.expert_parallel=2", "--optim.sharded=true")


def _args(harness, mixture, run_dir, *extra: str) -> list[str]:
    base = [a for a in harness.args(mixture, run_dir) if not a.startswith("--model=")]
    return [*base, *COMMON, *extra]


@pytest.fixture(scope="module")
def runs(harness, mixture, tmp_path_factory):
    """20 steps on one process and on 4 ranks with the sharded optimizer (checkpoints 10, 20)."""
    root = tmp_path_factory.mktemp("sharded")
    one, four = root / "one", root / "four"
    harness.check_ok(harness.run(_args(harness, mixture, one, "--torch.parallel=none")))
    result = harness.run(_args(harness, mixture, four, *SHARDED), nproc=4)
    harness.check_ok(result)
    assert "experts on mesh {'edp': 2, 'ep': 2}" in result.stdout
    return one, four


def _within(harness, got_dir, want_dir, steps: list[int], since: int) -> None:
    want = {r["step"]: r for r in harness.train_lines(want_dir)}
    got = harness.train_lines(got_dir)
    assert [r["step"] for r in got] == steps
    for r in got[since:]:
        a = want[r["step"]]
        assert r["batch_digest"] == a["batch_digest"]
        tol = layout_loss_tolerance(a["loss"], TOKENS, r["step"] - since)
        assert abs(r["loss"] - a["loss"]) <= tol, (r["step"], r["loss"], a["loss"], tol)


def test_ddp_ep2_sharded_optimizer_follows_one_process_for_20_steps(harness, runs):
    one, four = runs
    want = harness.train_lines(one)
    assert want[-1]["loss"] < want[0]["loss"] - 0.3, "the run does not learn"
    _within(harness, four, one, list(range(1, 21)), since=0)
    assert all(r["moe_dropped_tokens"] == 0 for r in harness.train_lines(four))


def test_sharded_optimizer_resumes_bitwise_after_sigkill(harness, mixture, runs, tmp_path):
    _, four = runs
    run_dir = tmp_path / "killed"
    args = _args(harness, mixture, run_dir, *SHARDED, "--train.steps=7", "--checkpoint.every=5")
    killed = harness.run(args, nproc=4, kill_after=5)
    assert killed.returncode != 0
    assert [s for s, _ in complete_checkpoints(run_dir)] == [5]
    resumed = harness.run(args, nproc=4)
    harness.check_ok(resumed)
    assert "resumed from" in resumed.stdout
    keys = ("batch_digest", "loss", "grad_norm", "moe_tokens_per_expert")
    harness.assert_resumed_bitwise(run_dir, four, keys, steps=list(range(1, 8)))


def test_sharded_checkpoint_resumes_on_fsdp_with_two_ranks_and_back(harness, mixture, runs, tmp_path):
    _, four = runs
    fsdp = tmp_path / "fsdp"
    shutil.copytree(four, fsdp)
    shutil.rmtree(checkpoint_dir(fsdp, 20))
    fsdp_args = ("--torch.parallel=fsdp", "--torch.expert_parallel=2", "--train.steps=15", "--checkpoint.every=5")
    harness.check_ok(harness.run(_args(harness, mixture, fsdp, *fsdp_args), nproc=2))
    _within(harness, fsdp, four, list(range(1, 16)), since=10)

    back = tmp_path / "back"
    shutil.copytree(fsdp, back)
    result = harness.run(_args(harness, mixture, back, *SHARDED, "--train.steps=17"), nproc=2)
    harness.check_ok(result)
    assert "resumed from" in result.stdout and "step_00000015" in result.stdout
    _within(harness, back, four, list(range(1, 18)), since=10)
