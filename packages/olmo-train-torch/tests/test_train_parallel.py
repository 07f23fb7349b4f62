"""Data parallelism over processes (torchrun, gloo on CPU, fp32): 4 processes (HSDP 2 x 2)
follow the single-process run per step, and an elastic resume of that 4-process run's step-10
checkpoint on 2 processes (DDP, 2 accumulation micro-steps) sees the same global batches and
follows the uninterrupted 4-process run. "Follows" is within ``layout_loss_tolerance``: the rank
count reorders the fp32 sums of the step's 16 x 64 token losses (4.5e-5 at loss 8.3 at the first
step from equal weights), and from the next step on AdamW carries that forward (2.5e-4 more: a
measured drift envelope, the helper's docstring)."""

from __future__ import annotations

import shutil

from olmo_model import layout_loss_tolerance
from olmo_run.checkpoints import checkpoint_dir


def test_four_processes_match_one_then_resume_on_two(harness, mixture, one_process_run, tmp_path):
    four = tmp_path / "four"
    result = harness.run(harness.args(mixture, four, "--torch.parallel=hsdp", "--torch.replicate=2"), nproc=4)
    harness.check_ok(result)
    assert "'dp_replicate': 2, 'dp_shard': 2" in result.stdout
    one = harness.train_lines(one_process_run)
    ref = harness.train_lines(four)
    assert len(ref) == len(one) == 20
    for a, b in zip(one, ref):
        assert a["batch_digest"] == b["batch_digest"]
        tol = layout_loss_tolerance(a["loss"], 16 * 64, a["step"])
        assert abs(a["loss"] - b["loss"]) <= tol, (a["step"], a["loss"], b["loss"])
        assert b["tokens_per_second_per_device"] * 4 == b["tokens_per_second"]

    elastic = tmp_path / "elastic"
    shutil.copytree(four, elastic)
    shutil.rmtree(checkpoint_dir(elastic, 20))
    result = harness.run(harness.args(mixture, elastic, "--torch.parallel=ddp", "--train.micro_batch_size=4"), nproc=2)
    harness.check_ok(result)
    assert "global batch 16 = 4 per device x 2 data-parallel x 2 accumulation" in result.stdout
    assert "written with global batch 16 = 4 per device x 4 data-parallel x 1 accumulation" in result.stdout
    got = harness.train_lines(elastic)
    assert [r["step"] for r in got] == list(range(1, 21))
    for a, b in zip(ref[10:], got[10:]):
        assert a["batch_digest"] == b["batch_digest"]
        tol = layout_loss_tolerance(a["loss"], 16 * 64, a["step"] - 10)  # steps from the step-10 checkpoint
        assert abs(a["loss"] - b["loss"]) <= tol, (a["step"], a["loss"], b["loss"])


def test_fsdp_bf16_with_activation_checkpointing_tracks_fp32(harness, mixture, one_process_run, tmp_path):
    """FSDP2 mixed precision (bf16 params/compute, fp32 reduce and master weights) with
    per-block activation checkpointing stays near the fp32 curve."""
    run_dir = tmp_path / "bf16"
    harness.check_ok(
        harness.run(
            harness.args(
                mixture,
                run_dir,
                "--train.precision=bf16",
                "--torch.activation_checkpointing=true",
                "--train.steps=20",
                "--checkpoint.every=20",
            ),
            nproc=2,
        )
    )
    fp32 = harness.train_lines(one_process_run)
    bf16 = harness.train_lines(run_dir)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(fp32, bf16)]
    assert max(diffs) < 0.05, diffs
    assert max(diffs) > 0  # really computed in bf16
