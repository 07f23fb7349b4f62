"""``python -m olmo_train_torch [RECIPE.yaml] [--key=value ...]`` (also under torchrun)."""

from .cli import main

raise SystemExit(main())
