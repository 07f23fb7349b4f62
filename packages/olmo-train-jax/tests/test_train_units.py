"""Unit tests of the JAX trainer's maths and placement rules (one CPU device, in-process).

The references are independent of the trainer's code: torch's cross_entropy for the loss
sums, a numpy AdamW written from the formula in the trainer brief, and partition specs and
micro-batch layouts derived by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from olmo_model import get_preset
from olmo_run.recipe import RecipeError, load_recipe
from olmo_train_jax import parallelize
from olmo_train_jax.head_loss import head_chunk, head_loss_sums
from olmo_train_jax.model import build_model
from olmo_train_jax.step import GuardState, decay_mask, for_mesh, step_functions, token_loss_sums


def test_loss_sums_match_torch_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, size=(2, 5)).astype(np.int32)
    labels[0, 1] = labels[1, 4] = labels[1, 0] = -100
    ce, z, n = token_loss_sums(jnp.asarray(logits), jnp.asarray(labels))
    t_logits, t_labels = torch.from_numpy(logits).double(), torch.from_numpy(labels).long()
    ref_ce = torch.nn.functional.cross_entropy(t_logits.reshape(-1, 11), t_labels.reshape(-1), reduction="sum")
    lse = torch.logsumexp(t_logits, dim=-1)
    ref_z = (lse**2 * (t_labels != -100)).sum()
    assert float(n) == 7
    assert float(ce) == pytest.approx(float(ref_ce), rel=1e-6)
    assert float(z) == pytest.approx(float(ref_z), rel=1e-6)


@pytest.mark.parametrize("chunk", [None, 1, 3, 9], ids=["default-chunk", "chunk-1", "chunk-3", "one-chunk"])
def test_fused_head_loss_matches_torch_float64(chunk):
    """head_loss_sums (chunked head + CE + z-loss, gradient computed in its forward) against
    float64 torch on materialised logits: the sums and the gradients of x and the head, scaled
    by a cotangent, with ignored labels and the last vocab row as a label."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 16)).astype(np.float32)
    head = rng.normal(size=(16, 37)).astype(np.float32)
    labels = rng.integers(0, 37, size=(2, 9)).astype(np.int32)
    labels[0, :3] = labels[1, 8] = -100
    labels[1, 2] = 36
    zw = 1e-2

    def objective(x, head):
        obj, ce, z, n = head_loss_sums(x, head, jnp.asarray(labels), zw, chunk)
        return 0.5 * obj, (ce, z, n)

    (obj, (ce, z, n)), (gx, gh) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x), jnp.asarray(head)
    )
    tx = torch.from_numpy(x).double().requires_grad_(True)
    th = torch.from_numpy(head).double().requires_grad_(True)
    t_labels = torch.from_numpy(labels).long()
    logits = tx @ th
    ref_ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), t_labels.reshape(-1), reduction="sum")
    lse = torch.logsumexp(logits, dim=-1)[t_labels != -100]
    ref = 0.5 * (ref_ce + zw * (lse**2).sum())
    ref.backward()
    assert float(n) == 14
    assert float(ce) == pytest.approx(float(ref_ce), rel=1e-6)
    assert float(z) == pytest.approx(float((lse**2).sum()), rel=1e-6)
    assert float(obj) == pytest.approx(float(ref), rel=1e-6)
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), atol=2e-6)
    np.testing.assert_allclose(np.asarray(gh), th.grad.numpy(), atol=2e-6)


def test_fused_head_loss_bf16_matches_float64_on_the_rounded_inputs():
    """bf16 compute (the trainer's bf16 mode): bf16 x and head, float32 logits and sums. The
    sums match float64 on the same bf16-rounded inputs (products of bf16 values are exact in
    float32, so only float32 accumulation differs); the gradients come back in bf16 and carry
    the bf16 rounding of the logits' gradient (8 significant bits: within 2% of the largest)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.bfloat16)
    head = jnp.asarray(rng.normal(size=(32, 300)) * 0.2, jnp.bfloat16)
    labels = rng.integers(0, 300, size=(2, 16)).astype(np.int32)
    zw = 1e-4

    def objective(x, head):
        obj, ce, z, _ = head_loss_sums(x, head, jnp.asarray(labels), zw, 8)
        return obj, (ce, z)

    (obj, (ce, _)), (gx, gh) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(x, head)
    assert gx.dtype == jnp.bfloat16 and gh.dtype == jnp.bfloat16
    tx = torch.from_numpy(np.asarray(x.astype(jnp.float32))).double().requires_grad_(True)
    th = torch.from_numpy(np.asarray(head.astype(jnp.float32))).double().requires_grad_(True)
    logits = tx @ th
    t_labels = torch.from_numpy(labels).long()
    ref_ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), t_labels.reshape(-1), reduction="sum")
    ref = ref_ce + zw * (torch.logsumexp(logits, dim=-1) ** 2).sum()
    ref.backward()
    assert float(ce) == pytest.approx(float(ref_ce), rel=1e-5)
    assert float(obj) == pytest.approx(float(ref), rel=1e-5)
    for got, want in ((gx, tx.grad), (gh, th.grad)):
        want = want.numpy()
        assert np.abs(np.asarray(got.astype(jnp.float32)) - want).max() <= 0.02 * np.abs(want).max()


def test_fused_head_loss_chunk_is_sized_per_device():
    """~256 MiB of float32 logits per chunk for the rows ONE device holds: olmo3-30m's bench
    shape (8 x 512, vocab 100352) takes 64 positions (8 x 64 x 100352 x 4 = 205 MB; 128 would be
    411 MB); a 512-sequence global batch of 8192 tokens over 64 data-parallel devices holds 8 rows
    per device, so also 64, where sizing by the global batch would give 1-position chunks."""
    assert head_chunk(8, 512, 100352) == 64
    assert head_chunk(512 // 64, 8192, 100352) == 64
    assert head_chunk(512, 8192, 100352) == 1
    assert head_chunk(2, 48, 4096) == 48  # tiny shapes: one chunk


def test_fused_head_loss_reduces_the_head_gradient_once_per_chunk_under_data_parallel():
    """On data 2 x tensor 2 (head split over the vocabulary), the chunk loop's compiled body
    all-reduces the head gradient once (its matmul) and the first chunk plus the onehot part
    outside the loop once each: the onehot part is taken for the whole batch, not per chunk,
    where it doubled the per-chunk head-gradient traffic."""
    code = """
import re
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from olmo_train_jax.head_loss import head_loss_sums
mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
x = jax.device_put(jnp.ones((4, 64, 128)), NamedSharding(mesh, P("data")))
head = jax.device_put(jnp.ones((128, 4096)), NamedSharding(mesh, P(None, "tensor")))
labels = jax.device_put(jnp.ones((4, 64), jnp.int32), NamedSharding(mesh, P("data")))
grad = jax.jit(jax.grad(lambda x, h: head_loss_sums(x, h, labels, 1e-4, chunk=16, batch_shards=2)[0], argnums=(0, 1)))
hlo = grad.lower(x, head).compile().as_text()
bodies = set(re.findall(r"body=%?([\\w.-]+)", hlo))
computations = re.split(r"\\n(?=\\S)", hlo)
shard = re.compile(r"= f32\\[128,2048\\]\\S* all-reduce\\(")
in_loop = sum(len(shard.findall(c)) for c in computations if c.split(" ", 1)[0].lstrip("%") in bodies)
print(in_loop, len(shard.findall(hlo)))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    in_loop, total = map(int, done.stdout.split())
    assert in_loop == 1, done.stdout
    assert total == 3, done.stdout  # first chunk, the loop body, the onehot part


def test_fused_head_loss_chunk_must_divide_sequence():
    x = jnp.zeros((1, 9, 4))
    with pytest.raises(ValueError, match="chunk=4 does not divide the sequence length 9"):
        head_loss_sums(x, jnp.zeros((4, 5)), jnp.zeros((1, 9), jnp.int32), 0.0, 4)


def _numpy_adamw(params, grads_per_step, lrs, recipe, decays):
    """AdamW exactly as trainer_common.md writes it, with torch's clip formula, in float64."""
    o = recipe.optim
    b1, b2 = o.betas
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
        scale = min(1.0, o.grad_clip / (norm + 1e-6))
        for k in p:
            g = grads[k].astype(np.float64) * scale
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            step = m[k] / (1 - b1**t) / (np.sqrt(v[k] / (1 - b2**t)) + o.eps)
            wd = o.weight_decay if decays[k] else 0.0
            p[k] = p[k] - lr * (step + wd * p[k])
    return p


def _flat(tree):
    return {"/".join(path): np.asarray(leaf) for path, leaf in parallelize.tree_paths(tree)}


def test_fused_step_with_accumulation_matches_numpy_adamw():
    # A small vocabulary keeps the compile and the float64 reference quick.
    spec = get_preset("tiny").replace(n_layers=2, vocab_size=256, padded_vocab_size=256)
    recipe = load_recipe(
        None, ["--optim.grad_clip=0.05", "--optim.weight_decay=0.1", "--optim.lr=1e-2", "--train.document_masking=true"]
    )
    mesh = parallelize.build_mesh({"data": -1})
    m = for_mesh(build_model(spec, seed=3), spec, recipe, mesh)
    graphdef, params, tx = m.graphdef, m.params, m.tx
    fns = step_functions(m, spec, recipe, mesh)

    rng = np.random.default_rng(1)
    ids = rng.integers(0, spec.vocab_size, size=(4, 16)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[2, :5] = -100  # uneven valid counts per micro-batch: a mean of means would differ
    docs = np.zeros_like(ids)
    docs[:, 9:] = 1

    def reference_loss(p):
        # One forward over the whole batch, mean over valid tokens: what accumulation must equal.
        logits = nnx.merge(graphdef, p)(jnp.asarray(ids), jnp.asarray(docs)).logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        valid = labels != -100
        picked = jnp.sum(jax.nn.one_hot(np.where(valid, labels, 0), logits.shape[-1]) * logp, axis=-1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        ce = -jnp.sum(picked * valid) / valid.sum()
        return ce + spec.z_loss_weight * jnp.sum(lse**2 * valid) / valid.sum()

    reference_grad = jax.jit(jax.value_and_grad(reference_loss))
    # Accumulation 2 on one device: micro-batch a takes rows [2a, 2a + 2).
    batch = {
        k: jnp.asarray(v.reshape(2, 2, 16)) for k, v in (("input_ids", ids), ("labels", labels), ("doc_ids", docs))
    }
    start = _flat(params)
    lrs, grads_seen = [3e-3, 1e-2, 5e-3], []
    cur, opt_state = params, jax.jit(tx.init)(params)
    fused_params, _, fused_stats = fns.fused(
        jax.tree.map(jnp.copy, params), tx.init(params), batch, np.float32(lrs[0]), np.int32(1)
    )
    for t, lr in enumerate(lrs):
        grads, stats = fns.grads(cur, batch, np.int32(t + 1))
        loss_ref, g_ref = reference_grad(cur)
        assert float(stats["loss"]) == pytest.approx(float(loss_ref), rel=1e-6)
        got_g, ref_g = _flat(grads), _flat(g_ref)
        for k in ref_g:
            # Summation order differs (two micro-batches vs one pass): relative to the largest entry.
            np.testing.assert_allclose(got_g[k], ref_g[k], rtol=1e-4, atol=1e-4 * np.abs(ref_g[k]).max(), err_msg=k)
        grads_seen.append(got_g)
        no_guard = GuardState(jnp.zeros((recipe.spike_guard.window, 2)), jnp.int32(0))  # the guard is off
        cur, opt_state, _, skipped = fns.apply(
            cur, opt_state, grads, stats["loss"], stats["grad_norm"], np.float32(lr), no_guard
        )
        assert not skipped
        if t == 0:  # the fused program is the same maths as grads-then-apply
            for k, v in _flat(fused_params).items():
                np.testing.assert_allclose(v, _flat(cur)[k], rtol=1e-6, atol=1e-9, err_msg=k)
            assert float(fused_stats["loss"]) == pytest.approx(float(stats["loss"]), rel=1e-6)
    want = _numpy_adamw(start, grads_seen, lrs, recipe, _flat(decay_mask(params, recipe)))
    got = _flat(cur)
    for k in want:
        # A clipped update moves a weight by up to ~lr; agreement to 1e-6 is fp32 rounding.
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert int(opt_state[0].count) == 3


def test_decay_mask_follows_recipe():
    spec = get_preset("tiny").replace(n_layers=2)
    params = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: build_model(spec)))[1])
    default = _flat(decay_mask(params, load_recipe(None, [])))
    assert not default["embed"] and default["lm_head"] and default["layers/q_proj"] and default["final_norm"]
    no_norms = _flat(
        decay_mask(params, load_recipe(None, ["--optim.decay_norms=false", "--optim.decay_embeddings=true"]))
    )
    assert no_norms["embed"] and not no_norms["final_norm"] and not no_norms["layers/q_norm"]
    assert no_norms["layers/down_proj"]


def test_partition_specs_by_hand():
    spec = get_preset("tiny-gqa")  # d 64, 4 heads, 2 kv heads, mlp 192, vocab 4096, 4 layers
    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 2})

    def ps(path, shape):
        return parallelize.param_partition_spec(path, shape, spec, mesh)

    assert ps(("layers", "q_proj"), (4, 64, 64)) == P(None, "fsdp", "tensor")
    assert ps(("layers", "k_proj"), (4, 64, 32)) == P(None, "fsdp", "tensor")
    assert ps(("layers", "o_proj"), (4, 64, 64)) == P(None, "tensor", "fsdp")
    assert ps(("layers", "gate_proj"), (4, 64, 192)) == P(None, "fsdp", "tensor")
    assert ps(("layers", "down_proj"), (4, 192, 64)) == P(None, "tensor", "fsdp")
    assert ps(("layers", "q_norm"), (4, 64)) == P(None, None)
    assert ps(("embed",), (4096, 64)) == P("fsdp", None)
    assert ps(("lm_head",), (64, 4096)) == P("fsdp", "tensor")
    assert ps(("final_norm",), (64,)) == P(None)
    # tensor=4 does not divide the 2 kv heads: k/v stay unsplit on that axis; fsdp 3 divides
    # neither 64 nor 32, but divides 192 (the MLP hidden, not taken by tensor there).
    odd = SimpleNamespace(shape={"data": 1, "fsdp": 3, "tensor": 4})
    assert parallelize.param_partition_spec(("layers", "v_proj"), (4, 64, 32), spec, odd) == P(None, None, None)
    assert parallelize.param_partition_spec(("layers", "q_proj"), (4, 64, 64), spec, odd) == P(None, None, "tensor")
    assert parallelize.param_partition_spec(("layers", "up_proj"), (4, 64, 192), spec, odd) == P(None, None, "tensor")
    assert parallelize.param_partition_spec(
        ("embed",), (4096, 64), spec, SimpleNamespace(shape={"data": 1, "fsdp": 3, "tensor": 1})
    ) == P(None, None)


def test_micro_batches_keep_each_device_rows_local():
    rows = np.arange(8)[:, None] * np.ones((1, 3), int)  # row i holds i
    micro = parallelize.to_micro_batches(rows, local_dp=2, accumulation=2)
    # Device 0 owns rows 0-3, device 1 rows 4-7; each micro-step takes 2 rows from each.
    assert micro.shape == (2, 4, 3)
    assert micro[:, :, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_mesh_errors_are_one_line():
    n = jax.device_count()
    with pytest.raises(RecipeError, match="needs"):
        parallelize.build_mesh({"data": n + 1, "fsdp": 1, "tensor": 1})
    with pytest.raises(RecipeError, match="expert"):
        parallelize.build_mesh({"data": -1, "expert": 2})
    mesh = parallelize.build_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    assert dict(mesh.shape) == {"data": 1, "fsdp": n, "tensor": 1}


def test_all_gather_text_is_one_gather_when_every_text_fits_and_two_when_one_does_not(monkeypatch):
    """Two processes played by two threads over a gather that stacks what both sent (the
    collective's contract): both get both texts in process order. Short texts (a batch-digest
    line) take one gather; a text longer than the slot makes both processes gather again."""
    import threading

    barrier = threading.Barrier(2)
    sent: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def process_allgather(x):
        me = int(threading.current_thread().name)
        sent[me].append(np.array(x))
        barrier.wait()
        got = np.stack([sent[0][-1], sent[1][-1]])
        barrier.wait()
        return got

    monkeypatch.setattr(parallelize.multihost_utils, "process_allgather", process_allgather)

    def both(texts: list[str]) -> list[list[str]]:
        out: list[list[str]] = [[], []]

        def one(i: int) -> None:
            out[i] = parallelize.all_gather_text(texts[i])

        threads = [threading.Thread(target=one, args=(i,), name=str(i)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return out

    for texts, gathers in (
        (["0,1:" + "a" * 32, "2,3:" + "b" * 32], 1),
        (["", "seen"], 1),
        (["x" * parallelize.TEXT_SLOT, ""], 1),  # exactly a slot still fits
        (["y" * (parallelize.TEXT_SLOT + 1), "short"], 2),
        (["z" * 1000, "w" * 700], 2),
    ):
        sent[0].clear()
        sent[1].clear()
        assert both(texts) == [texts, texts]
        assert len(sent[0]) == len(sent[1]) == gathers, texts
