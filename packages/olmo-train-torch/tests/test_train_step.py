"""The maths of one training step (in-process, one rank) against references written out here:
loss over the global valid-token count, z-loss, gradient accumulation, the global grad norm,
clipping, decoupled AdamW with no decay on the embedding, the spike guard's skipped step."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from olmo_model.recipe import batch_layout, load_recipe
from olmo_model.runlog import SpikeGuard
from olmo_train_torch import build_model
from olmo_train_torch.parallelize import Distributed
from olmo_train_torch.train import loss_sums_fn, make_optimizer, train_step

ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


def _recipe(*extra: str):
    return load_recipe(None, ["--model=tiny", "--train.precision=fp32", "--optim.lr=1e-3", "--optim.grad_clip=0.5", *extra])


def _batch(rows: int = 4, seq: int = 48, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 4096, size=(rows, seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[1, :10] = -100  # unequal valid counts per row: a mean of means would differ
    doc_ids = (np.arange(seq)[None, :] >= rng.integers(5, seq, size=(rows, 1))).astype(np.int32)
    return {"input_ids": ids, "labels": labels.astype(np.int32), "doc_ids": doc_ids}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
def test_token_loss_sums_match_cross_entropy(compiled):
    """The loss the trainer uses (compiled when torch.compile is on) against float64
    F.cross_entropy: values and the gradient of CE + z-loss."""
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 4
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    fn = loss_sums_fn(load_recipe(None, [f"--torch.compile={str(compiled).lower()}"]))
    ours = logits.clone().requires_grad_(True)
    ce, z = fn(ours, labels)
    (ce + 1e-2 * z).backward()
    ref_logits = logits.double().requires_grad_(True)
    ref_ce = F.cross_entropy(ref_logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    lse = torch.logsumexp(ref_logits, -1)[labels != -100]
    (ref_ce + 1e-2 * (lse**2).sum()).backward()
    assert abs(ce.item() - ref_ce.item()) < 1e-4
    assert abs(z.item() - (lse**2).sum().item()) < 1e-3
    np.testing.assert_allclose(ours.grad.numpy(), ref_logits.grad.numpy(), atol=1e-5)


def _reference_steps(model, batches, recipe, spec):
    """Plain full-batch loss in float64 logits, hand-written clip and AdamW (trainer_common)."""
    o = recipe.optim
    b1, b2 = o.betas
    params = dict(model.named_parameters())
    m = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    v = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    out = []
    for t, (batch, lr) in enumerate(batches, start=1):
        ids, labels, docs = (torch.from_numpy(batch[k]).long() for k in ("input_ids", "labels", "doc_ids"))
        logits = model(ids, docs).double()
        valid = labels != -100
        n = valid.sum()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum") / n
        z = (torch.logsumexp(logits, -1)[valid] ** 2).sum() / n
        loss = ce + spec.z_loss_weight * z
        model.zero_grad()
        loss.backward()
        norm = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in params.values()))
        scale = min(1.0, o.grad_clip / (norm + 1e-6))
        with torch.no_grad():
            for k, p in params.items():
                g = p.grad.double() * scale
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
                wd = 0.0 if k == "embed.weight" else o.weight_decay
                p.copy_((p.double() - lr * (m_hat / (v_hat.sqrt() + o.eps) + wd * p.double())).float())
        out.append((loss.item(), ce.item(), z.item(), norm))
    return out


def test_two_steps_with_accumulation_match_reference():
    recipe = _recipe("--train.micro_batch_size=2", "--train.document_masking=true")
    spec = recipe.model_spec()
    model = build_model(spec, seed=3)
    ref_model = copy.deepcopy(model)
    optimizer = make_optimizer(model, recipe, ONE.device)
    layout = batch_layout(4, 1, recipe.train.micro_batch_size)
    assert layout.accumulation_steps == 2
    guard = SpikeGuard()
    batches = [(_batch(seed=1), 1e-3), (_batch(seed=2), 5e-4)]
    got = [
        train_step(model, optimizer, b, layout=layout, d=ONE, spec=spec, recipe=recipe, lr=lr, guard=guard)
        for b, lr in batches
    ]
    want = _reference_steps(ref_model, batches, recipe, spec)
    for s, (loss, ce, z, norm) in zip(got, want):
        assert abs(s.loss - loss) < 2e-5 and abs(s.ce_loss - ce) < 2e-5
        assert abs(s.z_loss - z) < 1e-3
        assert abs(s.grad_norm - norm) < 1e-4 * norm
        assert norm > recipe.optim.grad_clip  # clipping was active
    diffs = torch.cat([(p - q).abs().flatten() for p, q in zip(model.parameters(), ref_model.parameters())])
    # Updates are ~lr = 1e-3 per element. Nearly every element agrees to 3e-7 (2-3 float32
    # ulps of a norm weight); the rare ones with |g| ~ eps, where Adam's g / (|g| + eps) is
    # steep, may move by a few % of lr. A wrong formula (bias correction, decay on the
    # embedding, no clipping) shifts most elements by >= 1e-6.
    assert (diffs > 3e-7).float().mean().item() < 1e-3
    assert diffs.max().item() < 3e-5


def test_embedding_has_no_weight_decay_and_norms_follow_recipe():
    recipe = _recipe("--optim.decay_norms=false")
    model = build_model(recipe.model_spec(), seed=0)
    groups = {g["name"]: g for g in make_optimizer(model, recipe, ONE.device).param_groups}
    assert groups["embedding"]["weight_decay"] == 0.0
    assert groups["embedding"]["params"] == [model.embed.weight]
    assert groups["norms"]["weight_decay"] == 0.0
    assert groups["matrices"]["weight_decay"] == 0.1
    assert len(groups["norms"]["params"]) == 4 * 4 + 1  # 4 per block (attn, mlp, q, k) + final


def test_spike_guard_skip_leaves_state_unchanged():
    recipe = _recipe()
    spec = recipe.model_spec()
    model = build_model(spec, seed=0)
    optimizer = make_optimizer(model, recipe, ONE.device)
    before = copy.deepcopy(model.state_dict())
    guard = SpikeGuard(enabled=True, min_history=2, sigma=6.0)
    guard.record(1.0, 0.1)  # a history far below a fresh model's loss (~8.3)
    guard.record(1.0, 0.1)
    layout = batch_layout(4, 1)
    stats = train_step(model, optimizer, _batch(), layout=layout, d=ONE, spec=spec, recipe=recipe, lr=1e-3, guard=guard)
    assert stats.skipped and stats.loss > 8.0
    assert not optimizer.state  # no Adam moments, no step count
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert len(guard.losses) == 2  # a skipped step is not history
