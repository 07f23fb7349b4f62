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
