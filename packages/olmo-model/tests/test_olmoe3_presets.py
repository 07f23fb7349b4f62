"""OLMo-core 3's OLMoE3 reference configurations as presets: their parameter counts against the
report's table (as OLMo-core's src/test/examples/olmo_ddp_tech_report_test.py pins them) and
exactly against OLMo-core's own count, FLOPs per token against a count by hand (olmoe3-t001) and
against the expert-pool benchmark's own FLOPs formula (moe_8l_common.py), and tiny-olmoe3 against
olmoe3-t001."""

from __future__ import annotations

import pytest

from olmo_model import SpecError, cli, get_preset, param_counts, spec_from_dict
from olmo_model.maths import flops_per_token

# (preset, active, total) in billions as the report and OLMo-core's test write them; OLMo-core's
# test rounds active to 2 decimals, total to 2 decimals below 1000B and to whole billions above
# (1.200T, 2.380T).
REPORT = [
    ("olmoe3-t001", 1.59, 12.91),
    ("olmoe3-s001", 4.29, 40.86),
    ("olmoe3-m001", 7.38, 103.75),
    ("olmoe3-m002", 7.38, 137.27),
    ("olmoe3-l001", 15.14, 295.99),
    ("olmoe3-u001", 58.36, 1200.0),
    ("olmoe3-u002", 58.41, 2380.0),
]


@pytest.mark.parametrize(("preset", "active_b", "total_b"), REPORT)
def test_counts_match_the_report(preset, active_b, total_b):
    counts = param_counts(get_preset(preset))
    assert round(counts.active / 1e9, 2) == active_b
    digits = 0 if total_b >= 1000 else 2
    assert round(counts.total / 1e9, digits) == round(total_b, digits)


@pytest.mark.parametrize("experts", [8, 32, 64, 128])
def test_benchmark_counts_match_the_report(experts):
    """The report's expert-pool benchmark: ~3.2B active at every pool size, 4.6B total with 8
    experts, 47B with 128."""
    counts = param_counts(get_preset(f"olmoe3-bench-e{experts}"))
    assert round(counts.active / 1e9, 1) == 3.2
    if experts == 8:
        assert round(counts.total / 1e9, 1) == 4.6
    if experts == 128:
        assert round(counts.total / 1e9) == 47


# OLMo-core 3.0.0's OLMoDDPModelConfig.num_active_params / num_params of the same models, printed by
# tools/bench/olmo_core/olmoe3_counts.py (OLMo-core's test gives only the rounded figures above).
OLMO_CORE = {
    "olmoe3-t001": (1_587_552_256, 12_912_173_056),
    "olmoe3-s001": (4_294_095_872, 40_863_183_872),
    "olmoe3-m001": (7_375_556_352, 103_748_079_360),
    "olmoe3-m002": (7_379_193_600, 137_272_594_176),
    "olmoe3-l001": (15_138_557_696, 295_989_153_536),
    "olmoe3-u001": (58_358_763_264, 1_200_484_519_680),
    "olmoe3-u002": (58_406_735_616, 2_379_501_014_784),
    "olmoe3-bench-e8": (3_171_198_976, 4_580_485_120),
    "olmoe3-bench-e32": (3_171_887_104, 13_036_890_112),
    "olmoe3-bench-e64": (3_172_804_608, 24_312_096_768),
    "olmoe3-bench-e128": (3_174_639_616, 46_862_510_080),
}


@pytest.mark.parametrize("preset", sorted(OLMO_CORE))
def test_counts_equal_olmo_cores(preset):
    """Embeddings, head, routers and norms counted as OLMo-core counts them, exactly: the embedding
    RMSNorm, and in the peri-norm production blocks (not the benchmark's) the input RMSNorms before
    attention and before the MLP besides the two output norms."""
    counts = param_counts(get_preset(preset))
    assert (counts.active, counts.total) == OLMO_CORE[preset]


def test_norm_options_count_their_weights():
    """peri-norm adds 2 * d_model weights per layer, the embedding norm d_model, to active and total
    alike (t001: 16 layers at d_model 2048)."""
    t001 = get_preset("olmoe3-t001")
    plain = param_counts(t001.replace(norm_placement="reordered", embedding_norm=False, embedding_scale=None))
    counts = param_counts(t001)
    assert counts.total - plain.total == counts.active - plain.active == 2048 * (2 * 16 + 1)


def test_t001_flops_per_token_by_hand():
    """Training FLOPs per token of olmoe3-t001 at sequence 8192, each term written out: 6 FLOPs
    per weight a token multiplies through (2 forward, 4 backward), attention scores and the
    weighted sum 12 * heads * head_dim per key seen. t001 has no sliding window, so a query sees
    (8192 + 1) / 2 keys on average on every layer."""
    d, q, kv, heads, head_dim = 2048, 16 * 128, 4 * 128, 16, 128
    experts, top_k, hidden, shared, dense_hidden, vocab = 64, 4, 2048, 2048, 4 * 2048 + 2048, 100_352
    projections = 6 * (d * q + 2 * d * kv + q * d)
    scores = 12 * heads * head_dim * (8192 + 1) / 2
    router = 6 * d * experts
    routed = 6 * top_k * 3 * d * hidden
    shared_expert = 6 * 3 * d * shared
    dense_mlp = 6 * 3 * d * dense_hidden
    head = 6 * d * vocab
    by_hand = 16 * (projections + scores) + 15 * (router + routed + shared_expert) + dense_mlp + head
    assert by_hand == 9_902_161_920
    t001 = get_preset("olmoe3-t001")
    assert flops_per_token(t001, 8192) == by_hand
    # With Olmo 3's window (4096 on 3 of every 4 layers) a sliding query sees min(p + 1, 4096) keys:
    # (4096 * 4097 / 2 + (8192 - 4096) * 4096) / 8192 on average, on 12 of the 16 layers.
    sliding_keys = (4096 * 4097 / 2 + (8192 - 4096) * 4096) / 8192
    windowed = by_hand - 12 * 12 * heads * head_dim * ((8192 + 1) / 2 - sliding_keys)
    assert flops_per_token(t001.replace(sliding_window=4096), 8192) == windowed


@pytest.mark.parametrize("experts", [8, 32, 64, 128])
def test_benchmark_flops_per_token_match_its_own_formula(experts):
    """moe_8l_common.benchmark_num_flops_per_token, the FLOPs per token behind the benchmark's
    tokens/s and MFU, restated: layer 0 dense (18 * d * dense hidden), seven MoE layers (router
    6 * d * E, top-k experts and the shared one 18 * d * hidden each), projections 6x their
    weights, causal attention over S(S+1)/2 query-key pairs per sequence, head 6 * d * vocab."""
    d, width, kv_heads, heads, head_dim, layers, seq, vocab = 4096, 4096, 8, 32, 128, 8, 8192, 100_352
    projections = 6 * (d * width + 2 * d * kv_heads * head_dim + width * d)
    attention = projections + 12 * heads * head_dim * (seq * (seq + 1) // 2) // seq
    theirs = attention + 18 * d * (4 * 4096 + 4096)
    theirs += (layers - 1) * (attention + 6 * d * experts + 18 * d * 4096 * 4 + 18 * d * 4096)
    theirs += 6 * d * vocab
    assert flops_per_token(get_preset(f"olmoe3-bench-e{experts}"), seq) == theirs


def test_presets_carry_the_scripts_router_and_layer_stack():
    u001 = get_preset("olmoe3-u001")
    assert u001.moe is not None
    assert (u001.d_model, u001.n_layers, u001.n_heads, u001.kv_heads, u001.head_dim) == (6144, 63, 64, 32, 128)
    assert u001.q_width == 8192 != u001.d_model
    assert u001.mlp_hidden == 4 * 8192 + 8192 and u001.moe.layers == tuple(range(2, 63))
    assert (u001.moe.gating, u001.moe.normalize_top_k, u001.moe.restore_weight_scale) == ("softmax", True, True)
    assert (u001.moe.load_balancing_loss_weight, u001.moe.router_z_loss_weight) == (0.005, 2e-4)
    assert u001.qk_norm == "per_head" and u001.sliding_window is None and u001.rope_theta == 500_000
    assert (u001.vocab_size, u001.padded_vocab_size) == (100_278, 100_352)
    bench = get_preset("olmoe3-bench-e128")
    assert bench.moe is not None
    assert (bench.moe.load_balancing_loss_weight, bench.moe.router_z_loss_weight) == (0.015, 1e-4)


def test_tiny_olmoe3_is_t001_at_test_size():
    """Every architectural choice of olmoe3-t001 kept; only widths, expert count and vocab shrink."""
    tiny, t001 = get_preset("tiny-olmoe3"), get_preset("olmoe3-t001")
    assert tiny.moe is not None and t001.moe is not None
    same = (
        "qk_norm",
        "norm_placement",
        "sliding_window",
        "rope_theta",
        "yarn",
        "norm_eps",
        "init_std",
        "z_loss_weight",
    )
    assert {f: getattr(tiny, f) for f in same} == {f: getattr(t001, f) for f in same}
    router = ("top_k", "n_shared_experts", "gating", "normalize_top_k", "restore_weight_scale")
    router += ("load_balancing_loss_weight", "router_z_loss_weight")
    assert {f: getattr(tiny.moe, f) for f in router} == {f: getattr(t001.moe, f) for f in router}
    assert tiny.n_heads // tiny.kv_heads == t001.n_heads // t001.kv_heads == 4  # GQA 4:1
    assert tiny.moe.layers == tuple(range(1, tiny.n_layers))  # one dense leading block, as t001
    assert tiny.mlp_hidden == tiny.moe.top_k * tiny.moe.expert_hidden + tiny.moe.shared_hidden
    assert tiny.moe.shared_hidden == tiny.moe.expert_hidden
    assert (tiny.vocab_size, tiny.d_model) == (4096, 64)


def test_head_dim_is_derived_unless_given():
    """head_dim omitted is d_model / n_heads (and follows a change of either); given, it stays and
    d_model need not divide by n_heads (OLMoE3-dev-s001: 24 heads of 128 at d_model 2560)."""
    tiny = get_preset("tiny")
    assert tiny.head_dim == 16 and tiny.replace(n_heads=8).head_dim == 8
    s001 = get_preset("olmoe3-s001")
    assert (s001.head_dim, s001.q_width, s001.kv_width) == (128, 3072, 768)
    assert s001.replace(d_model=2048).head_dim == 128
    with pytest.raises(SpecError, match=r"n_heads=24 does not divide d_model=2560; .* or set head_dim"):
        spec_from_dict({"d_model": 2560, "n_heads": 24})


def test_cli_lists_and_describes_the_presets(capsys):
    """`olmo-model presets` shows experts (routed x top-k + shared), dense leading layers and
    active / total parameters in full, however narrow the terminal; describe adds the short forms."""
    assert cli.main(["presets"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "│" in line}
    u001 = [cell.strip() for cell in rows["olmoe3-u001"].split("│")[1:-1]]
    assert u001 == ["olmoe3-u001", "6144", "63", "64/32", "128", "40960", "128x4+1", "2", "58.36B/1.200T"]
    assert [c.strip() for c in rows["olmo3-7b"].split("│")[7:9]] == ["-", "-"]
    assert cli.main(["describe", "olmoe3-t001"]) == 0
    out = capsys.readouterr().out
    assert "12,912,173,056 (12.91B)" in out and "1,587,552,256 (1.59B)" in out
