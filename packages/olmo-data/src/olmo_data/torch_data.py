"""A torch map-style `Dataset` over `MixtureLoader.batch_at`, for torch training code that
wants a `DataLoader` with worker processes. Imports torch, which olmo-data itself does not
depend on: import this module only where torch is installed.

    from torch.utils.data import DataLoader
    from olmo_data import MixtureLoader
    from olmo_data.torch_data import MixtureDataset

    loader = MixtureLoader("mixture.yaml", global_batch_size=64, dp_rank=rank, dp_size=world)
    batches = DataLoader(MixtureDataset(loader, num_steps=1000), batch_size=None, num_workers=2)

Item i is this rank's rows of global batch `start_step + i`, a whole batch: so
`batch_size=None` (no automatic batching). A DataLoader hands each index of the default
sequential sampler to one worker and yields the results in index order, and `batch_at` is a
pure function of the step, so any number of workers yields the single-process order. (The
`MixtureLoader` iterator itself refuses to run in several workers: each would replay it.)
"""

from __future__ import annotations

import numpy as np

try:
    import torch
    from torch.utils.data import Dataset
except ImportError:
    raise ImportError("olmo_data.torch_data needs torch; install torch (olmo-data itself does not)") from None

from olmo_data.loader import MixtureLoader


class MixtureDataset(Dataset):
    """Map-style: item i = `loader.batch_at(start_step + i)` as int32 torch tensors
    input_ids, labels, doc_ids, positions [rows, sequence_length], for i in [0, num_steps).

    `start_step` defaults to the loader's step, so after `loader.load_state_dict(state)`
    the dataset continues where the checkpoint stopped. Batches depend only on the step
    (never on which worker reads them), so keep the sequential sampler: a shuffling sampler
    would reorder the data order that resume and every dp size rely on."""

    def __init__(self, loader: MixtureLoader, num_steps: int, start_step: int | None = None) -> None:
        if num_steps < 0:
            raise ValueError(f"MixtureDataset: num_steps must be >= 0, got {num_steps}")
        self.loader = loader
        self.num_steps = num_steps
        self.start_step = loader.step if start_step is None else start_step
        if self.start_step < 0:
            raise ValueError(f"MixtureDataset: start_step must be >= 0, got {self.start_step}")

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self.num_steps:
            raise IndexError(f"MixtureDataset: index {index} outside [0, {self.num_steps})")
        batch = self.loader.batch_at(self.start_step + index)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
