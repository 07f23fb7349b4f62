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

from olmo_run.recipe import batch_layout, load_recipe
from olmo_run.spike_guard import SpikeGuard
from olmo_train_torch import initial_model
from olmo_train_torch.head_loss import head_loss_sums
from olmo_train_torch.parallelize import Distributed
from olmo_train_torch.spike_guard import DeviceSpikeGuard
from olmo_train_torch.step import make_optimizer, train_step

ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


def _recipe(*extra: str):
    return load_recipe(
        None, ["--model=tiny", "--train.precision=fp32", "--optim.lr=1e-3", "--optim.grad_clip=0.5", *extra]
    )


def _batch(rows: int = 4, seq: int = 48, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 4096, size=(rows, seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[1, :10] = -100  # unequal valid counts per row: a mean of means would differ
    doc_ids = (np.arange(seq)[None, :] >= rng.integers(5, seq, size=(rows, 1))).astype(np.int32)
    return {"input_ids": ids, "labels": labels.astype(np.int32), "doc_ids": doc_ids}


@pytest.mark.parametrize("chunk", [None, 5, 21], ids=["default-chunk", "chunk-5-uneven", "one-chunk"])
def test_head_loss_sums_match_cross_entropy(chunk):
    """The fused head + loss the trainer uses (head_loss.py: chunked, gradient computed in the
    forward) against float64 F.cross_entropy + z-loss on materialised logits: the sums and
    the gradients of x and W, with ignored labels and a chunk that does not divide the tokens."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16)
    w = torch.randn(50, 16)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    labels[2, 6] = 49  # the last vocab row
    zw = 1e-2
    x_ours, w_ours = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    objective, ce, z = head_loss_sums(x_ours, w_ours, labels, zw, chunk)
    (objective * 0.5).backward()  # the cotangent scales both saved gradients
    x_ref, w_ref = x.double().requires_grad_(True), w.double().requires_grad_(True)
    logits = x_ref @ w_ref.T
    ref_ce = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    lse = torch.logsumexp(logits, -1)[labels != -100]
    ref_objective = ref_ce + zw * (lse**2).sum()
    (ref_objective * 0.5).backward()
    assert abs(ce.item() - ref_ce.item()) < 1e-4 and not ce.requires_grad
    assert abs(z.item() - (lse**2).sum().item()) < 1e-3
    assert abs(objective.item() - ref_objective.item()) < 1e-4
    np.testing.assert_allclose(x_ours.grad.numpy(), x_ref.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(w_ours.grad.numpy(), w_ref.grad.numpy(), atol=1e-5)


def test_head_loss_sums_bf16_autocast_matches_linear():
    """Under bf16 autocast the fused head runs its matmuls in bf16 like nn.Linear would: the
    loss matches the unfused autocast path within bf16 rounding, and W's gradient comes back
    in W's float32 dtype."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 32)
    w = (torch.randn(300, 32) * 0.2).requires_grad_(True)
    labels = torch.randint(0, 300, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        objective, ce, _ = head_loss_sums(x, w, labels, 0.0, chunk=32)
        logits = F.linear(x, w)
    assert logits.dtype == torch.bfloat16
    ref = F.cross_entropy(logits.float().reshape(-1, 300), labels.reshape(-1), reduction="sum")
    assert abs(ce.item() - ref.item()) / ref.item() < 1e-3
    objective.backward()
    assert w.grad.dtype == torch.float32
    fp32 = w.detach().clone().requires_grad_(True)
    F.cross_entropy(F.linear(x, fp32).reshape(-1, 300), labels.reshape(-1), reduction="sum").backward()
    # bf16 inputs carry 8 significant bits: the gradients agree to a few bf16 ulps.
    np.testing.assert_allclose(w.grad.numpy(), fp32.grad.numpy(), atol=0.05 * float(fp32.grad.abs().max()))


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
        logits = model(ids, docs).logits.double()
        valid = labels != -100
        n = valid.sum()
        ce = (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            / n
        )
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
    model = initial_model(spec, seed=3)
    ref_model = copy.deepcopy(model)
    optimizer = make_optimizer(model, recipe, ONE.device)
    layout = batch_layout(4, 1, recipe.train.micro_batch_size)
    assert layout.accumulation_steps == 2
    batches = [(_batch(seed=1), 1e-3), (_batch(seed=2), 5e-4)]
    got = [
        train_step(model, optimizer, b, layout=layout, d=ONE, spec=spec, recipe=recipe, lr=lr).read()
        for b, lr in batches
    ]
    want = _reference_steps(ref_model, batches, recipe, spec)
    for s, (loss, ce, z, norm) in zip(got, want):
        assert abs(s["loss"] - loss) < 2e-5 and abs(s["ce_loss"] - ce) < 2e-5
        assert abs(s["z_loss"] - z) < 1e-3
        assert abs(s["grad_norm"] - norm) < 1e-4 * norm
        assert norm > recipe.optim.grad_clip  # clipping was active
    diffs = torch.cat([(p - q).abs().flatten() for p, q in zip(model.parameters(), ref_model.parameters())])
    # Updates are ~lr = 1e-3 per element. Nearly every element agrees to 3e-7 (2-3 float32
    # ulps of a norm weight); a wrong formula (bias correction, decay on the embedding, no
    # clipping) shifts most elements by >= 1e-6: the bulk check is the one that catches maths.
    # Adam divides each element by its own RMS, so an element whose gradient is ~1e-6 of its
    # tensor's largest carries the float32 rounding of the gradients (relative 1e-7 of the
    # tensor's scale) into its update at relative size O(1): such rare elements may move by a
    # good part of lr. Measured with the fused head (whose chunked sums round differently from
    # the reference's full logits; gradients agree to 8e-7 relative): largest 3.4e-5 with two
    # torch threads, 8.3e-5 with one. 1.5e-4 = 10% of the two steps' summed lr bounds them.
    assert (diffs > 3e-7).float().mean().item() < 1e-3
    assert diffs.max().item() < 1.5e-4


def test_embedding_has_no_weight_decay_and_norms_follow_recipe():
    recipe = _recipe("--optim.decay_norms=false")
    model = initial_model(recipe.model_spec(), seed=0)
    groups = {g["name"]: g for g in make_optimizer(model, recipe, ONE.device).param_groups}
    assert groups["embedding"]["weight_decay"] == 0.0
    assert groups["embedding"]["params"] == [model.embed.weight]
    assert groups["norms"]["weight_decay"] == 0.0
    assert groups["matrices"]["weight_decay"] == 0.1
    assert len(groups["norms"]["params"]) == 4 * 4 + 1  # 4 per block (attn, mlp, q, k) + final


def test_spike_guard_skip_leaves_state_unchanged():
    recipe = _recipe()
    spec = recipe.model_spec()
    model = initial_model(spec, seed=0)
    optimizer = make_optimizer(model, recipe, ONE.device)
    before = copy.deepcopy(model.state_dict())
    guard = SpikeGuard(enabled=True, min_history=2, sigma=6.0)
    guard.record(1.0, 0.1)  # a history far below a fresh model's loss (~8.3)
    guard.record(1.0, 0.1)
    layout = batch_layout(4, 1)
    on_device = DeviceSpikeGuard(guard, ONE.device)  # decided on the device, undone there
    kwargs = dict(layout=layout, d=ONE, spec=spec, recipe=recipe, lr=1e-3)
    stats = train_step(model, optimizer, _batch(), guard=on_device, **kwargs).read()
    assert stats["skipped"] and stats["loss"] > 8.0
    # No Adam moments, no step count: the state the step made holds what a fresh one does.
    assert all(not v.any() for st in optimizer.state.values() for v in st.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert len(guard.losses) == 2 and int(on_device.count) == 2  # a skipped step is not history
    # ... and the next step is bitwise a fresh optimizer's first step on the same weights.
    fresh = initial_model(spec, seed=0)
    train_step(fresh, make_optimizer(fresh, recipe, ONE.device), _batch(seed=5), **kwargs)
    train_step(model, optimizer, _batch(seed=5), **kwargs)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
