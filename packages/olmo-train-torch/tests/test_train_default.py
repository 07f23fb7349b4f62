"""The default job (model "small", the embedded sample mixture, cosine with warmup 10) in a
short version, and the metrics contract: keys, logged LR vs the schedule written out here."""

from __future__ import annotations

import json
import math

from olmo_model.runlog import TRAIN_KEYS


def test_default_job_loss_falls_short_version(harness, tmp_path):
    run_dir = tmp_path / "default"
    # The default recipe with fewer, shorter sequences so the test fits on a shared CPU.
    result = harness.run(
        [
            f"--run_dir={run_dir}",
            "--train.steps=20",
            "--train.sequence_length=128",
            "--train.global_batch_tokens=1024",
            "--log.progress=false",
            "--profile.start_step=2",
            "--profile.steps=1",
        ]
    )
    harness.check_ok(result)
    # torch.profiler's Chrome trace of step 2, one file per rank; the trainer's ops are in it.
    trace = json.loads((run_dir / "profile" / "steps_2-2" / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)
    lines = harness.train_lines(run_dir)
    losses = [r["loss"] for r in lines]
    assert len(losses) == 20 and abs(losses[0] - math.log(4096)) < 0.2  # a fresh model is near uniform
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert evals and evals[-1]["step"] == 20
    for vals in evals[-1]["eval"].values():
        assert vals["loss"] < losses[0] and math.isclose(vals["perplexity"], math.exp(vals["loss"]))
    assert (run_dir / "loss.png").stat().st_size > 0


def test_metrics_keys_and_logged_lr(harness, one_process_run):
    lines = harness.train_lines(one_process_run)
    peak, warmup, total, alpha = 3e-3, 10, 20, 0.1  # the recipe defaults: cosine, warmup 10, to 0.1 x peak
    for r in lines:
        assert set(r) == set(TRAIN_KEYS)
        s = r["step"]
        if s <= warmup:
            want = peak * s / warmup
        else:
            want = alpha * peak + (1 - alpha) * peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        assert math.isclose(r["lr"], want, rel_tol=1e-12), (s, r["lr"], want)
        assert r["tokens_seen"] == s * 16 * 64
        assert r["mfu_peak"].startswith("measured cpu fp32 matmul")
        assert r["skipped"] is False
