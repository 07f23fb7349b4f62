"""Fixtures shared by the cross-package tests (tests/, tools/tests/) that run both trainers'
real entry points in the test process.

pytest runs with --import-mode=importlib, so a test module cannot import a sibling helper
file; the helpers reach tests as fixtures. Heavy imports (torch, jax, the trainers) happen
inside the helpers, so collecting a package's own tests pays nothing for this file.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

_JAX_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_jax_cache_key = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """One JAX persistent compilation cache for the whole session: the tests start many JAX
    processes (subprocess runs, resumes, reruns) that compile the same tiny programs again, and
    on two cores compiling is a third of such a run. Set in the environment before anything
    imports JAX, so xdist workers and every subprocess they start inherit it. A cached
    executable is the one XLA compiled, so no number changes. Size-capped, which turns on JAX's
    file lock around every read and write: concurrent processes never read an entry half written.
    A JAX_COMPILATION_CACHE_DIR of the caller's is kept as it is."""
    if _JAX_CACHE_ENV in os.environ:
        return
    path = tempfile.mkdtemp(prefix="olmo-test-jax-cache-")
    config.stash[_jax_cache_key] = path
    os.environ[_JAX_CACHE_ENV] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_jax_cache_key, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        del os.environ[_JAX_CACHE_ENV]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for a module: with two cores shared by many processes, tiny
    models run several times faster than with a thread pool that mostly waits. Module-scoped so
    that module-scoped fixtures running trainers get it (request it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RunHelpers:
    """Run a trainer's command line, and what its step-1 loss is judged against."""

    @staticmethod
    def train(framework: str, args: Sequence[str]) -> None:
        """``olmo-train-{framework} ARGS`` in this process; the run must exit 0."""
        main = importlib.import_module(f"olmo_train_{framework}.cli").main
        assert main(list(args)) == 0, f"olmo-train-{framework} {' '.join(args)} failed"

    @staticmethod
    def sample_batch(sequence_length: int, sequences: int) -> dict[str, np.ndarray]:
        """Global batch 0 of the embedded sample mixture at ``sequence_length``: what a run of
        that mixture trains on at step 1."""
        from olmo_data import MixtureLoader, load_mixture

        mixture = load_mixture("sample").with_sequence_length(sequence_length)
        return MixtureLoader(mixture, sequences, prefetch=0).batch_at(0)

    @staticmethod
    def loss_from_logits(logits, batch: dict[str, np.ndarray], z_loss_weight: float) -> float:
        """The trainers' loss from reference logits (a float64 torch tensor [B, S, V]): CE +
        z_loss_weight * logsumexp^2, each a mean over the labels that are not -100."""
        import torch

        labels = torch.from_numpy(batch["labels"].astype(np.int64))
        valid = labels != -100
        lse = torch.logsumexp(logits, -1)
        target = logits.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        return ((lse - target)[valid]).mean().item() + z_loss_weight * (lse[valid] ** 2).mean().item()


@pytest.fixture(scope="session")
def run_helpers() -> type[RunHelpers]:
    return RunHelpers
