"""olmo_train_torch: the Olmo 3 model and trainer in PyTorch."""

from .hf_adapter import CheckpointMismatchError, load_hf, model_from_hf, to_hf
from .model import OlmoModel, build_model

__all__ = ["CheckpointMismatchError", "OlmoModel", "build_model", "load_hf", "model_from_hf", "to_hf"]
