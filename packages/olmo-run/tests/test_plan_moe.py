"""olmo-plan's count of a mixture-of-experts model's state on one host of 8 ranks, by hand.

small-moe-64 (olmo_model's preset: 4 layers, d_model 128, 4 heads of 32 with as many K/V heads,
64 routed experts of hidden 64 and one shared expert of hidden 64, vocabulary 4096, untied head):

- embedding and output head: 2 x 4096 x 128 = 1,048,576;
- per layer: attention 4 x 128 x 128 = 65,536, norms (attention, MLP, q, k) 4 x 128 = 512, router
  64 x 128 = 8,192, shared expert 3 x 128 x 64 = 24,576, routed experts 64 x 3 x 128 x 64 = 1,572,864;
- final norm 128.

Total 1,048,576 + 4 x 1,671,680 + 128 = 7,735,424, of which the routed experts are
4 x 1,572,864 = 6,291,456 and the dense rest 1,443,968. State is 16 bytes per parameter held
(fp32 weight, fp32 gradient, two fp32 AdamW moments), no accumulation here (8 x 8192 tokens).
"""

import json
from pathlib import Path

from olmo_model import get_preset, param_counts
from olmo_run.plan import main as plan_main
from olmo_run.plan_moe import gathered_block_params, rows_per_assignment, torch_activation_bytes, torch_block_values
from olmo_run.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[3]
STAGE1 = ROOT / "recipes" / "olmo3-7b" / "stage1.yaml"
ROUTED = 6_291_456
DENSE = 1_443_968
ARGS = ["--model=small-moe-64", "--train.global_batch_tokens=65536", "--devices", "h100:8"]


def _plan(capsys, *args: str) -> dict:
    rc = plan_main([str(STAGE1), *ARGS, *args, "--json"])
    assert rc == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_hand_count_of_small_moe_64_is_olmo_models():
    counts = param_counts(get_preset("small-moe-64"))
    assert counts.total == DENSE + ROUTED == 7_735_424
    assert counts.embedding == 1_048_576


def test_torch_keeps_e_over_ep_experts_per_rank_and_shards_the_dense_rest_over_fsdp(capsys):
    """torch FSDP on 8 ranks: the dense weights over all 8 (1,443,968 / 8 = 180,496 each), the
    experts over the expert-parallel group only, replicated over the 8 / EP expert-data-parallel
    ranks: EP 2 holds 6,291,456 / 2 = 3,145,728 expert parameters per rank, EP 8 786,432."""
    ep2 = _plan(capsys, "--torch.expert_parallel=2", "--torch.activation_checkpointing=false")
    ep8 = _plan(capsys, "--torch.expert_parallel=8", "--torch.activation_checkpointing=false")
    assert ep2["memory_state_gib"] * 2**30 == 16 * (180_496 + 3_145_728) == 53_219_584
    assert ep8["memory_state_gib"] * 2**30 == 16 * (180_496 + 786_432) == 15_470_848
    # The data-parallel size is the world either way; FSDP's group is all 8 ranks.
    assert (ep2["dp_size"], ep2["shard_group"]) == (ep8["dp_size"], ep8["shard_group"]) == (8, 8)
    # FSDP gathers a block's dense weights only, two blocks in bf16: (7,735,424 - 1,048,576 embedding
    # - 6,291,456 experts) / 4 layers = 98,848 parameters (the head's share included), x 2 x 2 bytes.
    assert ep8["memory_gathered_weights_gib"] * 2**30 == 98_848 * 2 * 2 == 395_392


def test_torch_ddp_replicates_the_dense_weights_and_still_splits_the_experts(capsys):
    """DDP on 8 ranks, EP 8: every rank holds all 1,443,968 dense parameters and 786,432 experts."""
    ddp = _plan(capsys, "--torch.parallel=ddp", "--torch.expert_parallel=8", "--torch.activation_checkpointing=false")
    assert ddp["memory_state_gib"] * 2**30 == 16 * (1_443_968 + 786_432) == 35_686_400
    assert ddp["memory_gathered_weights_gib"] == 0


def test_jax_splits_the_experts_over_expert_and_fsdp_and_the_dense_weights_over_fsdp(capsys):
    """The JAX trainer places a routed-expert weight [L, E, ...] on the expert axis and then splits
    its largest other axis over fsdp (olmo_train_jax.parallelize.param_partition_spec); dense
    weights over fsdp only, replicated over the expert axis, which carries data like ``data``:
    expert 2 x fsdp 4 holds 1,443,968 / 4 + 6,291,456 / 8 = 360,992 + 786,432 parameters, expert
    8 x fsdp 1 all the dense ones and 786,432 experts; the data-parallel size is 8 in both."""
    jax = ("--framework", "jax", "--jax.remat=block", "--jax.mesh.data=1")
    e2 = _plan(capsys, *jax, "--jax.mesh.expert=2", "--jax.mesh.fsdp=-1")
    e8 = _plan(capsys, *jax, "--jax.mesh.expert=8", "--jax.mesh.fsdp=1")
    assert e2["memory_state_gib"] * 2**30 == 16 * (360_992 + 786_432) == 18_358_784
    assert e8["memory_state_gib"] * 2**30 == 16 * (1_443_968 + 786_432) == 35_686_400
    assert (e2["dp_size"], e2["shard_group"]) == (8, 4)
    assert (e8["dp_size"], e8["shard_group"]) == (8, 1)


RECIPES = ROOT / "recipes" / "olmoe3"


def test_capacity_buffer_rows_per_assignment_of_the_olmoe3_recipes():
    """rho = E C / (S k), C = ceil(factor x S k / E): s001 (64 experts, 1.1875) C = ceil(1.1875 x
    8192 x 4 / 64) = 608, rho = 64 x 608 / 32768 = 1.1875; the benchmark at 128 experts (1.25)
    C = 320, rho = 1.25; t001 (no capacity factor) is dropless."""
    rho = {}
    for name in ("s001", "bench-e128", "t001"):
        recipe = load_recipe(RECIPES / f"{name}.yaml", [])
        rho[name] = rows_per_assignment(recipe.model_spec(), recipe, 8192)
    assert rho == {"s001": 64 * 608 / 32768, "bench-e128": 128 * 320 / 32768, "t001": None}


def test_torch_block_values_of_olmoe3_t001_by_hand():
    """t001: d 2048, q 16 x 128 = 2048, kv 4 x 128 = 512, peri-norm (four RMSNorms a block), the
    dense leading block's hidden 4 x 2048 + 2048 = 10240, top-4 of 64 experts of 2048, one shared
    expert of 2048. Dense: 18 d + 6 q + 6 kv + 4 ff = 36,864 + 12,288 + 3,072 + 40,960 = 93,184;
    MoE, dropless: 52,224 + 4 (3 d + 4 h) = 57,344 + 4 h_shared + 2 d = 12,288 + 4 E = 256, 122,112;
    at rho 1.25: 52,224 + 1.25 x 4 (d + 4 h) = 51,200 + k d = 8,192 + 12,288 + 256 = 124,160."""
    spec = get_preset("olmoe3-t001")
    assert spec.norm_placement == "peri" and not spec.is_moe_layer(0) and spec.is_moe_layer(1)
    assert torch_block_values(spec, 0) == 93_184
    assert torch_block_values(spec, 1) == 122_112
    assert torch_block_values(spec, 1, 1.25) == 124_160


def test_torch_expert_parallel_keeps_each_moe_layers_bf16_expert_copy():
    """The benchmark at 128 experts, EP 8 under FSDP2 in bf16: each of its 7 MoE layers keeps the
    bf16 copy of its 16 local experts for the backward, 2 x 3 x 4096 x 4096 x 16 = 1,610,612,736
    bytes, 11,274,289,152 in all, on top of the per-token activations."""
    recipe = load_recipe(RECIPES / "bench-e128.yaml", ["--torch.parallel=fsdp", "--optim.sharded=false"])
    spec, tokens = recipe.model_spec(), 2 * 8192
    per_token = 2 * sum(torch_block_values(spec, i, 1.25) for i in range(8))
    acts = torch_activation_bytes(recipe, spec, "none", tokens, 8192)
    assert acts - tokens * per_token == 7 * 2 * 3 * 4096 * 4096 * 16 == 11_274_289_152
    # With activation checkpointing only the recomputed layer's copy is alive.
    acts_block = torch_activation_bytes(recipe, spec, "block", tokens, 8192)
    largest = max(torch_block_values(spec, i, 1.25) for i in range(8))
    assert acts_block - tokens * 2 * (8 * 4096 + largest) == 1_610_612_736


def test_jax_gathers_one_block_of_experts_over_fsdp_only():
    """The benchmark at 128 experts on a JAX mesh expert 8 x fsdp: 46,862,510,080 parameters, of which
    the embedding and head 2 x 100352 x 4096 = 822,083,584 and the routed experts 7 x 128 x 3 x
    4096^2 = 45,097,156,608; a gather over fsdp brings 1/8 of a block's experts: (943,269,888 +
    45,097,156,608 / 8) / 8 layers = 822,551,808 parameters; torch at EP 8 gathers none of them."""
    recipe = load_recipe(RECIPES / "bench-e128.yaml", [])
    spec = recipe.model_spec()
    assert param_counts(spec).total == 46_862_510_080
    assert gathered_block_params(recipe, spec, "jax") == 822_551_808
    assert gathered_block_params(recipe, spec, "torch") == 943_269_888 / 8
