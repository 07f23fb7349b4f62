"""The torch adapter: a DataLoader with 2 worker processes over MixtureDataset yields exactly
the single-process order (batch_at step by step), also after a resume; the MixtureLoader
iterator inside 2 workers refuses with a one-line DataError instead of replaying the stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_mixture_support import two_source_mixture
from torch.utils.data import DataLoader, IterableDataset

from olmo_data import DataError, MixtureLoader, load_mixture
from olmo_data.order import BATCH_KEYS
from olmo_data.torch_data import MixtureDataset

STEPS = 6


@pytest.fixture
def loader(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    return MixtureLoader(load_mixture(two_source_mixture(tmp_path)), global_batch_size=8, dp_rank=1, dp_size=2)


def test_two_workers_yield_the_single_process_order(loader):
    # The reference: this rank's rows of each step, in this process, through the loader's own iterator.
    it = iter(MixtureLoader(loader.mixture, 8, dp_rank=1, dp_size=2, prefetch=0))
    expected = [next(it) for _ in range(STEPS)]
    it.close()
    got = list(DataLoader(MixtureDataset(loader, STEPS), batch_size=None, num_workers=2))
    assert len(got) == STEPS
    for step, (batch, ref) in enumerate(zip(got, expected)):
        assert set(batch) == set(BATCH_KEYS)
        for k in BATCH_KEYS:
            assert batch[k].dtype == torch.int32 and batch[k].shape == (4, 16), (step, k)
            np.testing.assert_array_equal(batch[k].numpy(), ref[k], err_msg=f"step {step} {k}")
    # The steps differ from one another, so an order mix-up could not pass unseen.
    assert len({got[s]["input_ids"].numpy().tobytes() for s in range(STEPS)}) == STEPS


def test_resume_continues_at_the_checkpointed_step(loader):
    state = {**loader.state_dict(), "step": 4, "tokens_consumed": 4 * loader.tokens_per_global_batch}
    resumed = MixtureLoader(loader.mixture, 8, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    got = list(DataLoader(MixtureDataset(resumed, 2), batch_size=None, num_workers=2))
    for i, batch in enumerate(got):
        np.testing.assert_array_equal(batch["input_ids"].numpy(), loader.batch_at(4 + i)["input_ids"])
    with pytest.raises(IndexError):
        MixtureDataset(resumed, 2)[2]


class _Stream(IterableDataset):
    """What a user writes to put the iterator behind a DataLoader."""

    def __init__(self, loader: MixtureLoader) -> None:
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


class _Refusals(_Stream):
    """Each worker tries the iterator and hands back the error it got. (Letting the error
    reach the DataLoader would show the same line, wrapped in torch's traceback text, but
    torch then takes ~10 s to shut the failed workers down.)"""

    def __iter__(self):
        try:
            next(super().__iter__())
        except DataError as e:
            yield str(e)


def test_the_iterator_refuses_to_run_in_two_workers(loader):
    messages = sorted(DataLoader(_Refusals(loader), batch_size=None, num_workers=2))
    assert len(messages) == 2  # one per worker: neither read a batch
    for worker, message in enumerate(messages):
        assert "\n" not in message
        assert message == (
            f"{loader.mixture.path}: MixtureLoader iterated in DataLoader worker {worker} of 2, where every worker "
            "would replay the whole stream; wrap it in olmo_data.torch_data.MixtureDataset (map-style over "
            "batch_at, correct with workers) or use num_workers=0"
        )


def test_the_iterator_still_runs_in_one_worker(loader):
    # One worker replays nothing: it is the only reader, in order.
    batches = DataLoader(_Stream(loader), batch_size=None, num_workers=1)
    for step, batch in zip(range(2), batches):
        np.testing.assert_array_equal(batch["input_ids"].numpy(), loader.batch_at(step)["input_ids"])
