"""AdamW decay groups by parameter name: both trainers' real names, sorted by hand."""

import pytest

from olmo_run.decay import DECAY_GROUPS, decay_group, group_weight_decay
from olmo_run.recipe import load_recipe

# (name, group): torch named_parameters() names and JAX state paths joined by dots.
NAMES = [
    ("embed.weight", "embedding"),
    ("embed", "embedding"),
    ("blocks.0.attn.q_proj.weight", "matrices"),
    ("blocks.0.attn.q_norm.weight", "norms"),
    ("blocks.3.attn_norm.weight", "norms"),
    ("blocks.3.mlp_norm.weight", "norms"),
    ("final_norm.weight", "norms"),
    ("lm_head.weight", "matrices"),
    ("blocks.1.mlp.router.weight", "matrices"),
    ("blocks.1.mlp.experts.gate_proj", "experts"),
    ("blocks.1.mlp.shared_experts.0.up_proj.weight", "matrices"),
    ("layers.k_norm.value", "norms"),
    ("layers.expert_down_proj.value", "experts"),
    ("layers.shared_down_proj.value", "matrices"),
    ("layers.router.value", "matrices"),
    ("final_norm", "norms"),
    ("lm_head", "matrices"),
]


@pytest.mark.parametrize(("name", "group"), NAMES)
def test_each_name_has_its_group(name, group):
    assert decay_group(name) == group


def test_group_decays_follow_the_recipe():
    default = load_recipe(None, []).optim  # Olmo 3: no decay on the embedding, norms decay
    assert {g: group_weight_decay(g, default) for g in DECAY_GROUPS} == {
        "matrices": default.weight_decay,
        "experts": default.weight_decay,
        "embedding": 0.0,
        "norms": default.weight_decay,
    }
    flipped = load_recipe(None, ["--optim.decay_embeddings=true", "--optim.decay_norms=false"]).optim
    assert group_weight_decay("embedding", flipped) == flipped.weight_decay > 0
    assert group_weight_decay("norms", flipped) == 0.0
    with pytest.raises(ValueError, match="unknown decay group"):
        group_weight_decay("biases", default)
