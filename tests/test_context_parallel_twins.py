"""The two trainers agree under context parallelism as they do without it: the same recipe (spec
"tiny": sliding window 32 on layers 0-2, global layer 3; sequences of 128, so at context degree 2
the four 32-token chunks make every sliding window reach into the other rank's chunk; document
masking on), the same initial weights (both draw them from ``olmo_model.init`` for the seed), the
embedded sample mixture, fp32, run by each trainer's real entry point at context degree 2:
olmo-train-torch as two gloo processes (with torchrun's environment), olmo-train-jax on two
simulated CPU devices. The runs are about agreement, not the launch: each is forked with the
trainer imported (tests/support/ranks.py).

Reference: each trainer's own CP=1 run of the same recipe, and the threshold the unsplit twins are
held to (``olmo-parity train``: per-step |loss difference| <= 1e-4, tools/tests/test_train_parity.py).
The torch and JAX CP runs must each follow their own CP=1 run within
``olmo_model.layout_loss_tolerance`` (the packages' CP tests' bound: CP only reorders sums, which
AdamW carries forward), and be within 1e-4 of each other. A JAX run's XLA_FLAGS are this process's
(a CPU code path chosen by flags: --xla_cpu_max_isa=AVX2) plus its device count.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ranks import run_cli_forked

from olmo_data import open_training_mixture
from olmo_data.digest import batch_digest
from olmo_model import layout_loss_tolerance
from olmo_run.metrics import read_metrics

STEPS = 8
RECIPE = [
    "--model=tiny",
    "--train.sequence_length=128",
    "--train.global_batch_tokens=512",  # 4 sequences: 2 per data-parallel rank at CP=1 on 2 ranks
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    "--train.document_masking=true",
    "--train.seed=5",
    "--optim.lr=1e-3",
    f"--eval.every={STEPS}",
    f"--checkpoint.every={STEPS}",
    "--checkpoint.async_save=false",
    "--log.progress=false",
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(framework: str, run_dir: Path, context: int) -> dict[int, float]:
    args = [*RECIPE, f"--run_dir={run_dir}"]
    if framework == "torch":
        args += ["--torch.parallel=fsdp", f"--torch.context_parallel={context}"]
        done = run_cli_forked("torch", args, 2, env={"OMP_NUM_THREADS": "1"}, timeout=600)  # 2 gloo ranks
    else:
        args += ["--jax.mesh.data=1", "--jax.mesh.context=2"] if context == 2 else ["--jax.mesh.data=2"]
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
        done = run_cli_forked("jax", args, env={"XLA_FLAGS": flags}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[tuple[str, int], dict[int, dict]]:
    root = tmp_path_factory.mktemp("cp-twins")
    return {(fw, c): run(fw, root / f"{fw}-cp{c}", c) for fw in ("torch", "jax") for c in (1, 2)}


@pytest.fixture(scope="module")
def losses(records) -> dict[tuple[str, int], dict[int, float]]:
    return {key: {s: r["loss"] for s, r in by_step.items()} for key, by_step in records.items()}


def test_each_trainer_under_cp_matches_its_unsplit_run(losses):
    for fw in ("torch", "jax"):
        split, whole = losses[(fw, 2)], losses[(fw, 1)]
        assert sorted(split) == list(range(1, STEPS + 1))
        for s in whole:  # 4 sequences of 128 tokens a step
            assert abs(split[s] - whole[s]) <= layout_loss_tolerance(whole[s], 512, s), (fw, s, split[s], whole[s])


def test_the_twins_agree_under_cp_as_without_it(losses):
    for c in (1, 2):
        t, j = losses[("torch", c)], losses[("jax", c)]
        assert max(abs(t[s] - j[s]) for s in t) <= 1e-4, c
    # Not a flat line: both learn.
    assert losses[("torch", 2)][STEPS] < losses[("torch", 2)][1] - 0.1


def test_every_run_logs_the_data_packages_digest_of_each_global_batch(records):
    """Both trainers, with and without CP (each process hashes its own rows, a CP pair's rows
    count once), log at step s the digest olmo-data computes for global batch s - 1."""
    mixture = open_training_mixture("sample", sequence_length=128)
    want = {s: batch_digest(mixture.order.global_batch(s - 1, 4), s - 1, 0) for s in range(1, STEPS + 1)}
    assert len(set(want.values())) == STEPS
    for key, by_step in records.items():
        assert {s: r["batch_digest"] for s, r in by_step.items()} == want, key
