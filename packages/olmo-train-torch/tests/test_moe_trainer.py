"""MoE run modes in the torch trainer (CPU, gloo, fp32, tiny-moe): ``torch.expert_parallel``
and ``moe.routing`` through the real entry point and through ``train_step``.

- EP=4 (4 processes, FSDP2 on the dense parts) follows EP=1 (one process) within
  ``olmo_model.layout_loss_tolerance`` for 20 steps, nothing dropped, and the logged per-rank
  load is the one of 4 expert ranks;
- exact (bitwise) resume of an EP=2 run after SIGKILL, and the same checkpoint resumed on
  one process (experts resharded by DCP) within that bound, counted from the checkpoint;
- uniform and random routing do not depend on the rank layout: the same per-expert counts
  on 1 process and on 4 (EP=4 under FSDP2, EP=2 x 2 replicas under DDP), and the uniform
  counts equal those derived by hand for the global micro-batch;
- the recipe's ``moe.routing`` / ``moe.mxfp8`` reach every block (``step.prepare_model``);
- bad layouts (EP not dividing the world size or the experts, EP on a dense spec) stop
  the trainer with one line before anything is written.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from olmo_model import fp32_mean_tolerance, layout_loss_tolerance
from olmo_run.checkpoints import complete_checkpoints
from olmo_run.recipe import RecipeError, batch_layout, load_recipe
from olmo_train_torch.grouped_gemm import GroupedExperts
from olmo_train_torch.hf_adapter import initial_model
from olmo_train_torch.moe import MoE
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh, check_parallel
from olmo_train_torch.step import make_optimizer, prepare_model, train_step

MOE = ["--model=tiny-moe"]


def _args(harness, mixture, run_dir, *extra: str) -> list[str]:
    base = [a for a in harness.args(mixture, run_dir) if not a.startswith("--model=")]
    return [*base, *MOE, *extra]


# ---- the entry point -----------------------------------------------------------------------------


def test_ep4_follows_ep1_for_20_steps_and_drops_nothing(harness, mixture, tmp_path):
    """lr 5e-4 (peak): 1 and 4 data-parallel ranks sum gradients in different orders, and
    with learned routing a last-bit difference can flip a near-tied expert choice, which
    Adam turns into an lr-sized update. At the default 3e-3 this alone (EP=1 on 4 ranks vs
    1 rank, measured) reaches 4e-5 by step 20, while EP=4 and EP=1 on 4 ranks stay within
    4e-7; at 5e-4 the 1-vs-4-rank gap stays under 5e-6."""
    one, four = tmp_path / "ep1", tmp_path / "ep4"
    common = ("--checkpoint.every=20", "--optim.lr=5e-4")
    harness.check_ok(harness.run(_args(harness, mixture, one, "--torch.parallel=none", *common)))
    result = harness.run(_args(harness, mixture, four, "--torch.expert_parallel=4", *common), nproc=4)
    harness.check_ok(result)
    assert "experts on mesh {'edp': 1, 'ep': 4}" in result.stdout
    want, got = harness.train_lines(one), harness.train_lines(four)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert want[-1]["loss"] < want[0]["loss"] - 0.5, "the run does not learn"
    for a, b in zip(want, got):
        assert a["batch_digest"] == b["batch_digest"]
        # 1 vs 4 ranks reorder the fp32 sums of the step's 16 x 64 token losses, and from step 2 AdamW
        # carries that forward (olmo_model.layout_loss_tolerance); learned routing's flips, kept small by
        # the lr above, add to it.
        tol = layout_loss_tolerance(a["loss"], 16 * 64, a["step"])
        assert abs(a["loss"] - b["loss"]) <= tol, (a["step"], a["loss"], b["loss"])
    for r in got:
        counts = np.array(r["moe_tokens_per_expert"])
        assert r["moe_dropped_tokens"] == 0
        assert counts.sum() == 4 * 16 * 64 * 4  # MoE layers x tokens x top-4: every assignment computed
        # 8 experts on 4 ranks: rank r computes experts 2r, 2r+1.
        per_rank = counts.reshape(4, 2).sum(1)
        assert r["moe_rank_load_max_over_mean"] == pytest.approx(per_rank.max() / per_rank.mean(), abs=1e-12)
    assert all(r["moe_rank_load_max_over_mean"] == 1.0 for r in want)  # one expert rank
    assert any(r["moe_rank_load_max_over_mean"] > 1.0 for r in got)  # a learned router is not balanced


@pytest.fixture(scope="module")
def ep2_runs(harness, mixture, tmp_path_factory):
    """An uninterrupted 4-step EP=2 run and one killed right after its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("ep2")
    args = ("--torch.expert_parallel=2", "--train.steps=4", "--checkpoint.every=2", "--checkpoint.async_save=false")
    reference, killed = root / "reference", root / "killed"
    harness.check_ok(harness.run(_args(harness, mixture, reference, *args), nproc=2))
    result = harness.run(_args(harness, mixture, killed, *args), nproc=2, kill_after=2)
    assert result.returncode != 0
    assert [s for s, _ in complete_checkpoints(killed)] == [2]
    return args, reference, killed


def test_ep2_resume_after_sigkill_is_bitwise(harness, mixture, ep2_runs, tmp_path):
    args, reference, killed = ep2_runs
    run_dir = tmp_path / "resumed"
    shutil.copytree(killed, run_dir)
    resumed = harness.run(_args(harness, mixture, run_dir, *args), nproc=2)
    harness.check_ok(resumed)
    assert "resumed from" in resumed.stdout
    keys = ("batch_digest", "loss", "grad_norm", "moe_tokens_per_expert", "moe_lb_loss", "moe_rank_load_max_over_mean")
    harness.assert_resumed_bitwise(run_dir, reference, keys, steps=[1, 2, 3, 4])


def test_ep2_checkpoint_resumes_on_one_process_with_experts_resharded(harness, mixture, ep2_runs, tmp_path):
    args, reference, killed = ep2_runs
    run_dir = tmp_path / "one"
    shutil.copytree(killed, run_dir)
    one = [a for a in args if not a.startswith("--torch.expert_parallel")]
    resumed = harness.run(_args(harness, mixture, run_dir, *one, "--torch.parallel=none"))
    harness.check_ok(resumed)
    want = {r["step"]: r for r in harness.train_lines(reference)}
    for r in harness.train_lines(run_dir)[2:]:
        assert r["step"] in (3, 4) and r["batch_digest"] == want[r["step"]]["batch_digest"]
        tol = layout_loss_tolerance(r["loss"], 16 * 64, r["step"] - 2)  # steps from the step-2 checkpoint
        assert abs(r["loss"] - want[r["step"]]["loss"]) <= tol, r["step"]
        assert abs(r["grad_norm"] - want[r["step"]]["grad_norm"]) <= 1e-4 * r["grad_norm"], r["step"]


@pytest.mark.parametrize(
    "world, extra, expected",
    [
        (4, ["--torch.expert_parallel=3"], ["torch.expert_parallel=3", "does not divide the 4 ranks"]),
        # 12 sequences over 6 ranks; 3 divides the ranks, not the 8 experts.
        (
            6,
            ["--torch.expert_parallel=3", f"--train.global_batch_tokens={12 * 64}"],
            ["torch.expert_parallel=3", "moe.n_experts=8"],
        ),
        (2, ["--torch.expert_parallel=2", "--model=tiny"], ["torch.expert_parallel=2", "no moe section"]),
    ],
)
def test_bad_expert_parallel_layout_stops_before_writing(
    harness, mixture, tmp_path, capsys, monkeypatch, world, extra, expected
):
    # torchrun's environment for rank 0: the layout is refused before joining any group.
    for key, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    harness.refused(capsys, _args(harness, mixture, run_dir, *extra), *expected)
    assert not run_dir.exists()


def test_check_parallel_accepts_divisors():
    spec = load_recipe(None, MOE).model_spec()
    for world, ep in ((4, 4), (4, 2), (8, 8), (2, 1)):
        check_parallel(load_recipe(None, [*MOE, f"--torch.expert_parallel={ep}"]).torch, world, spec)
    with pytest.raises(RecipeError, match="does not divide the 1 ranks"):
        check_parallel(load_recipe(None, [*MOE, "--torch.expert_parallel=2"]).torch, 1, spec)


# ---- routing does not depend on the layout (train_step, gloo ranks from the fork server) -----------------------

ROWS, SEQ = 4, 33  # one global micro-batch of 132 tokens; 33 per rank on 4 ranks (odd: see below)
LAYERS, E, K = 4, 8, 4  # tiny-moe


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    ids = rng.integers(2, 4096, size=(ROWS, SEQ + 1))
    return {
        "input_ids": ids[:, :-1].astype(np.int32),
        "labels": ids[:, 1:].astype(np.int32),
        "doc_ids": np.zeros((ROWS, SEQ), np.int32),
    }


def _step(routing: str, d: Distributed, parallel: str, ep: int, *extra: str) -> dict:
    recipe = load_recipe(
        None,
        [
            *MOE,
            "--train.precision=fp32",
            f"--moe.routing={routing}",
            f"--torch.parallel={parallel}",
            f"--torch.expert_parallel={ep}",
            *extra,
        ],
    )
    spec = recipe.model_spec()
    model = prepare_model(
        initial_model(spec, seed=3), recipe, d, build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch)
    )
    per = ROWS // d.world_size
    batch = {k: v[d.rank * per : (d.rank + 1) * per] for k, v in _batch().items()}
    stats = train_step(
        model,
        make_optimizer(model, recipe, d.device),
        batch,
        layout=batch_layout(ROWS, d.world_size),
        d=d,
        spec=spec,
        recipe=recipe,
        lr=1e-3,
        step=7,
    ).read(ep_size=recipe.torch.expert_parallel)
    return {
        "counts": stats["moe_tokens_per_expert"],
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "dropped": stats["moe_dropped_tokens"],
    }


ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


def test_recipe_moe_knobs_reach_the_blocks():
    recipe = load_recipe(None, [*MOE, "--moe.routing=random", "--moe.mxfp8=true", "--torch.parallel=none"])
    model = prepare_model(initial_model(recipe.model_spec(), seed=0), recipe, ONE, None, None)
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(blocks) == LAYERS
    assert all(
        b.routing == "random" and b.routing_seed == recipe.train.seed and not b.router.weight.requires_grad
        for b in blocks
    )
    assert all(m.mxfp8 for m in model.modules() if isinstance(m, GroupedExperts))
    # MXFP8 rounds the expert GEMM operands to 3 mantissa bits: the loss moves, a little.
    plain, mx = _step("learned", ONE, "none", 1)["loss"], _step("learned", ONE, "none", 1, "--moe.mxfp8=true")["loss"]
    assert 1e-7 < abs(plain - mx) < 1e-2 * plain


def _worker(rank: int, port: int, want: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    d = Distributed(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), initialized=True)
    try:
        for routing, parallel, ep in (("uniform", "fsdp", 4), ("random", "ddp", 2)):
            got = _step(routing, d, parallel, ep)
            one = want[routing]
            assert got["counts"] == one["counts"], (routing, parallel, ep, got["counts"], one["counts"])
            assert got["dropped"] == 0
            tol = fp32_mean_tolerance(one["loss"], ROWS * SEQ)  # 4 ranks reorder the loss sum
            assert abs(got["loss"] - one["loss"]) <= tol, (routing, got["loss"], one["loss"])
            assert abs(got["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"], (routing, parallel)
    finally:
        dist.destroy_process_group()


def test_uniform_and_random_routing_do_not_depend_on_the_rank_layout():
    torch.set_num_threads(1)
    want = {routing: _step(routing, ONE, "none", 1) for routing in ("uniform", "random")}
    # Uniform by hand: the global micro-batch's T*k = 528 slots n go to expert n mod 8, so
    # 66 per expert and layer. (Numbering each rank's 33 tokens from 0 would give 4 * 17 = 68
    # to experts 0-3 and 4 * 16 = 64 to experts 4-7.)
    slots = ROWS * SEQ * K
    by_hand = [LAYERS * sum(1 for n in range(slots) if n % E == e) for e in range(E)]
    assert by_hand == [LAYERS * 66] * E
    assert want["uniform"]["counts"] == by_hand
    assert sum(want["random"]["counts"]) == LAYERS * slots and want["random"]["counts"] != by_hand
    start_ranks(_worker, 4, want)
