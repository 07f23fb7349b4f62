"""olmo_train_jax: the Olmo 3 model in JAX / Flax NNX and its sharded trainer (``olmo-train-jax``)."""

from .hf_adapter import CheckpointMismatchError, load_hf, model_from_hf, to_hf
from .model import OlmoModel, build_model

__all__ = ["CheckpointMismatchError", "OlmoModel", "build_model", "load_hf", "model_from_hf", "to_hf"]

__version__ = "0.1.0"
