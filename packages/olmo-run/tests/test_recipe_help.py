"""``--help``'s list of recipe keys: every key it names is one an override accepts, its default is
the default recipe's value, and every key says what it means (the comment beside the field)."""

from __future__ import annotations

import json

from olmo_run.recipe import Recipe, load_recipe
from olmo_run.recipe_help import recipe_help, recipe_keys


def _get(recipe: Recipe, dotted: str):
    node = recipe.model_dump(mode="json")
    for key in dotted.split("."):
        node = node[key]
    return node


def test_every_listed_key_overrides_to_its_default_and_round_trips():
    default = Recipe().model_dump(mode="json")
    keys = recipe_keys()
    assert len(keys) > 40
    for k in keys:
        value = k.default if isinstance(k.default, str) else json.dumps(k.default)
        recipe = load_recipe(None, [f"--{k.key}={value}"])
        assert recipe.model_dump(mode="json") == default, k.key
        assert _get(recipe, k.key) == k.default


def test_every_key_is_listed_once_and_says_what_it_means():
    keys = recipe_keys()
    names = [k.key for k in keys]
    assert len(names) == len(set(names))
    # Every section field of the schema appears (spot checks across sections and depths).
    for name in ("optim.lr", "train.global_batch_tokens", "schedule.warmup_steps", "jax.mesh", "torch.parallel"):
        assert name in names
    missing = [k.key for k in keys if not k.comment]
    assert missing == [], f"recipe keys without a comment in recipe.py: {missing}"
    text = recipe_help()
    assert "--optim.lr=0.003  (float)  peak LR" in text
    assert '--jax.mesh={"data": -1, "fsdp": 1, "tensor": 1}' in text
