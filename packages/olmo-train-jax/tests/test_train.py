"""End-to-end tests of ``olmo-train-jax``: the real entry point on a tiny model (CPU, fp32).

Runs that need several simulated devices, or a hard crash, are subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``; one-device runs call ``cli.main``
in-process. The data is a small synthetic mixture written by the tests (sequence 64, global
batch 16 sequences), except for the default-job test, which trains on the embedded sample.
What both trainers promise alike (the train-line keys, exact resume after SIGKILL, bad input,
HF init, elastic resume) is tested once for both in the root tests/test_trainer_contract.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ranks import run_cli_forked

from olmo_model import layout_loss_tolerance
from olmo_run.checkpoints import complete_checkpoints, read_meta
from olmo_run.metrics import read_metrics
from olmo_run.recipe import load_recipe
from olmo_train_jax.cli import main

STEPS = 20
BASE = [
    "--model=tiny",
    "--train.global_batch_tokens=1024",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    "--checkpoint.every=10",
    "--eval.every=10",
    "--log.progress=false",
]
# 8 devices: data 4 x fsdp 2 (sharded weights and AdamW state), 2 sequences per device.
EIGHT = ["--jax.mesh.data=4", "--jax.mesh.fsdp=2", "--train.micro_batch_size=2"]


def _documents(rng: np.random.Generator, n_tokens: int) -> np.ndarray:
    """EOS-terminated documents where each token has 8 possible successors: learnable, and
    13-gram collisions between independent draws are practically impossible."""
    out: list[int] = []
    while len(out) < n_tokens:
        a = int(rng.integers(2, 4096))
        doc = [a]
        for _ in range(int(rng.integers(20, 200))):
            a = (a * 7 + 13 + int(rng.integers(0, 8))) % 4094 + 2
            doc.append(a)
        out.extend(doc + [0])
    return np.asarray(out, np.uint16)


def write_mixture(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train_a", 60_000), ("train_b", 30_000), ("held", 3_000)):
        _documents(rng, n).tofile(root / f"{name}.bin")
    (root / "mixture.yaml").write_text(
        "name: jax-trainer-test\nsequence_length: 64\nseed: 7\neos_token_id: 0\nvocab_size: 4096\n"
        "sources:\n"
        "  - {name: a, paths: [train_a.bin], format: numpy, dtype: uint16, ratio: 0.6}\n"
        "  - {name: b, paths: [train_b.bin], format: numpy, dtype: uint16, ratio: 0.4}\n"
        "held_out:\n  - {name: held, paths: [held.bin], format: numpy, dtype: uint16}\n"
        "eval: {sequences_per_source: 16}\n"
    )
    return root / "mixture.yaml"


def run_subprocess(args: list[str], devices: int = 1, kill_after: int | None = None) -> subprocess.CompletedProcess:
    """olmo-train-jax in a fresh process on ``devices`` simulated CPU devices; with ``kill_after`` it
    SIGKILLs itself right after the step-N checkpoint is committed (the test-only entry point
    tests/support/kill_after_checkpoint.py)."""
    # Forked with JAX and the trainer already imported (tests/support/ranks.py): a fresh process
    # whose XLA_FLAGS still set its device count, without paying the imports again. This
    # process's own XLA_FLAGS come along (a CPU code path chosen by flags: --xla_cpu_max_isa=AVX2).
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()}
    return run_cli_forked("jax", args, env=env, timeout=900, kill_after=kill_after)


def train_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def train_losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in train_records(run_dir).items()}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    return write_mixture(tmp_path_factory.mktemp("mixture"))


@pytest.fixture(scope="module")
def one_device_run(mixture, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "one"
    # Also the TensorBoard sink and a two-step profile: neither may change a logged number.
    observe = ["--log.sinks=[tensorboard]", "--profile.start_step=3", "--profile.steps=2"]
    assert main([*BASE, *observe, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]) == 0
    return run_dir


@pytest.fixture(scope="module")
def eight_device_run(mixture, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "eight"
    done = run_subprocess([*BASE, *EIGHT, f"--data.mixture={mixture}", f"--run_dir={run_dir}"], devices=8)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=4 x fsdp=2 x tensor=1 over 8 cpu device(s)" in done.stdout
    return run_dir


def test_tensorboard_sink_and_profile_trace(one_device_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (one_device_run / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    train = [r for r in read_metrics(one_device_run) if r["kind"] == "train"]
    # float32 event values: the float64 losses rounded to float32.
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["step"], float(np.float32(r["loss"]))) for r in train
    ]
    # jax.profiler's trace of steps 3-4: TensorBoard's profile plugin layout, one xplane per host.
    (trace,) = (one_device_run / "profile" / "steps_3-4").glob("plugins/profile/*/*.xplane.pb")
    assert trace.stat().st_size > 1000


def loss_tolerance(loss: float, step: int) -> float:
    """Two layouts reorder the fp32 sums of a step's 16 x 64 token losses and, from step 2 on,
    start from weights AdamW has moved apart in the last bits: ``layout_loss_tolerance`` (4.5e-5
    at step 1, 2.9e-4 later, at loss 8.3; the 1- vs 8-device gaps measured: at most 4.8e-6
    here, 1.05e-5 reported on an AMD Zen 4, bench/results/2026-12-03-layout-bounds-cpu.md)."""
    return layout_loss_tolerance(loss, 16 * 64, step)


def test_eight_devices_match_one_device(one_device_run, eight_device_run):
    one, eight = train_records(one_device_run), train_records(eight_device_run)
    assert sorted(eight) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        a, b = one[s], eight[s]
        assert abs(a["loss"] - b["loss"]) <= loss_tolerance(a["loss"], s), (s, a["loss"], b["loss"])
        # The grad norm sees every gradient: a normalisation or reduction bug in one layout moves
        # it by a factor (x2 for a sum taken twice), far beyond the 1e-3 that rounding drift stays under
        # (bench/layout_drift.py prints the relative grad-norm difference per step).
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (s, a["grad_norm"], b["grad_norm"])
    # The comparison means something only if training moves the loss far more than the bound.
    assert one[1]["loss"] - one[STEPS]["loss"] > 10 * loss_tolerance(one[1]["loss"], STEPS)


def test_default_job_loss_falls(tmp_path):
    """The README's default job (model "small", the embedded sample, bf16), shortened to 30
    steps of 4 x 512 tokens."""
    run_dir = tmp_path / "default"
    args = ["--train.steps=30", "--train.global_batch_tokens=2048", f"--run_dir={run_dir}", "--log.progress=false"]
    assert main(args) == 0
    losses = [train_losses(run_dir)[s] for s in range(1, 31)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert evals and all(np.isfinite(v["perplexity"]) for v in evals[-1]["eval"].values())
    assert json.loads((run_dir / "spec.json").read_text())["d_model"] == 128


def adam_count(run_dir: Path, ckpt: Path) -> int:
    """The AdamW step count stored in a checkpoint (restored onto one device)."""
    return int(restored_state(run_dir, ckpt)[1][0].count)


def restored_state(run_dir: Path, ckpt: Path) -> tuple:
    """(params, AdamW state) of a checkpoint, restored onto one device."""
    import jax
    from flax import nnx

    from olmo_train_jax import parallelize
    from olmo_train_jax.checkpoint import abstract_like, load_checkpoint
    from olmo_train_jax.model import build_model
    from olmo_train_jax.step import make_optimizer

    recipe = load_recipe(run_dir / "recipe.yaml", [])
    spec = recipe.model_spec()
    params = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: build_model(spec)))[1])
    mesh = parallelize.build_mesh({"data": -1})
    params_sh = parallelize.param_shardings(params, spec, mesh)
    abstract_opt = jax.eval_shape(make_optimizer(params, recipe).init, params)
    opt_sh = parallelize.state_shardings(abstract_opt, params_sh, mesh)
    restored, opt_state, _ = load_checkpoint(
        ckpt, abstract_like(params, params_sh), abstract_like(abstract_opt, opt_sh)
    )
    return restored, opt_state


def test_spike_guard_skips_leave_the_optimizer_untouched(mixture, tmp_path):
    run_dir = tmp_path / "guarded"
    # A hair-trigger guard: after 2 accepted steps, anything above the running mean is a spike.
    guard = ["--spike_guard.enabled=true", "--spike_guard.min_history=2", "--spike_guard.sigma=1e-6"]
    steps = 8
    args = [*BASE, f"--train.steps={steps}", f"--data.mixture={mixture}", f"--run_dir={run_dir}", *guard]
    assert main(args) == 0
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    skipped = [r["step"] for r in train if r["skipped"]]
    assert skipped and len(skipped) < steps
    assert all(r["tokens_seen"] == r["step"] * 16 * 64 for r in train)  # a skipped batch is consumed

    ckpt = run_dir / "checkpoints" / f"step_{steps:08d}"
    meta = read_meta(ckpt)
    assert len(meta["spike_guard"]["losses"]) == steps - len(skipped)
    assert meta["loader_state"]["step"] == steps
    assert adam_count(run_dir, ckpt) == steps - len(skipped)  # Adam's step count saw only accepted steps


def test_init_from_our_checkpoint_takes_its_weights_and_moments(mixture, one_device_run, tmp_path):
    """A new stage from another run's step-10 checkpoint. With an LR of 1e-12 its one update
    changes nothing measurable, so its held-out loss must be the one the source run logged at
    step 10; the AdamW step count continues from that run's 10."""
    run_dir = tmp_path / "stage2"
    ckpt = one_device_run / "checkpoints" / "step_00000010"
    assert (
        main(
            [
                *BASE,
                "--train.steps=1",
                "--optim.lr=1e-12",
                f"--init.checkpoint={ckpt}",
                "--init.load_optimizer=true",
                f"--data.mixture={mixture}",
                f"--run_dir={run_dir}",
            ]
        )
        == 0
    )
    evals = {r["step"]: r["eval"]["held"]["loss"] for r in read_metrics(one_device_run) if r["kind"] == "eval"}
    stage2 = [r["eval"]["held"]["loss"] for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert stage2 == [pytest.approx(evals[10], abs=1e-6)]
    assert stage2[0] != pytest.approx(evals[20], abs=1e-6)  # and not some other checkpoint's weights
    ckpt1 = run_dir / "checkpoints" / "step_00000001"
    assert read_meta(ckpt1)["loader_state"]["step"] == 1  # the new stage's data starts at its own batch 0
    assert adam_count(run_dir, ckpt1) == 11


def test_lr_1e6_stops_non_zero_and_keeps_only_finite_checkpoints(mixture, tmp_path, capsys):
    """lr 1e6 blows the weights up within a few steps. With a checkpoint every step and two
    kept, the run used to go on with NaN losses, save NaN checkpoints and prune the good ones."""
    import jax

    run_dir = tmp_path / "diverged"
    args = [
        *BASE,
        "--optim.lr=1e6",
        "--checkpoint.every=1",
        "--checkpoint.keep=2",
        f"--data.mixture={mixture}",
        f"--run_dir={run_dir}",
    ]
    capsys.readouterr()
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not finite" in err, err
    logged = sorted(train_losses(run_dir))
    stopped_at = logged[-1] + 1 if logged else 1
    assert stopped_at < STEPS
    done = complete_checkpoints(run_dir)
    assert done and all(step < stopped_at for step, _ in done)
    for _, ckpt in done:
        leaves = jax.tree.leaves(restored_state(run_dir, ckpt))
        floats = [x for x in leaves if np.issubdtype(x.dtype, np.floating)]
        assert len(floats) > 20 and all(bool(np.isfinite(np.asarray(x)).all()) for x in floats), ckpt


def test_allowed_leakage_is_recorded_with_the_held_out_figures(mixture, tmp_path, capsys):
    """A held-out source copied from training is refused; with data.allow_leakage=true the run
    trains, and every eval line and the summary say the held-out figures may be memorised."""
    leaky = tmp_path / "leaky"
    shutil.copytree(mixture.parent, leaky)
    (leaky / "held.bin").write_bytes((leaky / "train_a.bin").read_bytes()[:6_000])
    tokens = np.fromfile(leaky / "held.bin", np.uint16)
    tokens[: np.flatnonzero(tokens == 0)[-1] + 1].tofile(leaky / "held.bin")  # whole documents only
    args = [
        *BASE,
        "--train.steps=2",
        "--eval.every=2",
        f"--data.mixture={leaky / 'mixture.yaml'}",
        f"--run_dir={tmp_path / 'run'}",
    ]
    capsys.readouterr()
    assert main(args) == 2
    assert "held_out 'held'" in capsys.readouterr().err
    assert main([*args, "--data.allow_leakage=true"]) == 0
    evals = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2] and all(r["leakage_allowed"] is True for r in evals)
    assert "ALLOWED (data.allow_leakage=true)" in capsys.readouterr().err
