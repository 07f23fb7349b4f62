"""The MoE path of the torch trainer: one ``train_step`` on tiny-moe against the float64 numpy
reference (loss incl. aux over each micro-batch, grad norm against a float64 autograd of the
same loss), and the real entry point on 2 ranks against the reference, with its moe_* keys."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmo_data import MixtureLoader
from olmo_model import reference
from olmo_run.recipe import batch_layout, load_recipe
from olmo_train_torch import initial_model, to_hf
from olmo_train_torch.moe import routing_stats
from olmo_train_torch.parallelize import Distributed, parallelize
from olmo_train_torch.step import make_optimizer, train_step

ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny tensors on a shared CPU (a thread pool mostly waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(rows: int = 4, seq: int = 48, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 4096, size=(rows, seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[1, :10] = -100
    return {"input_ids": ids, "labels": labels.astype(np.int32), "doc_ids": np.zeros((rows, seq), np.int32)}


@pytest.mark.parametrize("micro_batch", [4, 2])
def test_train_step_loss_matches_numpy_reference_per_micro_batch(micro_batch):
    recipe = load_recipe(
        None, ["--model=tiny-moe", "--train.precision=fp32", f"--train.micro_batch_size={micro_batch}"]
    )
    spec = recipe.model_spec()
    model = initial_model(spec, seed=1)
    params = {k: v.numpy().copy() for k, v in to_hf(model, spec).items()}
    f64 = copy.deepcopy(model).double()
    batch = _batch()
    layout = batch_layout(4, 1, micro_batch)
    stats = train_step(
        model,
        make_optimizer(model, recipe, ONE.device),
        batch,
        layout=layout,
        d=ONE,
        spec=spec,
        recipe=recipe,
        lr=1e-3,
    ).read()

    # CE and z over the whole batch; the aux losses over each micro-batch (the unit whose
    # routing the load-balancing loss judges), averaged over micro-batches.
    ids, labels = batch["input_ids"], batch["labels"]
    full = reference.loss(spec, params, ids, labels)
    moe = spec.moe
    aux = [reference.forward_with_aux(spec, params, ids[r : r + micro_batch])[1] for r in range(0, 4, micro_batch)]
    lb = float(np.mean([a["load_balancing_loss"] for a in aux]))
    rz = float(np.mean([a["router_z_loss"] for a in aux]))
    want = (
        full["ce"]
        + spec.z_loss_weight * full["z_loss"]
        + moe.load_balancing_loss_weight * lb
        + moe.router_z_loss_weight * rz
    )
    assert abs(stats["loss"] - want) < 1e-5
    assert abs(stats["moe_lb_loss"] - lb) < 1e-5 and abs(stats["moe_router_z_loss"] - rz) < 1e-5
    assert sum(stats["moe_tokens_per_expert"]) == spec.n_layers * ids.size * moe.top_k
    assert stats["moe_dropped_tokens"] == 0 and stats["moe_rank_load_max_over_mean"] == 1.0

    # The gradient (through its norm) against float64 autograd of the same loss.
    f64.zero_grad()
    t_ids, t_labels = torch.from_numpy(ids).long(), torch.from_numpy(labels).long()
    n = (t_labels != -100).sum()
    total = 0.0
    for r in range(0, 4, micro_batch):
        out = f64(t_ids[r : r + micro_batch])
        logits, moe_stats = out.logits, out.moe
        flat, lab = logits.reshape(-1, logits.shape[-1]), t_labels[r : r + micro_batch].reshape(-1)
        lse = torch.logsumexp(flat, -1)[lab != -100]
        ce = F.cross_entropy(flat, lab, ignore_index=-100, reduction="sum") / n
        a = routing_stats(moe_stats)
        total = (
            total
            + ce
            + spec.z_loss_weight * (lse**2).sum() / n
            + (moe.load_balancing_loss_weight * a.load_balancing + moe.router_z_loss_weight * a.router_z)
            * (micro_batch / 4)
        )
    total.backward()
    norm = float(torch.sqrt(sum((p.grad**2).sum() for p in f64.parameters())))
    assert abs(stats["grad_norm"] - norm) < 1e-4 * norm


def test_two_rank_entry_point_matches_numpy_reference_and_writes_moe_metrics(harness, mixture, tmp_path):
    """The real entry point on 2 ranks (FSDP2, gloo): step 1's loss, over the global batch
    and with the aux losses over the global micro-batch, equals the numpy reference on the
    loader's batch 0 with the init weights; the moe_* keys are written."""
    run_dir = tmp_path / "moe"
    args = [a for a in harness.args(mixture, run_dir) if not a.startswith("--model=")]
    harness.check_ok(harness.run([*args, "--model=tiny-moe", "--train.steps=2", "--checkpoint.every=2"], nproc=2))
    lines = harness.train_lines(run_dir)
    assert [r["step"] for r in lines] == [1, 2]

    recipe = load_recipe(None, ["--model=tiny-moe"])
    spec = recipe.model_spec()
    params = {k: v.numpy() for k, v in to_hf(initial_model(spec, seed=recipe.train.seed), spec).items()}
    batch = MixtureLoader(mixture, 16, prefetch=0).batch_at(0)  # conftest: 16 sequences of 64
    want = reference.loss(spec, params, batch["input_ids"], batch["labels"])
    first = lines[0]
    assert abs(first["loss"] - want["total"]) < 1e-5
    assert abs(first["moe_lb_loss"] - want["load_balancing_loss"]) < 1e-5
    assert abs(first["moe_router_z_loss"] - want["router_z_loss"]) < 1e-5
    for r in lines:
        assert r["moe_dropped_tokens"] == 0
        assert sum(r["moe_tokens_per_expert"]) == 4 * 16 * 64 * 4  # layers x tokens x top-4
        assert r["moe_rank_load_max_over_mean"] == 1.0  # one expert-parallel rank


def test_activation_checkpointing_is_bitwise_and_bf16_autocast_is_close():
    """Two steps of tiny-moe through ``parallelize`` (one process): per-block activation
    checkpointing recomputes the same routing, so losses and grad norms are bitwise those
    without it; bf16 autocast (router kept in fp32) stays within bf16 rounding of fp32."""
    batch = _batch()
    results = {}
    for name, extra in (
        ("plain", []),
        ("checkpointed", ["--torch.activation_checkpointing=true"]),
        ("bf16", ["--train.precision=bf16"]),
    ):
        recipe = load_recipe(None, ["--model=tiny-moe", "--train.precision=fp32", "--torch.parallel=none", *extra])
        spec = recipe.model_spec()
        model = parallelize(initial_model(spec, seed=0), None, recipe.torch, recipe.train.precision, ONE.device)
        optimizer = make_optimizer(model, recipe, ONE.device)
        results[name] = [
            train_step(
                model,
                optimizer,
                batch,
                layout=batch_layout(4, 1, 2),
                d=ONE,
                spec=spec,
                recipe=recipe,
                lr=1e-3,
            ).read()
            for _ in range(2)
        ]
    for plain, checkpointed, bf16 in zip(results["plain"], results["checkpointed"], results["bf16"]):
        assert checkpointed == plain  # loss, grad norm and every moe_* key
        assert abs(bf16["loss"] - plain["loss"]) < 2e-3  # bf16 has 8 mantissa bits: ~4e-3 relative per op
        assert abs(bf16["grad_norm"] - plain["grad_norm"]) < 0.03 * plain["grad_norm"]
