"""The capacity rule (``moe.capacity_factor``, ``olmo_model.moe``) in the torch MoE block (CPU,
float32): the kept assignments against the numpy rule, the block's output against a float64
numpy computation of the kept assignments, ``capacity_factor: null`` against the dropless
path bitwise, the dropped count on the train line against a count by hand, the static path
under a fake process group, and expert parallelism over 2 gloo processes against one process.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import start_ranks

from olmo_model import MoESpec, fp32_mean_tolerance
from olmo_model.moe import capacity_keep, expert_capacity
from olmo_run.recipe import batch_layout, load_recipe
from olmo_train_torch.capacity import capacity_slots
from olmo_train_torch.expert_parallel import apply_expert_parallel, reduce_gradients
from olmo_train_torch.hf_adapter import initial_model
from olmo_train_torch.moe import MoE, configure_moe, route, routing_stats
from olmo_train_torch.parallelize import Distributed, build_expert_mesh, build_mesh
from olmo_train_torch.step import make_optimizer, prepare_model, train_step

SPEC = MoESpec(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1)
D, B, S = 32, 4, 8  # C = ceil(1.0 x 8 x 2 / 8) = 2 rows per (sequence, expert)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tensors are tiny (see test_moe_ep.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _block(seed: int = 0, tilt: float = 3.0) -> tuple[MoE, torch.Tensor]:
    """A block whose router prefers experts 0-1 (so capacity 1.0 drops) and inputs [B, S, D]."""
    torch.manual_seed(seed)
    block = MoE(SPEC, D, layer=0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        direction = F.normalize(torch.randn(D), dim=0)
        block.router.weight[:2] += tilt * direction
    x = torch.randn(B, S, D) + direction
    return block, x


def _routing(block: MoE, x: torch.Tensor, mode: str = "learned"):
    logits = F.linear(x.reshape(-1, D).float(), block.router.weight.float())
    generator = torch.Generator().manual_seed(11)
    routing, _ = route(logits, SPEC, mode, generator)  # type: ignore[arg-type]
    return routing


@pytest.mark.parametrize("mode", ["learned", "random", "uniform"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_kept_assignments_are_the_numpy_rules(mode, factor):
    block, x = _block()
    experts = _routing(block, x, mode).experts.reshape(B, S, SPEC.top_k)
    c = expert_capacity(factor, S, SPEC.top_k, SPEC.n_experts)
    slots = capacity_slots(experts, SPEC.n_experts, c)
    want = capacity_keep(experts.numpy(), SPEC.n_experts, c)
    np.testing.assert_array_equal(slots.keep.numpy().reshape(want.shape), want)
    # Every kept assignment owns one buffer row, in its (expert, sequence) cell; the rest are empty.
    kept_slots = slots.slot[slots.keep]
    assert len(set(kept_slots.tolist())) == int(slots.keep.sum())
    cell = experts.reshape(-1)[slots.keep] * B + torch.arange(B).repeat_interleave(S * SPEC.top_k)[slots.keep]
    assert torch.equal(kept_slots // c, cell)
    assert torch.equal(slots.source[kept_slots], torch.nonzero(slots.keep)[:, 0])
    assert int((slots.source < B * S * SPEC.top_k).sum()) == int(slots.keep.sum())
    if mode == "uniform" and factor >= 1.0:
        assert want.all()  # 16 assignments per sequence, 2 per expert: none over C >= 2


def _swiglu64(w: dict, x: np.ndarray) -> np.ndarray:
    g, u = x @ w["gate"].T, x @ w["up"].T
    return (g / (1 + np.exp(-g)) * u) @ w["down"].T


def test_block_output_is_the_kept_assignments_computed_in_float64():
    """out = sum over kept (token, slot) of w x SwiGLU_e(x) + shared(x); dropped assignments add
    nothing. The routing (experts and weights) is the block's own; the rest is numpy."""
    block, x = _block()
    configure_moe(block, capacity_factor=1.0)
    out, stats = block(x)
    routing = _routing(block, x)
    experts = routing.experts.numpy().reshape(B, S, SPEC.top_k)
    keep = capacity_keep(experts, SPEC.n_experts, 2).reshape(-1, SPEC.top_k)
    assert 0 < int((~keep).sum()) == int(stats.dropped)  # capacity 1.0 drops here
    p = {n: t.detach().double().numpy() for n, t in block.named_parameters()}
    xs = x.reshape(-1, D).double().numpy()
    want = np.zeros_like(xs)
    for t in range(xs.shape[0]):
        for j, e in enumerate(experts.reshape(-1, SPEC.top_k)[t]):
            if keep[t, j]:
                w = {k: p[f"experts.{k}_proj"][e] for k in ("gate", "up", "down")}
                want[t] += routing.weights[t, j].item() * _swiglu64(w, xs[t])
    shared = {k: p[f"shared_experts.0.{k}_proj.weight"] for k in ("gate", "up", "down")}
    want += _swiglu64(shared, xs)
    # fp32 against float64: sums of 32 and 16 products of O(1) terms, well inside 1e-5.
    np.testing.assert_allclose(out.detach().reshape(-1, D).numpy(), want, atol=1e-5, rtol=0)
    assert stats.tokens_per_expert.tolist() == np.bincount(experts.reshape(-1), minlength=8).tolist()


def test_null_capacity_is_the_dropless_path_bitwise():
    """``capacity_factor`` None runs the dropless path unchanged: the block equals that path's
    computation (sort by expert, one grouped GEMM, back to slot order) written out here."""
    block, x = _block()
    configure_moe(block, capacity_factor=None)
    out, stats = block(x)
    routing = _routing(block, x)
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=SPEC.n_experts)
    tokens = x.reshape(-1, D)
    per_slot_in = tokens.unsqueeze(1).expand(-1, SPEC.top_k, -1).reshape(-1, D)
    ys = block.experts(per_slot_in[order], sizes)
    per_slot = torch.empty_like(ys).index_copy(0, order, ys).reshape(-1, SPEC.top_k, D)
    want = (per_slot * routing.weights.unsqueeze(-1)).sum(1) + block.shared_experts[0](tokens)
    assert torch.equal(out.reshape(-1, D), want)
    assert int(stats.dropped) == 0


# ---- the train line --------------------------------------------------------------------------------

ROWS, SEQ, LAYERS, E, K = 4, 32, 4, 8, 4  # tiny-moe: 4 MoE layers, top-4 of 8


def _step(d: Distributed, *extra: str) -> dict:
    recipe = load_recipe(None, ["--model=tiny-moe", "--train.precision=fp32", *extra])
    spec = recipe.model_spec()
    model = prepare_model(
        initial_model(spec, seed=3), recipe, d, build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch)
    )
    rng = np.random.default_rng(5)
    ids = rng.integers(2, 4096, size=(ROWS, SEQ + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "doc_ids": np.zeros((ROWS, SEQ), np.int64)}
    per = ROWS // d.world_size
    batch = {k: v[d.rank * per : (d.rank + 1) * per].astype(np.int32) for k, v in batch.items()}
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
    return {"loss": stats["loss"], "dropped": stats["moe_dropped_tokens"], "counts": stats["moe_tokens_per_expert"]}


ONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=False)


def test_dropped_count_reaches_the_train_line():
    """Uniform routing sends each sequence's 32 x 4 = 128 assignments 16 to each expert
    (assignment n to expert n mod 8, 128 a multiple of 8); capacity 0.5 keeps C = 8 of them:
    8 x 8 dropped per sequence, x 4 sequences x 4 layers = 1024 by hand. Random routing runs too."""
    uniform = _step(ONE, "--moe.routing=uniform", "--moe.capacity_factor=0.5", "--torch.parallel=none")
    assert uniform["dropped"] == LAYERS * ROWS * E * (16 - 8) == 1024
    assert sum(uniform["counts"]) == LAYERS * ROWS * SEQ * K  # counts are before the rule
    dropless = _step(ONE, "--moe.routing=random", "--torch.parallel=none")
    random = _step(ONE, "--moe.routing=random", "--moe.capacity_factor=1.0", "--torch.parallel=none")
    assert dropless["dropped"] == 0 and random["counts"] == dropless["counts"]
    assert 0 < random["dropped"] < LAYERS * ROWS * SEQ * K and np.isfinite(random["loss"])


# ---- expert parallelism ----------------------------------------------------------------------------


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _no_host_reads(monkeypatch) -> None:
    """Every way a tensor reaches the host raises from here on (the test's monkeypatch undoes it)."""
    for name in HOST_READS:

        def trapped(self, *args, name=name, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}")

        monkeypatch.setattr(torch.Tensor, name, trapped)


def test_capacity_path_reads_nothing_to_the_host_and_runs_under_a_fake_process_group(monkeypatch):
    """Forward, routing statistics and backward with a capacity factor, locally and with EP 2 under
    the dry run's fake process group (its all-to-all outputs are garbage, so no shape may depend on
    them), with every tensor-to-host call trapped."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        for ep in (False, True):
            block, x = _block()
            configure_moe(block, capacity_factor=1.25)
            if ep:
                apply_expert_parallel(block, dist.group.WORLD)
            with monkeypatch.context() as m:
                _no_host_reads(m)
                out, stats = block(x)
                aux = routing_stats([stats], group=dist.group.WORLD if ep else None)
                (out.sum() + aux.load_balancing).backward()
            assert out.shape == x.shape
            assert block.experts.gate_proj.grad.shape == ((4 if ep else 8), 16, D)
    finally:
        dist.destroy_process_group()


def _ep_worker(rank: int, port: int, want: dict) -> None:
    """Needs processes: expert parallelism is gloo all-to-alls between ranks."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d = Distributed(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), initialized=True)
    try:
        block = want["block"]
        apply_expert_parallel(block, dist.group.WORLD)
        rows = slice(rank * B // 2, (rank + 1) * B // 2)
        out, stats = block(want["x"][rows])
        aux = routing_stats([stats], group=dist.group.WORLD)
        (out * want["upstream"][rows]).sum().backward()
        reduce_gradients(block, dist.group.WORLD)
        torch.testing.assert_close(out, want["out"][rows], atol=1e-5, rtol=0)
        assert int(aux.dropped) == want["dropped"] > 0
        for name, p in block.named_parameters():
            ref = want["grads"][name]
            ref = ref[rank * 4 : (rank + 1) * 4] if name.startswith("experts.") else ref
            torch.testing.assert_close(p.grad, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        got = _step(d, "--moe.capacity_factor=1.0", "--torch.parallel=ddp", "--torch.expert_parallel=2")
        assert got["dropped"] == want["step"]["dropped"] > 0
        assert abs(got["loss"] - want["step"]["loss"]) <= fp32_mean_tolerance(got["loss"], ROWS * SEQ)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_with_capacity_matches_one_process():
    """EP 2 over 2 gloo ranks (one sequence pair each) against the whole batch in one process:
    the per-sequence rule drops the same assignments in both, so outputs, gradients (the
    experts' shards), the dropped count and a train step's loss agree."""
    block, x = _block()
    configure_moe(block, capacity_factor=1.0)
    ep_block = copy.deepcopy(block)
    upstream = torch.randn(B, S, D)
    out, stats = block(x)
    (out * upstream).sum().backward()
    want = {
        "block": ep_block,
        "x": x,
        "upstream": upstream,
        "out": out.detach(),
        "dropped": int(stats.dropped),
        "grads": {n: p.grad for n, p in block.named_parameters()},
        "step": _step(ONE, "--moe.capacity_factor=1.0", "--torch.parallel=none"),
    }
    start_ranks(_ep_worker, 2, want)
