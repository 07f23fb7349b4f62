"""The sharded optimizer state (``optim.sharded: true`` under ``torch.parallel: ddp``,
``sharded_optimizer.py``) on 4 gloo ranks (CPU, fp32 unless stated).

In process (one start of 4 ranks from the fork server; processes because the reduce-scatter and
all-gather need a real process group):

- optimizer-state bytes per rank (fp32 masters, both AdamW moments, the step counts), measured
  from the tensors, against the value written out below: 1/4 of one rank's full state for every
  tensor of 4096 elements or more, the whole of each smaller one (OLMo-core's replication rule),
  for tiny (dense) and for tiny-moe with EP 2 (experts: E/2 per rank, halved again over their 2
  expert-data-parallel replicas);
- 10 ``train_step``s of tiny follow the same steps of the unsharded AdamW on one process within
  ``olmo_model.layout_loss_tolerance`` (4 ranks reorder the fp32 sums, see that helper);
- bf16 precision: the compute weights are bf16, exactly the fp32 masters rounded to bf16 after
  a step (``ShardedMasters.gather``), and the state bytes are the fp32 ones.

Through the entry point (``test_sharded_optimizer_runs.py``): EP 2, SIGKILL + resume, and
resumes across layouts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks
from torch.distributed.tensor import DTensor

from olmo_model import layout_loss_tolerance
from olmo_run.recipe import RecipeError, batch_layout, load_recipe
from olmo_train_torch.hf_adapter import initial_model
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh, check_parallel
from olmo_train_torch.sharded_optimizer import ShardedAdamW, sharded_masters_of
from olmo_train_torch.step import make_optimizer, prepare_model, train_step

ROWS, SEQ, STEPS, LR = 8, 32, 10, 3e-3
SHARDED = ["--torch.parallel=ddp", "--optim.sharded=true"]

# tiny: 738,368 parameters in 47 tensors; the 17 norm weights (64 each, 1,088) are under 4096
# elements, every other tensor's first dimension (4096, 192, 64) divides over 4 ranks.
# Per rank: 12 bytes (fp32 master + 2 moments) x (737,280 / 4 + 1,088) + 4 bytes x 47 step counts.
TINY_BYTES = 12 * (737_280 // 4 + 1_088) + 4 * 47
assert TINY_BYTES == 2_225_084
# tiny-moe, EP 2 on 4 ranks: 1,035,328 parameters in 63 tensors; under 4096 elements: 17 norms
# (1,088) and 4 routers (8 x 64 = 512 each, 2,048). The 12 expert tensors (8 x 64 x 64 = 32,768
# each, 393,216) keep 4 of 8 experts per rank (EP 2) and half of those rows (2 replicas): 1/4.
MOE_BYTES = 12 * ((1_035_328 - 3_136) // 4 + 3_136) + 4 * 63
assert MOE_BYTES == 3_134_460
# One rank's full state (the same optimizer unsharded) is 12 x 738,368 + 4 x 47 for tiny: the
# sharded part is exactly a quarter of it.
assert 12 * 738_368 + 4 * 47 - TINY_BYTES == 3 * 12 * 737_280 // 4


def _batch(step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s global batch: 8 random rows over the first 64 ids (a few shared rows, so
    the model has something to learn in 10 steps)."""
    rng = np.random.default_rng(step % 3)
    ids = rng.integers(2, 64, size=(ROWS, SEQ + 1))
    return {
        "input_ids": ids[:, :-1].astype(np.int32),
        "labels": ids[:, 1:].astype(np.int32),
        "doc_ids": np.zeros((ROWS, SEQ), np.int32),
    }


def _model(d: Distributed, *args: str):
    recipe = load_recipe(None, ["--train.precision=fp32", *args])
    model = prepare_model(
        initial_model(recipe.model_spec(), seed=3),
        recipe,
        d,
        build_mesh(d, recipe.torch),
        build_expert_mesh(d, recipe.torch),
    )
    return recipe, model, make_optimizer(model, recipe, d.device)


def _losses(d: Distributed, *args: str) -> list[float]:
    recipe, model, optimizer = _model(d, "--model=tiny", *args)
    per = ROWS // d.world_size
    losses = []
    for step in range(1, STEPS + 1):
        batch = {k: v[d.rank * per : (d.rank + 1) * per] for k, v in _batch(step).items()}
        stats = train_step(
            model,
            optimizer,
            batch,
            layout=batch_layout(ROWS, d.world_size),
            d=d,
            spec=recipe.model_spec(),
            recipe=recipe,
            lr=LR,
            step=step,
        )
        losses.append(stats.read()["loss"])
    return losses


def _random_routing_step_keeps_the_frozen_router(d: Distributed) -> None:
    """Random routing freezes the router (no gradient): its weight must come out of a sharded
    step unchanged while the trained weights move."""
    args = ("--model=tiny-moe", "--torch.expert_parallel=2", "--moe.routing=random", *SHARDED)
    recipe, model, optimizer = _model(d, *args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    per = ROWS // d.world_size
    batch = {k: v[d.rank * per : (d.rank + 1) * per] for k, v in _batch(1).items()}
    layout = batch_layout(ROWS, d.world_size)
    train_step(model, optimizer, batch, layout=layout, d=d, spec=recipe.model_spec(), recipe=recipe, lr=LR)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    routers = {n for n in before if "router" in n}
    assert routers and not routers & moved, routers & moved
    assert "embed.weight" in moved


def _worker(rank: int, port: int, want: list[float]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    d = Distributed(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), initialized=True)
    try:
        _, _, optimizer = _model(d, "--model=tiny", *SHARDED)
        assert isinstance(optimizer, ShardedAdamW)
        assert optimizer.local_state_bytes() == TINY_BYTES
        _, _, optimizer = _model(d, "--model=tiny-moe", "--torch.expert_parallel=2", *SHARDED)
        assert optimizer.local_state_bytes() == MOE_BYTES
        _random_routing_step_keeps_the_frozen_router(d)

        got = _losses(d, *SHARDED)
        for step, (a, b) in enumerate(zip(want, got), start=1):
            assert abs(a - b) <= layout_loss_tolerance(a, ROWS * SEQ, step), (step, a, b)

        recipe, model, optimizer = _model(d, "--model=tiny", "--train.precision=bf16", *SHARDED)
        assert optimizer.local_state_bytes() == TINY_BYTES
        per = ROWS // 4
        batch = {k: v[rank * per : (rank + 1) * per] for k, v in _batch(1).items()}
        train_step(
            model,
            optimizer,
            batch,
            layout=batch_layout(ROWS, 4),
            d=d,
            spec=recipe.model_spec(),
            recipe=recipe,
            lr=LR,
        )
        masters = sharded_masters_of(model)
        assert masters is not None
        for slot in masters.slots:
            assert slot.param.dtype == torch.bfloat16 and slot.master.dtype == torch.float32
            assert isinstance(slot.master, DTensor)
            assert torch.equal(slot.param.detach(), slot.master.full_tensor().to(torch.bfloat16)), slot.fqn
    finally:
        dist.destroy_process_group()


def test_sharded_state_is_a_quarter_per_rank_and_follows_one_rank():
    torch.set_num_threads(1)
    one = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)
    want = _losses(one, "--torch.parallel=none")
    assert want[-1] < want[0] - 0.05, "the run does not learn"
    start_ranks(_worker, 4, want)


@pytest.mark.parametrize(
    "parallel, world, expected",
    [
        ("fsdp", 4, "FSDP2 shards the optimizer state already"),
        ("hsdp", 4, "FSDP2 shards the optimizer state already"),
        ("none", 1, "torch.parallel=ddp with 2 or more processes"),
        ("ddp", 1, "torch.parallel=ddp with 2 or more processes"),
    ],
)
def test_sharded_optimizer_is_refused_where_nothing_is_left_to_shard(parallel, world, expected):
    section = load_recipe(None, [f"--torch.parallel={parallel}"]).torch
    check_parallel(section, world)  # the layout alone is fine
    with pytest.raises(RecipeError, match=expected) as err:
        check_parallel(section, world, optim_sharded=True)
    assert "optim.sharded" in str(err.value) and "\n" not in str(err.value)
