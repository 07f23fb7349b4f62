"""Checkpointing the map-style path: a torch DataLoader with 2 worker processes over
MixtureDataset, iterated through MixtureDataLoader, saves the state of the batches the loop
received and a NEW process resumes at exactly the next batch; a plain DataLoader (whose
workers read ahead unseen) makes loader.state_dict() refuse instead of returning a stale step.
The references are independent of the DataLoader: the MixtureLoader iterator, run in this
process with no prefetch. The README's three checkpointing blocks run here as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_mixture_support import two_source_mixture
from torch.utils.data import DataLoader

from olmo_data import DataError, MixtureLoader, load_mixture
from olmo_data.order import BATCH_KEYS
from olmo_data.torch_data import MixtureDataLoader, MixtureDataset

README = Path(__file__).parents[1] / "README.md"
STEPS = 8  # the run's length
CONSUMED = 5  # batches trained on before the checkpoint


@pytest.fixture
def mixture_path(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMO_CACHE", str(tmp_path / "cache"))
    return two_source_mixture(tmp_path)


def iterator_batches(mixture, count: int, **ranks) -> list[dict[str, np.ndarray]]:
    """The reference: the loader's own iterator in this process, no prefetch threads."""
    it = iter(MixtureLoader(mixture, 8, prefetch=0, **ranks))
    out = [next(it) for _ in range(count)]
    it.close()
    return out


def assert_same(got, ref, what: str) -> None:
    for k in BATCH_KEYS:
        got_k = got[k].numpy() if hasattr(got[k], "numpy") else got[k]
        np.testing.assert_array_equal(got_k, ref[k], err_msg=f"{what} {k}")


RESUME = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from olmo_data import MixtureLoader, load_mixture
    from olmo_data.torch_data import MixtureDataLoader, MixtureDataset

    mixture_path, state_path, steps, out = sys.argv[1:]
    loader = MixtureLoader(load_mixture(mixture_path), 8, dp_rank=1, dp_size=2)
    loader.load_state_dict(json.loads(open(state_path).read()))
    batches = MixtureDataLoader(MixtureDataset(loader, int(steps) - loader.step), num_workers=2)
    got = []
    for batch in batches:
        got.append(batch)
        if len(got) == 2:
            break
    arrays = {f"{i}_{k}": v.numpy() for i, b in enumerate(got) for k, v in b.items()}
    np.savez(out, step=loader.state_dict()["step"], **arrays)
    """
)


def test_two_workers_resume_in_a_new_process_at_the_next_batch(mixture_path, tmp_path):
    mixture = load_mixture(mixture_path)
    reference = iterator_batches(mixture, STEPS, dp_rank=1, dp_size=2)
    # Every batch differs from every other: a replay or a skip could not pass unseen.
    assert len({b["input_ids"].tobytes() for b in reference}) == STEPS

    # An uninterrupted run through MixtureDataLoader with 2 workers: the reference order.
    whole = MixtureLoader(mixture, 8, dp_rank=1, dp_size=2)
    uninterrupted = list(MixtureDataLoader(MixtureDataset(whole, STEPS), num_workers=2))
    assert len(uninterrupted) == STEPS and whole.state_dict()["step"] == STEPS
    for s in range(STEPS):
        assert_same(uninterrupted[s], reference[s], f"uninterrupted step {s}")

    # The interrupted run: train on CONSUMED batches (the workers have read further ahead), save.
    loader = MixtureLoader(mixture, 8, dp_rank=1, dp_size=2)
    received = []
    for batch in MixtureDataLoader(MixtureDataset(loader, STEPS), num_workers=2):
        received.append(batch)
        if len(received) == CONSUMED:
            break
    state = loader.state_dict()
    assert state["step"] == CONSUMED  # the reported bug: 0 here, so the resume replayed from batch 0
    assert state["tokens_consumed"] == CONSUMED * 8 * 16
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(state))

    # Restore in a new process with 2 workers; it takes 2 batches and reports its state.
    out = tmp_path / "resumed.npz"
    subprocess.run(
        [sys.executable, "-c", RESUME, str(mixture_path), str(state_path), str(STEPS), str(out)],
        check=True,
        timeout=120,
    )
    resumed = np.load(out)
    assert int(resumed["step"]) == CONSUMED + 2
    for i in range(2):
        batch = {k: resumed[f"{i}_{k}"] for k in BATCH_KEYS}
        assert_same(batch, reference[CONSUMED + i], f"resumed batch {i} vs iterator step {CONSUMED + i}")
        assert_same(batch, {k: v.numpy() for k, v in uninterrupted[CONSUMED + i].items()}, f"resumed batch {i}")


def test_a_plain_dataloader_makes_state_dict_refuse_not_replay(mixture_path):
    mixture = load_mixture(mixture_path)
    loader = MixtureLoader(mixture, 8, dp_rank=1, dp_size=2)
    batches = iter(DataLoader(MixtureDataset(loader, STEPS), batch_size=None, num_workers=2))
    received = [next(batches) for _ in range(3)]
    with pytest.raises(DataError) as err:
        loader.state_dict()  # the loader is still at step 0: returning that would replay 3 batches
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        f"{mixture.path}: MixtureLoader.state_dict() cannot know how many batches a DataLoader over MixtureDataset "
        "handed to training (its workers read ahead); iterate olmo_data.torch_data.MixtureDataLoader(dataset, "
        "num_workers=...) instead, or save loader.state_at(<step of the next batch to train on>)"
    )
    # The escape the message names: the state at the step the loop counted resumes at the next batch.
    resumed = MixtureLoader(mixture, 8, dp_rank=1, dp_size=2)
    resumed.load_state_dict(loader.state_at(len(received)))
    with_iterator = iter(resumed)
    assert_same(next(batches), next(with_iterator), "state_at(3): plain DataLoader's batch 3 vs resumed iterator")
    with_iterator.close()
    del batches


def test_iterating_again_continues_after_the_last_batch_received(mixture_path):
    mixture = load_mixture(mixture_path)
    reference = iterator_batches(mixture, STEPS)
    loader = MixtureLoader(mixture, 8)
    dataloader = MixtureDataLoader(MixtureDataset(loader, STEPS), num_workers=2, persistent_workers=True)
    got = []
    for batch in dataloader:  # the workers read ahead of this break
        got.append(batch)
        if len(got) == 2:
            break
    assert loader.state_dict()["step"] == 2 and len(dataloader) == STEPS - 2
    got += list(dataloader)  # a second pass: the rest, never the dataset's start again
    assert len(got) == STEPS and loader.state_dict()["step"] == STEPS
    for s in range(STEPS):
        assert_same(got[s], reference[s], f"step {s}")
    assert list(dataloader) == []


def test_options_that_change_the_order_are_refused(mixture_path):
    dataset = MixtureDataset(MixtureLoader(load_mixture(mixture_path), 8), STEPS)
    for option in ({"batch_size": 4}, {"shuffle": True}):
        with pytest.raises(ValueError, match=f"MixtureDataLoader sets \\['{next(iter(option))}'\\] itself"):
            MixtureDataLoader(dataset, **option)


def checkpointing_blocks() -> list[str]:
    section = README.read_text().split("\n## Checkpointing\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "one block per path: iterator, torch DataLoader workers, Grain"
    return blocks


@pytest.mark.parametrize("path", [0, 1, 2], ids=["iterator", "torch-workers", "grain"])
def test_the_readme_blocks_resume_at_the_next_batch(mixture_path, path):
    mixture = load_mixture(mixture_path)
    reference = iterator_batches(mixture, 6)
    code = compile(checkpointing_blocks()[path], str(README), "exec")
    trained: list = []
    saved = None
    for run in range(2):  # a first run of 3 batches, then a fresh namespace resumes from the json'd state
        namespace = {"mixture": str(mixture_path), "saved": saved, "train": trained.append, "__name__": "readme"}
        exec(code, namespace)
        saved = json.loads(json.dumps(namespace["saved"]))
        assert saved["step"] == 3 * (run + 1)
    assert len(trained) == 6
    for s in range(6):
        assert_same(trained[s], reference[s], f"README block {path + 1}, step {s}")
