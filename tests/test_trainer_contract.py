"""The contract both trainers promise, one test per clause, each parametrized over the framework
and run through the trainer's real entry point (``cli.main`` in this process, or a subprocess
where the test needs a hard crash or more than one device or process).

On one synthetic mixture written by the module (sequence 64, global batch 16 sequences, tiny
model, fp32, CPU), one uninterrupted 20-step run per framework (checkpoints and held-out evals
at steps 10 and 20) is the reference the tests compare against:

1. every train line has exactly ``metrics.TRAIN_KEYS``, its LR is the recipe schedule's at that
   step, and its ``batch_digest`` is ``olmo_data.digest.batch_digest`` of the global batch the
   data order defines for that step;
2. SIGKILL right after the step-10 checkpoint, then a restart: every step's loss, grad norm, LR
   and batch digest, and the final held-out loss, bitwise the uninterrupted run's; SIGKILL
   between a checkpoint and its eval (step 10 or the final one): the rerun writes that eval;
   SIGTERM during step 5: a checkpoint of step 5, exit status 4, and a bitwise resume;
3. bad input (an unknown recipe key, a batch the layout cannot split, a checkpoint of another
   spec, a changed mixture on resume) exits 2 with one line and leaves the run dir as it was,
   byte for byte and mtime for mtime; a finished run restarted exits 0 and writes nothing;
4. ``--init.checkpoint=hf:DIR`` starts from the folder's weights: the step-1 loss is
   transformers' Olmo3ForCausalLM loss on the same batch;
5. elastic: the 1-device / 1-process step-10 checkpoint resumed on 2 devices (JAX: tensor
   parallel, simulated CPU devices) or 2 processes (torch: DDP over gloo under torchrun) sees
   the same global batches and follows the uninterrupted run within the layout bound
   (``olmo_model.layout_loss_tolerance``: fp32 rounding, and AdamW's drift after the first step).

What only one trainer has (JAX 8 devices vs 1, torch multi-process exact resume, ...) stays in
that trainer's own tests.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_checks import refused
from ranks import run_cli_forked, run_cli_launched

from olmo_data import load_mixture
from olmo_data.digest import batch_digest
from olmo_model import fp32_mean_tolerance, get_preset, hf_config, hf_param_shapes, layout_loss_tolerance
from olmo_model.moe import MOE_KEYS
from olmo_run.checkpoints import checkpoint_dir, complete_checkpoints
from olmo_run.metrics import TRAIN_KEYS, read_metrics
from olmo_run.recipe import load_recipe

# The fixtures one_torch_thread and run_helpers live in the workspace's root conftest.py.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMEWORKS = ["jax", "torch"]
KILL_SCRIPT = Path(__file__).resolve().parent / "support" / "kill_after_checkpoint.py"
STEPS, SEQ, BATCH = 20, 64, 16  # BATCH sequences of SEQ tokens per step
ARGS = [
    "--model=tiny",
    f"--train.global_batch_tokens={SEQ * BATCH}",
    f"--train.steps={STEPS}",
    "--train.precision=fp32",
    "--checkpoint.every=10",
    "--eval.every=10",
    "--log.progress=false",
    "--torch.parallel=none",  # one torch process without a process group (the JAX trainer ignores it)
]


# ---- the mixture -------------------------------------------------------------------------------


def _documents(rng: np.random.Generator, n_tokens: int) -> np.ndarray:
    """EOS(0)-terminated documents of 20-200 tokens, ids drawn from a Zipf law so that 20 steps
    lower the loss well below uniform's (a run that trains nothing is visible)."""
    out: list[np.ndarray] = []
    total = 0
    while total < n_tokens:
        doc = np.minimum(rng.zipf(1.3, size=int(rng.integers(20, 200))) + 1, 4095)
        out += [doc, np.zeros(1, np.int64)]
        total += doc.size + 1
    return np.concatenate(out).astype(np.uint16)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """Two training sources (60/40) and one held-out source, vocab 4096, sequence SEQ."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    for name, n in (("train_a", 48_000), ("train_b", 32_000), ("held", 3_000)):
        _documents(rng, n).tofile(root / f"{name}.bin")
    (root / "mixture.yaml").write_text(
        f"name: trainer-contract\nsequence_length: {SEQ}\nseed: 7\neos_token_id: 0\nvocab_size: 4096\n"
        "sources:\n"
        "  - {name: a, paths: [train_a.bin], format: numpy, dtype: uint16, ratio: 0.6}\n"
        "  - {name: b, paths: [train_b.bin], format: numpy, dtype: uint16, ratio: 0.4}\n"
        "held_out:\n  - {name: held, paths: [held.bin], format: numpy, dtype: uint16}\n"
        f"eval: {{sequences_per_source: {BATCH}}}\n"
    )
    return root / "mixture.yaml"


# ---- running a trainer -------------------------------------------------------------------------


def cli_main(framework: str) -> Callable[[list[str]], int]:
    return importlib.import_module(f"olmo_train_{framework}.cli").main


def run_cli(
    framework: str, args: list[str], ranks: int = 1, kill_after: int | None = None, signal_at: int | None = None
):
    """The trainer's CLI in a fresh process: JAX on ``ranks`` simulated CPU devices, torch as one
    process or, for ``ranks`` > 1, that many under torchrun (gloo). With ``kill_after`` it
    SIGKILLs itself right after the step-N checkpoint is committed
    (tests/support/kill_after_checkpoint.py); with ``signal_at`` it gets SIGTERM during step N
    (tests/support/signal_at_step.py)."""
    stops = {"kill_after": kill_after, "signal_at": signal_at}
    if framework == "jax":
        # Forked with JAX and the trainer imported (tests/support/ranks.py), XLA_FLAGS its own: this
        # process's (a CPU code path chosen by flags: --xla_cpu_max_isa=AVX2) plus the device count.
        env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ranks}".strip()}
        return run_cli_forked("jax", args, env=env, timeout=900, **stops)
    if ranks == 1:  # one torch process, forked the same way; the elastic test's two ranks: torchrun
        return run_cli_forked("torch", args, env={"OMP_NUM_THREADS": "1"}, timeout=900, **stops)
    entry = None if kill_after is None else [str(KILL_SCRIPT), "torch", str(kill_after)]
    return run_cli_launched("torch", args, ranks, entry=entry)  # one intra-op thread, as one_torch_thread


def check_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def train_lines(run_dir: Path) -> dict[int, dict]:
    """The train lines by step; a step logged twice (a resume that repeated it) fails here."""
    lines = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert len({r["step"] for r in lines}) == len(lines), [r["step"] for r in lines]
    return {r["step"]: r for r in lines}


def evals(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r["eval"] for r in read_metrics(run_dir) if r["kind"] == "eval"}


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder``: a file's sha256 and mtime, a folder's mtime (a file created
    and removed again changes its folder's)."""
    out = {".": f"dir {folder.stat().st_mtime_ns}"}
    for p in sorted(folder.rglob("*")):
        kind = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(folder))] = f"{kind} {p.stat().st_mtime_ns}"
    return out


@dataclass(frozen=True)
class Reference:
    framework: str
    run_dir: Path

    @property
    def main(self) -> Callable[[list[str]], int]:
        return cli_main(self.framework)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def reference(request, mixture, tmp_path_factory) -> Reference:
    """The uninterrupted 20-step run of one framework, one process, one device."""
    run_dir = tmp_path_factory.mktemp(f"{request.param}-reference") / "run"
    assert cli_main(request.param)([*ARGS, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]) == 0
    return Reference(request.param, run_dir)


def loss_tolerance(loss: float, step: int) -> float:
    """Another layout reorders the fp32 sums of a step's BATCH x SEQ token losses, and from the
    second step after the layout change AdamW carries that forward: ``layout_loss_tolerance``
    with ``step`` counted from the checkpoint both runs resume (3.8e-5 at loss 7.0 at its step 1,
    2.9e-4 later; the gaps measured on both CPU code paths:
    packages/olmo-train-jax/bench/results/2026-12-03-layout-bounds-cpu.md)."""
    return layout_loss_tolerance(loss, BATCH * SEQ, step)


# ---- 1. the train line -------------------------------------------------------------------------


def default_lr(step: int) -> float:
    """The recipe's default schedule written out from its definition: peak 3e-3, linear warmup
    over 10 steps, then a cosine to 0.1 x peak at the last step."""
    peak, warmup, alpha = 3e-3, 10, 0.1
    if step <= warmup:
        return peak * step / warmup
    return alpha * peak + (1 - alpha) * peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))


def test_train_lines_have_the_contract_keys_lr_and_batch_digests(reference, mixture):
    recipe = load_recipe(reference.run_dir / "recipe.yaml", [])
    lines = train_lines(reference.run_dir)
    assert sorted(lines) == list(range(1, STEPS + 1))
    order = load_mixture(mixture).order
    z_loss_weight = get_preset("tiny").z_loss_weight
    for step, r in lines.items():
        assert tuple(r) == TRAIN_KEYS
        assert r["lr"] == recipe.schedule.lr(step, recipe.optim.lr, STEPS)
        assert math.isclose(r["lr"], default_lr(step), rel_tol=1e-12), (step, r["lr"], default_lr(step))
        # Global batch step - 1 of the data order, all BATCH rows from row 0.
        assert r["batch_digest"] == batch_digest(order.global_batch(step - 1, BATCH), step - 1, 0), step
        assert r["tokens_seen"] == step * BATCH * SEQ
        assert r["skipped"] is False
        assert r["mfu_peak"].startswith("measured cpu fp32 matmul")
        assert r["memory_kind"] == "host_rss" and 0 < r["memory_gib"] <= r["memory_peak_gib"]
        assert r["loss"] == pytest.approx(r["ce_loss"] + z_loss_weight * r["z_loss"], rel=1e-6)
    assert lines[STEPS]["loss"] < lines[1]["loss"] - 0.5  # it trains
    held = evals(reference.run_dir)
    assert sorted(held) == [10, 20]
    assert held[20]["held"]["tokens"] == BATCH * SEQ
    assert held[20]["held"]["perplexity"] == pytest.approx(math.exp(held[20]["held"]["loss"]))
    assert [s for s, _ in complete_checkpoints(reference.run_dir)] == [10, 20]
    assert (reference.run_dir / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_moe_train_line_adds_exactly_the_moe_keys(framework, mixture, tmp_path):
    run_dir = tmp_path / "moe"
    args = [*ARGS, "--model=tiny-moe", "--train.steps=2", f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    assert cli_main(framework)(args) == 0
    lines = train_lines(run_dir)
    assert sorted(lines) == [1, 2]
    spec = get_preset("tiny-moe")
    assert spec.moe is not None
    for r in lines.values():
        assert tuple(r) == TRAIN_KEYS + MOE_KEYS
        # Every token's top-k assignments in every (MoE) layer, and the dropless blocks drop none.
        assert sum(r["moe_tokens_per_expert"]) == spec.n_layers * BATCH * SEQ * spec.moe.top_k
        assert r["moe_dropped_tokens"] == 0
        assert r["moe_rank_load_max_over_mean"] == 1.0  # one expert-parallel rank


# ---- 2. exact resume after SIGKILL --------------------------------------------------------------


def test_sigkill_after_a_checkpoint_then_resume_is_bitwise_the_uninterrupted_run(reference, mixture, tmp_path):
    run_dir = tmp_path / "killed"
    args = [*ARGS, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    killed = run_cli(reference.framework, args, kill_after=10)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [10]
    resumed = run_cli(reference.framework, args)
    check_ok(resumed)
    assert f"resumed from {checkpoint_dir(run_dir, 10)} at step 10" in resumed.stdout
    want, got = train_lines(reference.run_dir), train_lines(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # the killed run's 1-10, then 11-20, no repeats
    keys = ("loss", "grad_norm", "lr", "batch_digest")
    for step in range(1, STEPS + 1):
        # == on purpose: same layout, same kernels, restored fp32 state -> same bits.
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step
    assert evals(run_dir)[20] == evals(reference.run_dir)[20]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [10, 20]


@pytest.mark.parametrize("kill_at", [10, STEPS])
def test_a_kill_between_a_checkpoint_and_its_eval_is_made_good_by_the_rerun(reference, mixture, tmp_path, kill_at):
    """A middle eval (step 10) and the final one (step 20): the rerun writes the missing one
    before it trains on (or, at the end, instead of training)."""
    run_dir = tmp_path / "killed"
    # A synchronous save commits the step's checkpoint (and the kill follows) before its eval.
    args = [*ARGS, "--checkpoint.async_save=false", f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    killed = run_cli(reference.framework, args, kill_after=kill_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == list(range(10, kill_at + 1, 10))
    assert sorted(evals(run_dir)) == list(range(10, kill_at, 10)) and not (run_dir / "loss.png").exists()
    assert reference.main(args) == 0
    # Every eval and step on the same layout and kernels as the reference (the missing eval on
    # the restored weights), so the same bits.
    assert evals(run_dir) == evals(reference.run_dir)
    assert (run_dir / "loss.png").stat().st_size > 0
    want, got = train_lines(reference.run_dir), train_lines(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))  # nothing trained twice
    assert all(got[s]["loss"] == want[s]["loss"] for s in got)


def test_sigterm_mid_run_commits_the_step_in_flight_and_the_rerun_is_bitwise(reference, mixture, tmp_path):
    """SIGTERM while step 5 is in flight (no checkpoint due before 10): the step finishes, its
    checkpoint is committed, RUN_LOCK is released, one line, exit status 4; the rerun resumes at
    5 and every step's numbers and the evals are the uninterrupted run's bits."""
    run_dir = tmp_path / "preempted"
    args = [*ARGS, f"--data.mixture={mixture}", f"--run_dir={run_dir}"]
    stopped = run_cli(reference.framework, args, signal_at=5)
    assert stopped.returncode == 4, stopped.stderr[-3000:]
    prog = f"olmo-train-{reference.framework}"
    assert [line for line in stopped.stderr.splitlines() if line.startswith(prog)] == [
        f"{prog}: preempted: SIGTERM received: stopped after step 5 with its checkpoint committed "
        f"({checkpoint_dir(run_dir, 5)}); rerun the same command to resume"
    ]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [5]
    assert sorted(train_lines(run_dir)) == [1, 2, 3, 4, 5] and not (run_dir / "RUN_LOCK").exists()
    resumed = run_cli(reference.framework, args)
    check_ok(resumed)
    assert f"resumed from {checkpoint_dir(run_dir, 5)} at step 5" in resumed.stdout
    want, got = train_lines(reference.run_dir), train_lines(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    keys = ("loss", "grad_norm", "lr", "batch_digest")
    for step in range(1, STEPS + 1):
        assert [got[step][k] for k in keys] == [want[step][k] for k in keys], step  # == on purpose
    assert evals(run_dir) == evals(reference.run_dir)


# ---- 3. bad input ---------------------------------------------------------------------------------


def test_bad_input_leaves_the_run_dir_untouched(reference, mixture, tmp_path, capsys):
    main = reference.main

    def args(run_dir: Path, *extra: str, data: Path = mixture) -> list[str]:
        return [*ARGS, f"--data.mixture={data}", f"--run_dir={run_dir}", *extra]

    fresh = tmp_path / "fresh"
    refused(main, capsys, args(fresh, "--optim.lrr=1e-3"), "optim.lrr", "did you mean 'optim.lr'")
    refused(main, capsys, args(fresh, "--train.micro_batch_size=3"), "micro_batch_size")
    refused(main, capsys, args(fresh, "--train.global_batch_tokens=1000"), "1000")
    assert not fresh.exists()

    existing = tmp_path / "existing"
    shutil.copytree(reference.run_dir, existing)
    before = snapshot(existing)
    refused(main, capsys, args(existing, "--model=tiny-gqa"), "n_kv_heads")
    assert snapshot(existing) == before

    # The same data under another folder has the same fingerprint: the run is complete, and a
    # restart of it exits 0 and writes nothing.
    copy = tmp_path / "mixture-copy"
    shutil.copytree(mixture.parent, copy)
    capsys.readouterr()
    assert main(args(existing, data=copy / "mixture.yaml")) == 0
    assert "already complete" in capsys.readouterr().out
    assert snapshot(existing) == before
    # One more document in a training file changes the fingerprint: the resume is refused.
    with open(copy / "train_b.bin", "ab") as f:
        f.write(np.asarray([5, 0], np.uint16).tobytes())
    refused(main, capsys, args(existing, data=copy / "mixture.yaml"), "fingerprint", "allow_fingerprint_mismatch")
    assert snapshot(existing) == before


# ---- 4. init from an HF folder --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """An HF Olmo3 folder (config.json + model.safetensors) of the tiny spec holding random
    weights no trainer would draw: std 0.05 matrices, norm scales 1 +- 0.2, so a trainer that
    kept its own init or dropped the norms would log another loss."""
    from safetensors.numpy import save_file

    spec = get_preset("tiny")
    rng = np.random.default_rng(11)
    tensors = {}
    for name, shape in hf_param_shapes(spec).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        scale = 0.2 if name.endswith("norm.weight") else 0.05
        tensors[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    folder = tmp_path_factory.mktemp("hf")
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config(spec)))
    return folder


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_from_an_hf_folder_gives_transformers_step_1_loss(framework, hf_folder, mixture, tmp_path, run_helpers):
    import torch
    from safetensors.torch import load_file
    from transformers import Olmo3Config, Olmo3ForCausalLM

    run_dir = tmp_path / "from-hf"
    args = [*ARGS, "--train.steps=1", f"--init.checkpoint=hf:{hf_folder}", f"--data.mixture={mixture}"]
    assert cli_main(framework)([*args, f"--run_dir={run_dir}"]) == 0
    got = train_lines(run_dir)[1]["loss"]

    spec = get_preset("tiny")
    reference = Olmo3ForCausalLM(Olmo3Config(**hf_config(spec))).double().eval()
    reference.load_state_dict(
        {k: v.double() for k, v in load_file(hf_folder / "model.safetensors").items()}, strict=True
    )
    batch = load_mixture(mixture).order.global_batch(0, BATCH)
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64))).logits
    want = run_helpers.loss_from_logits(logits, batch, spec.z_loss_weight)
    # fp32 against a float64 reference on the same weights: the loss sum's rounding alone.
    tol = fp32_mean_tolerance(want, int((batch["labels"] != -100).sum()), both_fp32=False)
    assert abs(got - want) <= tol, (got, want, tol)


# ---- 5. elastic resume -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TwoRanks:
    args: tuple[str, ...]
    layout: str  # how the trainer describes the new batch layout


TWO_RANKS = {
    # JAX: 2 simulated devices as tensor 2 (Orbax reshards every weight), 8 micro-steps of 2.
    "jax": TwoRanks(
        ("--jax.mesh.data=1", "--jax.mesh.tensor=2", "--train.micro_batch_size=2"),
        "global batch 16 = 2 per device x 1 data-parallel x 8 accumulation",
    ),
    # torch: 2 gloo processes under DDP, 2 micro-steps of 4 each.
    "torch": TwoRanks(
        ("--torch.parallel=ddp", "--train.micro_batch_size=4"),
        "global batch 16 = 4 per device x 2 data-parallel x 2 accumulation",
    ),
}


def test_a_one_rank_checkpoint_resumes_on_two_and_follows_the_run(reference, mixture, tmp_path):
    run_dir = tmp_path / "elastic"
    shutil.copytree(reference.run_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir, 20))
    two = TWO_RANKS[reference.framework]
    done = run_cli(reference.framework, [*ARGS, *two.args, f"--data.mixture={mixture}", f"--run_dir={run_dir}"], 2)
    check_ok(done)
    # The layout changes with the rank count; the global batch does not.
    assert "written with global batch 16 = 16 per device x 1 data-parallel x 1 accumulation" in done.stdout
    assert two.layout in done.stdout
    want, got = train_lines(reference.run_dir), train_lines(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(11, STEPS + 1):
        assert got[step]["batch_digest"] == want[step]["batch_digest"], step
        assert abs(got[step]["loss"] - want[step]["loss"]) <= loss_tolerance(want[step]["loss"], step - 10), (
            step,
            got[step]["loss"],
            want[step]["loss"],
        )
    # The comparison means something only if these steps move the loss far more than the bound.
    assert want[10]["loss"] - want[STEPS]["loss"] > 10 * loss_tolerance(want[10]["loss"], STEPS - 10)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_help_names_print_recipe_and_dry_run(framework, capsys):
    """Each trainer's --help: its own usage, then the shared options (olmo_run.cli.OPTIONS)."""
    assert cli_main(framework)(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"``olmo-train-{framework}``")
    assert f"olmo-train-{framework} RECIPE.yaml --print-recipe" in out
    assert f"olmo-train-{framework} RECIPE.yaml --dry-run --devices" in out
    assert "\n  --print-recipe    print the resolved recipe" in out
    assert "\n  --dry-run --devices KIND:COUNT [--json]\n" in out
