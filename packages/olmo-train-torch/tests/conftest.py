"""Shared fixtures: a tiny mixture of numpy token files, and ``harness`` with helpers that
run the real trainer entry point (one process, or torchrun with gloo) in a subprocess
(pytest runs with --import-mode=importlib, so tests reach these through a fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import cli_checks
import numpy as np
import pytest
from ranks import run_cli_forked

SEQ = 64
GLOBAL_BATCH = 16  # sequences; divides over 1, 2 and 4 ranks
BASE_ARGS = [
    "--model=tiny",
    f"--train.global_batch_tokens={SEQ * GLOBAL_BATCH}",
    "--train.precision=fp32",
    "--log.progress=false",
    "--data.prefetch=1",
]


def _write_docs(path: Path, rng: np.random.Generator, n_tokens: int, vocab: int) -> None:
    """EOS(0)-terminated documents of 20-200 tokens, ids from a skewed distribution so a
    model has something to learn."""
    out, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(20, 200))
        doc = np.minimum(rng.zipf(1.3, size=n) + 1, vocab - 1).astype(np.uint16)
        out += [doc, np.zeros(1, np.uint16)]
        total += n + 1
    tokens = np.concatenate(out)[:n_tokens]
    tokens[-1] = 0  # a token file ends with eos (olmo_data refuses one that looks truncated)
    tokens.tofile(path)


def make_mixture(root: Path, seed: int = 7, order_seed: int = 1234) -> Path:
    """Two training sources and one held-out source, vocab 4096, sequence length SEQ."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("a", 48_000), ("b", 32_000), ("held", 4_096)):
        _write_docs(root / f"{name}.bin", rng, n, 4096)
    (root / "mixture.yaml").write_text(
        f"""name: tiny-test
sequence_length: {SEQ}
seed: {order_seed}
eos_token_id: 0
vocab_size: 4096
sources:
  - {{name: a, paths: [a.bin], format: numpy, dtype: uint16, ratio: 0.6}}
  - {{name: b, paths: [b.bin], format: numpy, dtype: uint16, ratio: 0.4}}
held_out:
  - {{name: held, paths: [held.bin], format: numpy, dtype: uint16}}
eval:
  sequences_per_source: 8
"""
    )
    return root / "mixture.yaml"


@pytest.fixture(scope="session")
def mixture(tmp_path_factory) -> Path:
    return make_mixture(tmp_path_factory.mktemp("mixture"))


def run_trainer(
    args: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    kill_after: int | None = None,
    signal_at: int | None = None,
):
    """Run olmo-train-torch's entry point (``cli.main``) as one process or ``nproc`` gloo ranks
    with torchrun's environment, forked with torch already imported (tests/support/ranks.py
    ``run_cli_forked``; real torchrun: the tests about the launch, ``run_cli_launched``). With
    ``kill_after`` rank 0 SIGKILLs itself right after the step-N checkpoint is committed
    (tests/support/kill_after_checkpoint.py); with ``signal_at`` rank 0 alone gets SIGTERM
    during step N (tests/support/signal_at_step.py)."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    return run_cli_forked("torch", args, nproc, env, timeout, kill_after, signal_at=signal_at)


def train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in lines if r["kind"] == "train"]


def assert_resumed_bitwise(run_dir: Path, reference: Path, keys: tuple[str, ...], steps: list[int]) -> None:
    """The resumed run's train lines carry exactly the steps ``steps`` and, for each, the same
    values of ``keys`` as the uninterrupted reference (== on purpose: same layout, same kernels,
    restored fp32 state -> same bits)."""
    want = {r["step"]: r for r in train_lines(reference)}
    got = train_lines(run_dir)
    assert [r["step"] for r in got] == steps
    for r in got:
        assert [r[k] for k in keys] == [want[r["step"]][k] for k in keys], r["step"]


def common_args(mixture: Path, run_dir: Path, *extra: str) -> list[str]:
    """20 steps, a checkpoint at 10 and 20, held-out evaluation at the end only."""
    return [
        f"--data.mixture={mixture}",
        f"--run_dir={run_dir}",
        "--train.steps=20",
        "--checkpoint.every=10",
        "--eval.every=1000",
        *BASE_ARGS,
        *extra,
    ]


def check_ok(result) -> None:
    assert result.returncode == 0, (
        f"trainer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


@pytest.fixture(scope="session")
def one_process_run(mixture, tmp_path_factory) -> Path:
    """The uninterrupted 20-step single-process run several tests compare against."""
    run_dir = tmp_path_factory.mktemp("ref") / "one"
    check_ok(run_trainer(common_args(mixture, run_dir)))
    return run_dir


def refused(capsys, args: list[str], *expected: str) -> None:
    """``olmo-train-torch ARGS`` in this process exits 2 with one stderr line holding ``expected``."""
    from olmo_train_torch.cli import main

    cli_checks.refused(main, capsys, args, *expected)


class Harness:
    make_mixture = staticmethod(make_mixture)
    run = staticmethod(run_trainer)
    args = staticmethod(common_args)
    check_ok = staticmethod(check_ok)
    train_lines = staticmethod(train_lines)
    assert_resumed_bitwise = staticmethod(assert_resumed_bitwise)
    refused = staticmethod(refused)


@pytest.fixture(scope="session")
def harness() -> type[Harness]:
    return Harness
