"""olmo_train_torch: the Olmo 3 model and trainer in PyTorch."""

from .hf_adapter import CheckpointMismatchError, initial_model, load_hf, model_from_hf, to_hf
from .model import OlmoModel

__all__ = ["CheckpointMismatchError", "OlmoModel", "initial_model", "load_hf", "model_from_hf", "to_hf"]
