"""Guards against running a stateful stream once per torch DataLoader worker, without
importing torch (olmo-data does not depend on it)."""

from __future__ import annotations

import sys

from olmo_data.errors import DataError


def refuse_dataloader_replay(where: str) -> None:
    """DataError if called inside one of several torch DataLoader worker processes.

    Each worker holds its own copy of an iterable dataset and iterates it from the start,
    so a MixtureLoader iterated there would hand out every batch once per worker. torch is
    looked up in sys.modules only: a process that never imported torch.utils.data is no
    DataLoader worker, and this check must not import torch where it is not installed."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    if info is not None and info.num_workers > 1:
        raise DataError(
            f"{where}: MixtureLoader iterated in DataLoader worker {info.id} of {info.num_workers}, where every worker "
            "would replay the whole stream; wrap it in olmo_data.torch_data.MixtureDataset (map-style over "
            "batch_at, correct with workers) or use num_workers=0"
        )
