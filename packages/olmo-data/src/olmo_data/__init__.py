"""olmo_data: token storage, mixtures, the deterministic global data order, the Grain
loader and held-out leakage checks. numpy only: no torch or jax import here."""

from olmo_data.errors import DataError, ShardCorruptError
from olmo_data.fileio import StorageError
from olmo_data.leakage import LeakageError, LeakageReport, assert_no_leakage, check_leakage, open_training_mixture
from olmo_data.loader import MixtureLoader
from olmo_data.mixture import Mixture, load_mixture
from olmo_data.order import RepetitionLimitError
from olmo_data.storage import open_source

__all__ = [
    "DataError",
    "LeakageError",
    "LeakageReport",
    "Mixture",
    "MixtureLoader",
    "RepetitionLimitError",
    "ShardCorruptError",
    "StorageError",
    "assert_no_leakage",
    "check_leakage",
    "load_mixture",
    "open_source",
    "open_training_mixture",
]
