"""A torch map-style `Dataset` over `MixtureLoader.batch_at`, for torch training code that
wants a `DataLoader` with worker processes. Imports torch, which olmo-data itself does not
depend on: import this module only where torch is installed.

    from olmo_data import MixtureLoader
    from olmo_data.torch_data import MixtureDataLoader, MixtureDataset

    loader = MixtureLoader("mixture.yaml", global_batch_size=64, dp_rank=rank, dp_size=world)
    loader.load_state_dict(saved)  # when resuming
    batches = MixtureDataLoader(MixtureDataset(loader, num_steps=1000), num_workers=2)
    for batch in batches:
        ...  # loader.state_dict() is the state after the batches received so far

Item i is this rank's rows of global batch `start_step + i`, a whole batch: so
`batch_size=None` (no automatic batching). A DataLoader hands each index of the default
sequential sampler to one worker and yields the results in index order, and `batch_at` is a
pure function of the step, so any number of workers yields the single-process order. (The
`MixtureLoader` iterator itself refuses to run in several workers: each would replay it.)

Checkpointing: a DataLoader's workers read ahead of the training loop, and the loader (or
the dataset) in the main process never sees which batches the loop received, so with a plain
`DataLoader` over `MixtureDataset`, `loader.state_dict()` refuses (DataError) instead of
returning a stale step. `MixtureDataLoader` is the DataLoader that knows: each item comes
back with its step, and as the loop receives batch s the loader's step becomes s + 1 (as
torchdata's StatefulDataLoader counts what it yielded). With another DataLoader, save
`loader.state_at(<step of the next batch to train on>)`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

try:
    import torch
    from torch.utils.data import DataLoader, Dataset, Sampler
except ImportError:
    raise ImportError("olmo_data.torch_data needs torch; install torch (olmo-data itself does not)") from None

from olmo_data.errors import DataError
from olmo_data.loader import MixtureLoader


class MixtureDataset(Dataset):
    """Map-style: item i = `loader.batch_at(start_step + i)` as int32 torch tensors
    input_ids, labels, doc_ids, positions [rows, sequence_length], for i in [0, num_steps).

    `start_step` defaults to the loader's step, so after `loader.load_state_dict(state)`
    the dataset continues where the checkpoint stopped. Batches depend only on the step
    (never on which worker reads them), so keep the sequential sampler: a shuffling sampler
    would reorder the data order that resume and every dp size rely on.

    From here on `loader.state_dict()` raises (the loader cannot see what a DataLoader's
    consumer received) until a `MixtureDataLoader` over this dataset keeps it up to date."""

    def __init__(self, loader: MixtureLoader, num_steps: int, start_step: int | None = None) -> None:
        if num_steps < 0:
            raise ValueError(f"MixtureDataset: num_steps must be >= 0, got {num_steps}")
        self.loader = loader
        self.num_steps = num_steps
        self.start_step = loader.step if start_step is None else start_step
        if self.start_step < 0:
            raise ValueError(f"MixtureDataset: start_step must be >= 0, got {self.start_step}")
        loader._state_unknown = (
            "cannot know how many batches a DataLoader over MixtureDataset handed to training (its workers read "
            "ahead); iterate olmo_data.torch_data.MixtureDataLoader(dataset, num_workers=...) instead, or save "
            "loader.state_at(<step of the next batch to train on>)"
        )

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self.num_steps:
            raise IndexError(f"MixtureDataset: index {index} outside [0, {self.num_steps})")
        batch = self.loader.batch_at(self.start_step + index)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


class _Stepped(Dataset):
    """Item i of a MixtureDataset as (its global step, the batch): the step travels back from
    the worker with the batch, so the main process learns which batch it received."""

    def __init__(self, dataset: MixtureDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, dict[str, torch.Tensor]]:
        return self.dataset.start_step + int(index), self.dataset[index]


class _FromLoaderStep(Sampler[int]):
    """Indices from the loader's step (what the consumer has received) to the dataset's end,
    read each time iteration starts, in the main process: iterating again continues after the
    last batch received, and a `loader.load_state_dict` before it moves the start."""

    def __init__(self, dataset: MixtureDataset) -> None:
        self.dataset = dataset

    def _first(self) -> int:
        d = self.dataset
        first = d.loader.step - d.start_step
        if not 0 <= first <= d.num_steps:
            raise DataError(
                f"{d.loader.mixture.path}: the loader is at step {d.loader.step}, outside this MixtureDataset's steps "
                f"[{d.start_step}, {d.start_step + d.num_steps}]; build MixtureDataset(loader, ...) after "
                "load_state_dict so it starts at the loader's step"
            )
        return first

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._first(), self.dataset.num_steps))

    def __len__(self) -> int:
        return self.dataset.num_steps - self._first()


class MixtureDataLoader(DataLoader):
    """A torch `DataLoader` over a `MixtureDataset` that keeps `loader.step` equal to the
    batches the training loop has received, so `loader.state_dict()` is the state to save and
    `load_state_dict` of it (any process, any workers) continues at the next batch.

    Each item comes back from its worker with its step, and the step must be the loader's:
    as the loop receives batch s, the loader's step becomes s + 1. Every DataLoader option may
    be passed (num_workers, pin_memory, persistent_workers, ...) except those that would change
    the order or the batching, which this class sets itself. Iterating again continues after
    the last batch received, never from the dataset's start."""

    _FIXED = ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn", "drop_last", "in_order")

    def __init__(self, dataset: MixtureDataset, **kwargs: Any) -> None:
        fixed = sorted(set(self._FIXED) & set(kwargs))
        if fixed:
            raise ValueError(
                f"MixtureDataLoader sets {fixed} itself (whole batches in step order, each checked against the "
                "loader's step); drop them"
            )
        if not isinstance(dataset, MixtureDataset):
            raise TypeError(f"MixtureDataLoader reads a MixtureDataset, got {type(dataset).__name__}")
        self.mixture_dataset = dataset
        self.loader = dataset.loader
        super().__init__(_Stepped(dataset), batch_size=None, sampler=_FromLoaderStep(dataset), **kwargs)
        self.loader._state_unknown = None  # this DataLoader keeps loader.step up to date

    def __iter__(self) -> Generator[dict[str, torch.Tensor], None, None]:  # type: ignore[override]
        return self._received(super().__iter__())

    def _received(
        self, items: Iterator[tuple[int, dict[str, torch.Tensor]]]
    ) -> Generator[dict[str, torch.Tensor], None, None]:
        for step, batch in items:
            if step != self.loader.step:
                raise DataError(
                    f"{self.loader.mixture.path}: MixtureDataLoader received global batch {step} while the loader "
                    f"expected {self.loader.step}; do not change loader.step (load_state_dict) while iterating"
                )
            self.loader.step = step + 1
            yield batch
