"""The default job (model "small", the embedded sample mixture, cosine with warmup 10) in a
short version, with a torch.profiler trace of one step. The train-line contract (keys, logged
LR, batch digests) is the root tests/test_trainer_contract.py."""

from __future__ import annotations

import json
import math


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
