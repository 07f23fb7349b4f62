"""olmo_data: token storage, mixtures, the deterministic global data order, the Grain
loader and held-out leakage checks. numpy only: no torch or jax import here (the torch
`Dataset` adapter is the separate module `olmo_data.torch_data`).

The Python API in short (the package README has a quick start): `tokenize` text into token
files, `load_mixture` a mixture YAML (its `training_sources`, `held_out_sources`,
`sequence_length`, `fingerprint()`), iterate a `MixtureLoader` (`batch_at(step)`,
`state_dict()` / `load_state_dict()`, `eval_batches()`), and below it `open_source`,
`read_instances` (the batch arrays of any windows of a source), `eval_instances` and
`ShardWriter`."""

import olmo_data._grain  # noqa: F401  (first: imports grain without its jax-profiler warning)
from olmo_data.errors import DataError, ShardCorruptError
from olmo_data.fileio import StorageError
from olmo_data.leakage import LeakageError, LeakageReport, assert_no_leakage, check_leakage, open_training_mixture
from olmo_data.loader import MixtureLoader, eval_instances
from olmo_data.mixture import Mixture, load_mixture
from olmo_data.order import RepetitionLimitError, read_instances
from olmo_data.shards import ShardWriter
from olmo_data.sources import open_source

# The function, bound after its module: `olmo_data.tokenize(...)` tokenizes, while
# `from olmo_data.tokenize import ...` still finds the module in sys.modules.
from olmo_data.tokenize import tokenize

__all__ = [
    "DataError",
    "LeakageError",
    "LeakageReport",
    "Mixture",
    "MixtureLoader",
    "RepetitionLimitError",
    "ShardCorruptError",
    "ShardWriter",
    "StorageError",
    "assert_no_leakage",
    "check_leakage",
    "eval_instances",
    "load_mixture",
    "open_source",
    "open_training_mixture",
    "read_instances",
    "tokenize",
]
