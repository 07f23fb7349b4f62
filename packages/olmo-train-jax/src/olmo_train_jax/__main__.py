"""``python -m olmo_train_jax [RECIPE.yaml] [--key=value ...]``: the same as ``olmo-train-jax``."""

from .cli import main

raise SystemExit(main())
