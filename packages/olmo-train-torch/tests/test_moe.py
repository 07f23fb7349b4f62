"""The torch MoE block and model (one process, CPU, float32) against independent references:
the float64 numpy model (``olmo_model.reference``), a dense float64 torch rewrite of the
block written here, finite differences, transformers' ``OlmoeSparseMoeBlock``, and values
derived by hand (routing balance, MXFP8 error bounds)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from olmo_model import MoESpec, SpecError, get_preset, param_counts, reference
from olmo_model.hf_moe import block_tensors_from_olmoe, olmoe_block_tensors, olmoe_config, spec_from_olmoe_config
from olmo_model.moe import rank_load_max_over_mean
from olmo_train_torch.grouped_gemm import grouped_matmul, mxfp8_quantize
from olmo_train_torch.hf_adapter import CheckpointMismatchError, initial_model, load_hf, model_from_hf, to_hf
from olmo_train_torch.moe import (
    MoE,
    aux_loss,
    configure_moe,
    moe_metrics,
    route,
    routing_stats,
    top_k_lowest_index_on_ties,
)

SEQ = 48  # longer than tiny's window of 32: sliding and global layers both matter


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared CPU a thread pool
    spends far more time waiting for cores than computing (measured 30x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _variant(name: str):
    spec = get_preset("tiny-moe")
    if name == "sigmoid-norm-partial":
        moe = spec.moe.model_copy(
            update=dict(
                gating="sigmoid",
                normalize_top_k=True,
                layers=(1, 3),
                n_shared_experts=2,
                shared_expert_hidden=32,
            )
        )
        spec = spec.replace(moe=moe.model_dump())
    return spec


def _ids(seed: int, shape=(2, SEQ)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, shape)


def _total_loss(model, spec, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ce + z_w * z + lb_w * lb + router_z_w * router_z, means over all tokens."""
    out = model(ids)
    logits, stats = out.logits, out.moe
    flat = logits.float().reshape(-1, logits.shape[-1])
    lse = torch.logsumexp(flat, dim=-1)
    ce = F.cross_entropy(flat, labels.reshape(-1))
    return ce + spec.z_loss_weight * (lse**2).mean() + aux_loss(routing_stats(stats), spec.moe)


@functools.cache
def _reference_run(variant: str):
    spec = _variant(variant)
    params = reference.init_params(spec, seed=3)
    ids, labels = _ids(1), _ids(2)
    logits, aux = reference.forward_with_aux(spec, params, ids)
    return spec, params, ids, labels, logits, aux, reference.loss(spec, params, ids, labels)


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
@pytest.mark.parametrize("variant", ["tiny-moe", "sigmoid-norm-partial"])
def test_logits_aux_and_loss_match_numpy_reference(variant, gemm):
    spec, params, ids, labels, ref_logits, ref_aux, ref_loss = _reference_run(variant)
    model = model_from_hf(spec, params)
    configure_moe(model, gemm=gemm)
    with torch.no_grad():
        out = model(torch.from_numpy(ids))
        logits, stats = out.logits, out.moe
        aux = routing_stats(stats)
        total = _total_loss(model, spec, torch.from_numpy(ids), torch.from_numpy(labels))
    assert len(stats) == (2 if variant != "tiny-moe" else 4)
    np.testing.assert_allclose(logits.double().numpy(), ref_logits, atol=1e-4, rtol=0)
    assert abs(float(aux.load_balancing) - ref_aux["load_balancing_loss"]) < 1e-5
    assert abs(float(aux.router_z) - ref_aux["router_z_loss"]) < 1e-5
    assert abs(float(total) - ref_loss["total"]) < 1e-5
    # Dropless: every (token, slot) of every MoE layer was counted and computed.
    assert int(aux.tokens_per_expert.sum()) == len(stats) * ids.size * spec.moe.top_k
    assert int(aux.dropped) == 0


def _dense_block64(x, gate, wg, wu, wd, shared, moe: MoESpec):
    """The MoE block written densely in float64: every expert runs on every token and is
    weighted by a [T, E] matrix that is zero off the chosen experts (no sorting, no groups)."""
    logits = x @ gate.T
    probs = torch.softmax(logits, -1) if moe.gating == "softmax" else torch.sigmoid(logits)
    chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : moe.top_k]
    picked = probs.gather(1, chosen)
    if moe.normalize_top_k:
        picked = picked / picked.sum(-1, keepdim=True)
    combine = torch.zeros_like(probs).scatter(1, chosen, picked)
    out = sum(combine[:, e : e + 1] * ((F.silu(x @ wg[e].T) * (x @ wu[e].T)) @ wd[e].T) for e in range(moe.n_experts))
    for sg, su, sd in shared:
        out = out + (F.silu(x @ sg.T) * (x @ su.T)) @ sd.T
    counts = torch.zeros(moe.n_experts, dtype=x.dtype).scatter_add(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=x.dtype)
    )
    lb = moe.n_experts * (counts / chosen.numel() * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return out, lb, z


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
def test_block_gradients_match_dense_float64(gemm):
    moe = MoESpec(n_experts=8, top_k=3, expert_hidden=32, n_shared_experts=1, normalize_top_k=True)
    torch.manual_seed(0)
    block = MoE(moe, 64, layer=0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    block.experts.gemm = gemm
    x = torch.randn(96, 64)
    upstream = torch.randn(96, 64)
    x32 = x.clone().requires_grad_()
    out, stats = block(x32)
    aux = routing_stats([stats])
    ((out * upstream).sum() + 0.5 * aux.load_balancing + 0.25 * aux.router_z).backward()

    leaves = {name: p.detach().double().clone().requires_grad_() for name, p in block.named_parameters()}
    x64 = x.double().requires_grad_()
    shared = [
        (
            leaves["shared_experts.0.gate_proj.weight"],
            leaves["shared_experts.0.up_proj.weight"],
            leaves["shared_experts.0.down_proj.weight"],
        )
    ]
    out64, lb64, z64 = _dense_block64(
        x64,
        leaves["router.weight"],
        leaves["experts.gate_proj"],
        leaves["experts.up_proj"],
        leaves["experts.down_proj"],
        shared,
        moe,
    )
    ((out64 * upstream.double()).sum() + 0.5 * lb64 + 0.25 * z64).backward()

    np.testing.assert_allclose(out.detach().numpy(), out64.detach().numpy(), atol=2e-5, rtol=0)
    assert abs(float(aux.load_balancing.detach()) - float(lb64.detach())) < 1e-6
    grads = {"x": (x32.grad, x64.grad)}
    grads |= {name: (p.grad, leaves[name].grad) for name, p in block.named_parameters()}
    for name, (got, want) in grads.items():
        scale = float(want.abs().max())
        err = float((got.double() - want).abs().max())
        assert err <= 1e-5 * max(scale, 1.0), f"{name}: max |grad error| {err:.2e} (grad scale {scale:.2e})"


def test_model_gradients_match_finite_differences_of_numpy_reference():
    spec = get_preset("tiny-moe")
    params = reference.init_params(spec, seed=5)
    ids, labels = _ids(3, (1, SEQ)), _ids(4, (1, SEQ))
    model = model_from_hf(spec, params)
    _total_loss(model, spec, torch.from_numpy(ids), torch.from_numpy(labels)).backward()
    state = dict(model.named_parameters())
    # (HF name, index, our parameter, index): router, a routed expert, the shared expert, attention, head.
    probes = [
        ("model.layers.0.mlp.gate.weight", (2, 5), "blocks.0.mlp.router.weight", (2, 5)),
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (7, 11), "blocks.1.mlp.experts.gate_proj", (3, 7, 11)),
        ("model.layers.2.mlp.experts.6.down_proj.weight", (4, 9), "blocks.2.mlp.experts.down_proj", (6, 4, 9)),
        (
            "model.layers.3.mlp.shared_experts.0.up_proj.weight",
            (1, 2),
            "blocks.3.mlp.shared_experts.0.up_proj.weight",
            (1, 2),
        ),
        ("model.layers.0.self_attn.q_proj.weight", (10, 3), "blocks.0.attn.q_proj.weight", (10, 3)),
    ]
    h = 1e-4
    for hf_name, hf_idx, ours, our_idx in probes:

        def total(delta: float) -> float:
            p = {k: v.astype(np.float64) for k, v in params.items()}
            p[hf_name] = p[hf_name].copy()
            p[hf_name][hf_idx] += delta
            return reference.loss(spec, p, ids, labels)["total"]

        fd = (total(h) - total(-h)) / (2 * h)
        got = float(state[ours].grad[our_idx])
        assert abs(got - fd) <= 2e-4 * abs(fd) + 2e-6, (
            f"{hf_name}{hf_idx}: autograd {got:.6e} vs finite difference {fd:.6e}"
        )


def test_hf_adapter_maps_per_expert_names_to_stacked_slices():
    spec = get_preset("tiny-moe")
    params = reference.init_params(spec, seed=0)
    model = model_from_hf(spec, params)
    state = model.state_dict()
    np.testing.assert_array_equal(
        state["blocks.2.mlp.experts.up_proj"][5].numpy(), params["model.layers.2.mlp.experts.5.up_proj.weight"]
    )
    np.testing.assert_array_equal(state["blocks.2.mlp.router.weight"].numpy(), params["model.layers.2.mlp.gate.weight"])
    back = to_hf(model, spec)
    assert list(back) == list(params)
    for name, value in params.items():
        np.testing.assert_array_equal(back[name].numpy(), value)
    bad = dict(params)
    bad["model.layers.1.mlp.experts.2.down_proj.weight"] = np.zeros((64, 63), np.float32)
    with pytest.raises(CheckpointMismatchError, match=r"experts\.2\.down_proj.*\(64, 63\).*\(64, 64\)"):
        load_hf(initial_model(spec), bad)


def test_dense_spec_returns_no_moe_stats():
    spec = get_preset("tiny")
    model = initial_model(spec, seed=0)
    ids = torch.from_numpy(_ids(0))
    with torch.no_grad():
        out = model(ids)
    assert out.moe is None and out.loss_sums is None
    assert out.logits.shape == (*ids.shape, spec.padded_vocab_size)


# ---- routing modes and load metrics ------------------------------------------------------------


def _block(n_experts=16, top_k=4, seed=0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(MoESpec(n_experts=n_experts, top_k=top_k, expert_hidden=32), 64, layer=0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    return block


def test_random_routing_is_near_uniform_and_leaves_the_router_untrained():
    block = _block()
    block.routing = "random"
    x = torch.randn(2048, 64)
    out, stats = block(x)
    counts = stats.tokens_per_expert.double()
    # 2048*4/16 = 512 assignments per expert on average, binomial std ~ 22: max/mean ~ 1.1.
    assert float(counts.max() / counts.mean()) < 1.2
    assert int(counts.sum()) == 2048 * 4
    out.square().sum().backward()
    assert block.router.weight.grad is None
    assert block.experts.gate_proj.grad is not None
    # The same (seed, step, micro-step, layer) draws the same routing; another step draws another.
    again = block(x)[1].tokens_per_expert
    block.routing_step = 1
    other = block(x)[1].tokens_per_expert
    assert torch.equal(again, stats.tokens_per_expert) and not torch.equal(other, stats.tokens_per_expert)


@pytest.mark.parametrize("routing", ["random", "uniform"])
def test_a_rank_routes_its_rows_of_the_global_micro_batch_as_one_process_would(routing):
    """Random and uniform routing number tokens in the global micro-batch: 4 data-parallel
    ranks holding 25 tokens each route them exactly as one process routes all 100."""
    block = _block()
    block.routing = routing
    x = torch.randn(100, 64)
    whole, whole_stats = block(x)
    counts = torch.zeros(16, dtype=torch.long)
    for rank in range(4):
        block.dp_rank, block.dp_size = rank, 4
        part, stats = block(x[rank * 25 : (rank + 1) * 25])
        counts += stats.tokens_per_expert
        torch.testing.assert_close(part, whole[rank * 25 : (rank + 1) * 25], atol=1e-6, rtol=0)
    assert torch.equal(counts, whole_stats.tokens_per_expert)
    if routing == "uniform":
        # By hand: rank 1's first token is global token 25, whose slots 100..103 go to
        # experts 100..103 mod 16 = 4..7 (numbering per rank would give 0..3).
        experts = route(torch.zeros(25, 16), block.spec, "uniform", first_token=25, global_tokens=100)[0].experts
        assert experts[0].tolist() == [4, 5, 6, 7]


def test_uniform_routing_is_exactly_balanced():
    block = _block()
    block.routing = "uniform"
    out, stats = block(torch.randn(100, 64))
    assert stats.tokens_per_expert.tolist() == [100 * 4 // 16] * 16
    assert rank_load_max_over_mean(stats.tokens_per_expert, ep_size=4) == 1.0


def test_imbalanced_router_shows_in_rank_load_while_nothing_is_dropped():
    block = _block()
    direction = torch.randn(64)
    direction /= direction.norm()
    with torch.no_grad():
        # Experts 0-3 (rank 0 of 4 with 16 experts) read the tokens' common component.
        block.router.weight[:4] += 4.0 * direction
    x = 3.0 * direction + 0.3 * torch.randn(512, 64)
    out, stats = block(x)
    metrics = moe_metrics(routing_stats([stats]), ep_size=4)
    # Every token's 4 slots land on rank 0: its load is 4x the mean over 4 ranks.
    assert metrics["moe_tokens_per_expert"] == [512] * 4 + [0] * 12
    assert metrics["moe_rank_load_max_over_mean"] == 4.0
    assert metrics["moe_dropped_tokens"] == 0
    # f_e = 1/4 on experts 0-3, whose mean probability is almost 1/4 each: lb near E/k = 4
    # (1.0 when balanced).
    assert metrics["moe_lb_loss"] > 3.0
    # Dropless: the sorted path equals the dense float64 block on every token.
    dense, _, _ = _dense_block64(
        x.double(),
        block.router.weight.double(),
        block.experts.gate_proj.double(),
        block.experts.up_proj.double(),
        block.experts.down_proj.double(),
        [],
        block.spec,
    )
    np.testing.assert_allclose(out.detach().numpy(), dense.detach().numpy(), atol=1e-5, rtol=0)


def test_bad_knobs_fail_with_clear_messages():
    model = initial_model(get_preset("tiny-moe"))
    with pytest.raises(ValueError, match="routing='greedy' is unknown; use one of: learned, random, uniform"):
        configure_moe(model, routing="greedy")
    with pytest.raises(ValueError, match="ep_size=3 does not divide n_experts=8"):
        rank_load_max_over_mean(torch.ones(8), ep_size=3)


# ---- grouped GEMM and MXFP8 --------------------------------------------------------------------


def test_grouped_matmul_backends_agree_with_per_group_matmuls_including_empty_groups():
    torch.manual_seed(1)
    x, w = torch.randn(40, 64), torch.randn(4, 64, 32)
    sizes = torch.tensor([0, 17, 0, 23])
    want = torch.cat([x[:17] @ w[1], x[17:] @ w[3]])
    for backend in ("grouped_mm", "loop"):
        torch.testing.assert_close(grouped_matmul(x, w, sizes, backend), want, atol=1e-5, rtol=0)


def test_mxfp8_quantize_blocks_scales_and_rounding():
    torch.manual_seed(2)
    t = torch.randn(8, 96) * torch.logspace(-3, 3, 8)[:, None]  # rows of very different magnitude
    q = mxfp8_quantize(t, dim=-1)
    for row in range(8):
        for b in range(3):
            blk, qb = t[row, 32 * b : 32 * b + 32].double(), q[row, 32 * b : 32 * b + 32].double()
            scale = 2.0 ** math.ceil(math.log2(float(blk.abs().max()) / 448.0))
            # Every value is an e4m3 number times the block's power-of-two scale ...
            assert torch.equal((qb / scale).float().to(torch.float8_e4m3fn).double(), qb / scale)
            # ... within half an e4m3 step: 2^-4 relative (3 mantissa bits), or 2^-10 * scale
            # (half the smallest subnormal step 2^-9) below e4m3's normal range.
            bound = torch.maximum(blk.abs() * 2.0**-4, torch.full_like(blk, 2.0**-10 * scale))
            assert bool(((qb - blk).abs() <= bound).all())
    # A hand-built block: amax 1000 -> scale 2^ceil(log2(1000/448)) = 4; 1000/4 = 250 is
    # between the e4m3 neighbours 240 and 256, nearer 256, so 1000 -> 1024; 3 -> 3/4 = 0.75 exactly.
    blk = torch.zeros(32)
    blk[0], blk[1] = 1000.0, 3.0
    assert mxfp8_quantize(blk)[:2].tolist() == [1024.0, 3.0]


def test_mxfp8_gemm_error_is_within_the_e4m3_bound_and_reported_against_bf16():
    torch.manual_seed(3)
    x, w = torch.randn(256, 512), torch.randn(384, 512)
    exact = x.double() @ w.double().T
    mx = mxfp8_quantize(x, -1) @ mxfp8_quantize(w, -1).T
    bf16 = (x.bfloat16() @ w.bfloat16().T).double()

    def rel(y):
        return float((y.double() - exact).norm() / exact.norm())

    # Per output, |error| <= sum_k (ex_k |w_k| + |x_k| ew_k + ex_k ew_k) with e <= 2^-4 |.|
    # (no element of Gaussian data falls into e4m3's subnormals at these scales).
    e = 2.0**-4
    bound = (2 * e + e * e) * (x.double().abs() @ w.double().abs().T) + 1e-3
    assert bool(((mx.double() - exact).abs() <= bound).all())
    # Independent rounding errors (RMS about 2^-4/sqrt(3) per operand for round-to-nearest
    # over a 3-bit mantissa) add in quadrature: ~0.03-0.05 relative; bf16 (8 bits) ~0.003.
    assert 0.01 < rel(mx) < 0.06
    assert rel(bf16) < 0.005
    assert 4 < rel(mx) / rel(bf16) < 40


def test_mxfp8_experts_stay_close_to_fp32_and_pass_gradients_through():
    block = _block(seed=4)
    x = torch.randn(256, 64)
    ref, _ = block(x)
    block.experts.mxfp8 = True
    got, _ = block(x)
    assert float((got - ref).detach().norm() / ref.detach().norm()) < 0.08
    got.square().sum().backward()
    assert block.experts.down_proj.grad is not None and bool(block.experts.down_proj.grad.abs().sum() > 0)


# ---- OLMoE interop --------------------------------------------------------------------------


def _olmoe_spec(normalize: bool):
    spec = get_preset("tiny-moe").replace(sliding_window=None, norm_placement="pre")
    moe = spec.moe.model_copy(update=dict(n_shared_experts=0, normalize_top_k=normalize))
    return spec.replace(moe=moe.model_dump())


@pytest.mark.parametrize("normalize", [False, True])
def test_logits_match_transformers_olmoe_for_causal_lm(normalize):
    """A whole pre-norm MoE model against transformers' OlmoeForCausalLM on the same weights
    (olmo_model.hf_moe.olmoe_state_dict), and against the float64 numpy reference (fp32)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from olmo_model.hf_moe import olmoe_state_dict, tensors_from_olmoe

    spec = _olmoe_spec(normalize)
    params = reference.init_params(spec, seed=7)
    hf = OlmoeForCausalLM(OlmoeConfig(**olmoe_config(spec))).eval()
    state = olmoe_state_dict(params, spec)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    ids = torch.from_numpy(np.random.default_rng(8).integers(0, spec.vocab_size, (2, SEQ)))
    ours = model_from_hf(spec, params).eval()
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, ours(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    ref = reference.forward(spec, params, ids.numpy())
    assert np.abs(got.double().numpy() - ref).max() <= 1e-4
    # The reordered-norm model on the same weights is a different function: the test can fail.
    with torch.no_grad():
        other = model_from_hf(spec.replace(norm_placement="reordered"), params).eval()(ids).logits
    assert (other - want).abs().max().item() > 1e-2
    back = tensors_from_olmoe(state, spec)
    assert back.keys() == params.keys()
    for name, value in back.items():
        np.testing.assert_array_equal(value, params[name])


@pytest.mark.parametrize("normalize", [False, True])
def test_block_matches_transformers_olmoe_sparse_moe_block(normalize):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    spec = _olmoe_spec(normalize)
    params = reference.init_params(spec, seed=6)
    hf_block = OlmoeSparseMoeBlock(OlmoeConfig(**olmoe_config(spec)))
    block_tensors = olmoe_block_tensors(params, spec, layer=2)
    hf_block.load_state_dict({k: torch.from_numpy(v) for k, v in block_tensors.items()})
    ours = model_from_hf(spec, params).blocks[2].mlp
    x = torch.randn(2, SEQ, 64) * 2.0
    with torch.no_grad():
        want = hf_block(x)
        got, _ = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    back = block_tensors_from_olmoe(block_tensors, spec, layer=2)
    for name, value in back.items():
        np.testing.assert_array_equal(value, params[name])


def test_olmoe_config_round_trip_and_refusals():
    spec = _olmoe_spec(True)
    again = spec_from_olmoe_config(olmoe_config(spec))
    assert again.replace(mlp_hidden=spec.mlp_hidden) == spec
    with pytest.raises(SpecError, match="norm_placement='reordered' cannot be expressed by OlmoeForCausalLM"):
        olmoe_config(spec.replace(norm_placement="reordered"))
    with pytest.raises(SpecError, match="n_shared_experts=1 cannot be expressed by OlmoeForCausalLM; set it to 0"):
        olmoe_config(get_preset("tiny-moe").replace(norm_placement="pre"))
    with pytest.raises(SpecError, match="sliding-window layers cannot be expressed"):
        olmoe_config(get_preset("tiny-moe").replace(moe=spec.moe.model_dump(), norm_placement="pre"))
    with pytest.raises(SpecError, match="'experts.down_proj' has shape"):
        block_tensors_from_olmoe(
            {
                "gate.weight": np.zeros((8, 64)),
                "experts.gate_up_proj": np.zeros((8, 128, 64)),
                "experts.down_proj": np.zeros((8, 64, 32)),
            },
            spec,
            0,
        )


def test_spec_from_the_hub_olmoe_1b_7b_config_has_its_published_sizes():
    # allenai/OLMoE-1B-7B-0924's config.json fields (the hub's, typed in here).
    cfg = {
        "model_type": "olmoe",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "clip_qkv": None,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.01,
        "pad_token_id": 1,
        "eos_token_id": 50279,
        "bos_token_id": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    spec = spec_from_olmoe_config(cfg)
    assert (spec.moe.n_experts, spec.moe.top_k, spec.moe.expert_hidden, spec.rope_theta) == (64, 8, 1024, 10000.0)
    counts = param_counts(spec)
    # The OLMoE paper (Muennighoff et al. 2024): 6.9B total, 1.3B active parameters.
    assert round(counts.total / 1e9, 1) == 6.9
    assert round(counts.active / 1e9, 1) == 1.3


def test_router_stays_float32_under_bf16_autocast():
    block = _block(seed=5)
    x = torch.randn(300, 64)
    _, fp32_stats = block(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, stats = block(x)
    assert out.dtype == torch.bfloat16  # the experts ran in bf16 ...
    assert stats.prob_sum.dtype == torch.float32  # ... the router did not: same routing as fp32
    assert torch.equal(stats.tokens_per_expert, fp32_stats.tokens_per_expert)
    torch.testing.assert_close(stats.prob_sum, fp32_stats.prob_sum, atol=0, rtol=0)


def test_top_k_takes_the_lower_index_among_ties_like_a_stable_sort():
    rng = np.random.default_rng(7)
    scores = rng.integers(0, 4, size=(500, 16)).astype(np.float32) / 4  # four levels: ties everywhere
    scores[0] = 0.5  # a row of equal scores
    got = top_k_lowest_index_on_ties(torch.from_numpy(scores), 4).numpy()
    want = np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, :4], axis=-1)
    np.testing.assert_array_equal(got, want)
    assert got[0].tolist() == [0, 1, 2, 3]
