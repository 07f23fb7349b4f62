"""`MixtureLoader`: this process's data-parallel rank(s)' slice of each global batch, prefetched by Grain.

A batch is a pure function of the step (`batch_at(step)`); iterating runs a Grain
`MapDataset` over step numbers from the current step, mapped through `batch_at`, with
`ReadOptions` prefetch threads. State is {fingerprint, seed, step, tokens_consumed}, so a
run resumes at the next global batch under any dp size that divides the global batch.
From object storage a batch's byte ranges are fetched together before it is built
(`read_concurrency`), rather than one GET per window in turn.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grain
import numpy as np

from olmo_data import fileio
from olmo_data.errors import DataError
from olmo_data.mixture import Mixture, load_mixture
from olmo_data.order import RepetitionLimitError, derive_key, feistel_permute, read_instances, round_keys
from olmo_data.sources import window_ranges

log = logging.getLogger(__name__)

# Step numbers the Grain dataset spans past the start; effectively unbounded (a run stops
# at its own step count, or at RepetitionLimitError when a source's budget runs out).
_STEP_HORIZON = 1 << 40


class MixtureLoader:
    """Global batches of `global_batch_size` instances; yields rank `dp_rank`'s rows
    [r*B/R, (r+1)*B/R) as numpy int32 arrays input_ids, labels, doc_ids, positions [B/R, S].
    `dp_rank` may be several ranks (a process whose devices hold several data-parallel shards):
    their rows, one rank after the other in the order given.

    `prefetch` is the number of Grain reader threads (0: read in the calling thread);
    each thread builds one batch at a time, so up to `prefetch` batches are in flight.

    `read_concurrency`: for data on object storage, a thread first fetches every byte range
    its batch will read (each window, or each compressed shard chunk not in the shard's cache),
    ranges of one object that overlap or touch coalesced into one GET, up to this many GETs in
    flight; then it builds the batch from memory. 0 fetches each window when it is read, one
    GET after another. Local files are read directly either way, and the batches are the same
    bytes whatever the setting (`olmo_data.fileio.staged_reads`).
    """

    def __init__(
        self,
        mixture: Mixture | str | os.PathLike,
        global_batch_size: int,
        dp_rank: int | Sequence[int] = 0,
        dp_size: int = 1,
        start_step: int = 0,
        prefetch: int = 2,  # threads: enough to hide shard decompression behind a training step
        read_concurrency: int = fileio.DEFAULT_CONCURRENT_READS,
    ) -> None:
        self.mixture = mixture if isinstance(mixture, Mixture) else load_mixture(mixture)
        if global_batch_size <= 0 or dp_size <= 0 or global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of dp_size {dp_size}; "
                "change one of them"
            )
        ranks = (dp_rank,) if isinstance(dp_rank, int) else tuple(dp_rank)
        if not ranks or any(not 0 <= r < dp_size for r in ranks):
            raise ValueError(
                f"dp_rank {dp_rank} is outside [0, dp_size={dp_size}); pass the rank(s) this process reads"
            )
        if start_step < 0 or prefetch < 0 or read_concurrency < 0:
            raise ValueError(
                f"start_step ({start_step}), prefetch ({prefetch}) and read_concurrency ({read_concurrency}) "
                "must be >= 0"
            )
        self.global_batch_size = global_batch_size
        self.dp_ranks = ranks
        self.dp_size = dp_size
        self.step = start_step  # the next global batch to yield = global batches consumed so far
        # Set (to the reason and the fix) while something else hands this loader's batches to
        # training and cannot keep `step` equal to what training received: state_dict() then
        # refuses rather than return a stale step (olmo_data.torch_data.MixtureDataset sets it).
        self._state_unknown: str | None = None
        self.prefetch = prefetch
        self.read_concurrency = read_concurrency
        files = [f for group in (*self.mixture.training_files, *self.mixture.held_out_files) for f in group]
        self._any_remote = any(fileio.is_remote(f) for f in files)  # else there is nothing to fetch ahead
        self.order = self.mixture.order  # built here, not lazily inside Grain's reader threads
        log.info(
            "MixtureLoader %s: fingerprint %s seed %d, sequence %d, global batch %d, rank(s) %s/%d, step %d, "
            "sources %s, slots per mixture epoch %s",
            self.mixture.path,
            self.mixture.fingerprint()[:16],
            self.mixture.seed,
            self.mixture.sequence_length,
            global_batch_size,
            list(ranks),
            dp_size,
            start_step,
            self.mixture.source_names,
            self.mixture.slots_per_epoch(),
        )

    @property
    def tokens_per_global_batch(self) -> int:
        return self.global_batch_size * self.mixture.sequence_length

    @property
    def dp_rank(self) -> int:
        """The rank of a loader that reads one (the usual case: one rank per process)."""
        if len(self.dp_ranks) != 1:
            raise ValueError(f"this loader reads ranks {list(self.dp_ranks)}; use dp_ranks")
        return self.dp_ranks[0]

    def read_plan(self, step: int) -> list[tuple[str, int, int]]:
        """(URL, offset, length) of the object-storage bytes that reading this loader's rows of
        global batch `step` fetches (`olmo_data.sources.window_ranges`); empty for local data."""
        plan: list[tuple[str, int, int]] = []
        for r in self.dp_ranks:
            try:
                source_ids, within = self.order.rank_instances(step, self.global_batch_size, r, self.dp_size)
            except RepetitionLimitError:
                return []  # batch_at's rank_slice raises it again, when the batch is read
            for s in np.unique(source_ids).tolist():
                source = self.order.sources[s]
                plan += window_ranges(source, within[source_ids == s], self.mixture.sequence_length)
        return plan

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This loader's rows of global batch `step` (pure: no loader state involved). From
        object storage, every byte range the batch needs is fetched first, concurrently
        (`read_concurrency`, see the class docstring); the batch is the same either way."""
        with self._staged(lambda: self.read_plan(step)):
            parts = [self.order.rank_slice(step, self.global_batch_size, r, self.dp_size) for r in self.dp_ranks]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    # A Generator, not just an Iterator: the driver closes it to stop the prefetch threads.
    def __iter__(self) -> Generator[dict[str, np.ndarray], None, None]:
        from olmo_data.workers import refuse_dataloader_replay  # imports no torch

        refuse_dataloader_replay(str(self.mixture.path))
        steps = grain.MapDataset.range(self.step, self.step + _STEP_HORIZON).map(self.batch_at)
        # Buffer 2 batches per thread: each thread has one ready while building the next.
        options = grain.ReadOptions(num_threads=self.prefetch, prefetch_buffer_size=max(1, 2 * self.prefetch))
        for batch in steps.to_iter_dataset(options):
            self.step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The state after the batches training received so far (`state_at(self.step)`).
        DataError if this loader's batches go through a reader that cannot tell it what was
        consumed (a torch DataLoader over `MixtureDataset`): the message names the fix."""
        if self._state_unknown is not None:
            raise DataError(f"{self.mixture.path}: MixtureLoader.state_dict() {self._state_unknown}")
        return self.state_at(self.step)

    def state_at(self, step: int) -> dict[str, Any]:
        """The state to save when global batch `step` is the next one to train on (pure, as
        `batch_at`): `load_state_dict` of it continues at batch `step`."""
        if step < 0:
            raise ValueError(f"state_at: step must be >= 0, got {step}")
        return {
            "fingerprint": self.mixture.fingerprint(),
            "seed": self.mixture.seed,
            "step": int(step),
            "tokens_consumed": int(step) * self.tokens_per_global_batch,
        }

    def load_state_dict(self, state: dict[str, Any], allow_fingerprint_mismatch: bool = False) -> None:
        """Continue at global batch state["step"] (any dp size; same global batch size).
        Call it before iterating: a running iterator keeps the position it started from."""
        missing = {"fingerprint", "seed", "step", "tokens_consumed"} - set(state)
        if missing:
            raise DataError(f"loader state lacks {sorted(missing)}; pass the dict MixtureLoader.state_dict() returned")
        where = f"{self.mixture.path}"
        if state["seed"] != self.mixture.seed:
            raise DataError(
                f"{where}: seed {self.mixture.seed} differs from the checkpoint's loader seed {state['seed']}; "
                "set seed back to resume this run"
            )
        if state["fingerprint"] != self.mixture.fingerprint():
            message = (
                f"{where}: mixture fingerprint {self.mixture.fingerprint()[:16]} differs from the checkpoint's "
                f"{str(state['fingerprint'])[:16]} (the data or the mixture changed)"
            )
            if not allow_fingerprint_mismatch:
                raise DataError(
                    message + "; restore the original data, or resume anyway with "
                    "--data.allow_fingerprint_mismatch=true (recipe field data.allow_fingerprint_mismatch)"
                )
            log.warning(
                "!!! %s; continuing at step %d anyway because data.allow_fingerprint_mismatch=true. The data "
                "order is keyed by the fingerprint, so the whole remaining order is reshuffled: batches from "
                "step %d on are drawn from the new mixture's order and differ from the original run's (some "
                "documents already trained on come again, some never come) !!!",
                message,
                state["step"],
                state["step"],
            )
        if state["tokens_consumed"] != state["step"] * self.tokens_per_global_batch:
            raise DataError(
                f"{where}: the checkpoint consumed {state['tokens_consumed']} tokens in {state['step']} steps, "
                "which is "
                f"not {self.global_batch_size} x {self.mixture.sequence_length} tokens per step: the global batch "
                "size or sequence_length changed; resume with the original global batch size"
            )
        self.step = int(state["step"])

    def eval_batches(self, source_name: str, batch_size: int) -> list[dict[str, np.ndarray]]:
        """The fixed evaluation set of held-out source `source_name` in batches of
        `batch_size` (the last may be smaller); see `eval_instances`."""
        if batch_size <= 0:
            raise ValueError(f"eval batch_size must be > 0, got {batch_size}")
        source, within = eval_instances(self.mixture, source_name)
        seq, vocab = self.mixture.sequence_length, self.mixture.config.vocab_size
        out = []
        for i in range(0, len(within), batch_size):
            with self._staged(lambda: window_ranges(source, within[i : i + batch_size], seq)):
                out.append(read_instances(source, within[i : i + batch_size], seq, vocab))
        return out

    def _staged(self, plan: Callable[[], list[tuple[str, int, int]]]) -> AbstractContextManager[object]:
        """`fileio.staged_reads` of what `plan()` names, or nothing to do (read_concurrency 0)."""
        if self.read_concurrency == 0 or not self._any_remote:
            return contextlib.nullcontext()
        return fileio.staged_reads(plan(), self.read_concurrency)


def eval_instances(mixture: Mixture, source_name: str) -> tuple[Any, np.ndarray]:
    """(held-out source, its eval instance numbers): the first eval.sequences_per_source
    instances of a permutation keyed by the mixture seed, sequence length and that source's
    own file identity (names relative to the YAML, sizes, checksums): it ignores training
    steps, resumes, dp size and even the training sources, so mixtures that share a
    held-out set (same relative layout) evaluate on the same sequences."""
    if source_name not in mixture.held_out_sources:
        raise DataError(
            f"{mixture.path}: no held_out source named {source_name!r}; "
            f"choose one of {sorted(mixture.held_out_sources)}"
        )
    source = mixture.held_out_sources[source_name]
    seq = mixture.sequence_length
    count = mixture.config.eval.sequences_per_source
    identity = json.dumps(mixture.source_identity(source), sort_keys=True)
    key = derive_key(identity, mixture.seed, seq, "eval", source_name)
    within = feistel_permute(np.arange(count), source.num_tokens // seq, round_keys(key, np.zeros(1)))
    return source, within
