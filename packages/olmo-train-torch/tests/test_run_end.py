"""How a torch run ends when it does not end well: divergence stops it (status 3) with every
checkpoint on disk finite, and a save in flight is committed when the loop raises. (A run killed
between its final checkpoint and its final eval: tests/test_trainer_contract.py, both trainers.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from olmo_run.checkpoints import complete_checkpoints, read_meta


def _divergent_args(harness, mixture, run_dir: Path) -> list[str]:
    # lr 1e6 blows the weights up within a few steps; a checkpoint every step, two kept: the
    # run the issue saw prune every good checkpoint and keep NaN ones.
    return harness.args(
        mixture,
        run_dir,
        "--optim.lr=1e6",
        "--checkpoint.every=1",
        "--checkpoint.keep=2",
        "--checkpoint.async_save=false",
    )


def _finite_checkpoint(ckpt: Path) -> bool:
    """Every float tensor of a DCP checkpoint (model and AdamW moments) is finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    out.unlink()
    tensors = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(state)
    floats = [t for t in tensors if t.is_floating_point()]
    assert len(floats) > 20  # the model and both moments, not an empty walk
    return all(bool(torch.isfinite(t).all()) for t in floats)


def test_lr_1e6_stops_non_zero_and_keeps_only_finite_checkpoints(harness, mixture, tmp_path):
    run_dir = tmp_path / "diverged"
    result = harness.run(_divergent_args(harness, mixture, run_dir))
    assert result.returncode == 3, result.stderr[-3000:]
    err = [line for line in result.stderr.splitlines() if line.startswith("olmo-train-torch:")]
    assert len(err) == 1 and "not finite" in err[0], result.stderr[-3000:]
    logged = [r["step"] for r in harness.train_lines(run_dir)]
    stopped_at = logged[-1] + 1 if logged else 1
    assert stopped_at < 20  # it did stop early
    done = complete_checkpoints(run_dir)
    assert done, "the checkpoints before the divergence are kept"
    assert all(step < stopped_at for step, _ in done)
    for _, ckpt in done:
        assert _finite_checkpoint(ckpt), ckpt
    # Resuming the stopped run with the same lr stops again, without touching the good checkpoints.
    before = [s for s, _ in done]
    again = harness.run(_divergent_args(harness, mixture, run_dir))
    assert again.returncode == 3
    assert [s for s, _ in complete_checkpoints(run_dir)][: len(before)] == before


def _short_mixture(root: Path) -> Path:
    """One training source of exactly 10.5 global batches (168 windows of 64) that may be read
    once: the loader raises RepetitionLimitError at step 11."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(3)

    def docs(n: int) -> np.ndarray:
        out = []
        while sum(len(d) for d in out) < n:
            out.append(np.append(rng.integers(1, 4096, int(rng.integers(20, 100))), 0))
        flat = np.concatenate(out)[:n].astype(np.uint16)
        flat[-1] = 0
        return flat

    docs(168 * 64).tofile(root / "a.bin")
    docs(8 * 64).tofile(root / "held.bin")
    (root / "mixture.yaml").write_text(
        "name: short\nsequence_length: 64\nseed: 1\neos_token_id: 0\nvocab_size: 4096\n"
        "sources:\n  - {name: a, paths: [a.bin], format: numpy, dtype: uint16, ratio: 1.0, max_repetition: 1.0}\n"
        "held_out:\n  - {name: held, paths: [held.bin], format: numpy, dtype: uint16}\n"
        "eval: {sequences_per_source: 8}\n"
    )
    return root / "mixture.yaml"


def test_a_pending_async_save_is_committed_when_the_loop_raises(harness, tmp_path):
    mixture = _short_mixture(tmp_path / "short")
    run_dir = tmp_path / "run"
    # The step-10 save runs in the background; step 11's batch does not exist, so the loop
    # raises before the next poll() could commit the save.
    result = harness.run(harness.args(mixture, run_dir, "--checkpoint.async_save=true"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "max_repetition" in result.stderr
    assert [s for s, _ in complete_checkpoints(run_dir)] == [10]
    assert read_meta(run_dir / "checkpoints" / "step_00000010")["step"] == 10
