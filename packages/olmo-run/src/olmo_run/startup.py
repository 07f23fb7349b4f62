"""The start-up both trainers run, in one order, with the trainer's hooks (``Trainer``):

1. the recipe's inputs (``read_inputs``): spec, run dir reachable, mixture and held-out
   leakage check; then the trainer's checks that need no process group (``Trainer.check``:
   torch refuses a layout the launched world cannot run before it joins one). A problem
   reading the inputs (a file one host cannot read) is raised in step 4, where the processes
   stop together, not before the others have joined;
2. distributed init (``Trainer.init_distributed``: rank, world size, the text all-gather);
3. the shared run dir (``check_shared_run_dir``): every process sees the files process 0
   writes there, or a one-line refusal;
4. the resolved run (``resolve_run``): the trainer's layout (``Trainer.data_parallel``, which
   also checks the layout against the spec: the loader ranks this process reads and the
   data-parallel size, derived once), the batch layout, the loader, the checkpoint to resume
   (checked against spec, framework, mixture fingerprint and loader state) or else the
   ``recipe.init`` source; the trainer reads and checks its init weights (``Trainer.load_init``).
   A process that fails here stops the others too (``stop_together``);
5. the "already complete" exit (``announce_finished``);
6. ``driver.run``: the run dir's lock, then its first write, then the trainer's module
   (``Trainer.build_module``) and the loop.

Nothing is written before step 6, so bad input leaves the run dir untouched.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from olmo_data import Mixture, MixtureLoader, fileio, open_training_mixture
from olmo_data.fileio import URLPath
from olmo_model import ModelSpec

from .init_source import InitSource, resolve_init
from .metrics import final_eval_pending
from .recipe import BatchLayout, Recipe, RecipeError, batch_layout
from .resume import find_resume
from .run_dir import RunPath, check_reachable
from .terminal import show_on_terminal

if TYPE_CHECKING:
    from .driver import TrainModule

log = logging.getLogger(__name__)

# Process 0's marker in the run dir while the processes check that they share it.
SHARED_CHECK_FILE = ".shared-run-dir-check"
# How long a process looks for the marker: a file another host just created can take a moment
# to appear on a network file system (its directory attributes are cached).
SHARED_CHECK_WAIT_S = 5.0


@dataclass
class Processes:
    """Where this process sits in the job (``Trainer.init_distributed``)."""

    rank: int
    world_size: int
    all_gather_text: Callable[[str], list[str]]  # every process's text, in process order, on every process
    line: str = ""  # this process's start-up line, shown by every process ("" for none)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Inputs:
    """What the recipe names, read and checked without a process group or a write."""

    recipe: Recipe
    spec: ModelSpec
    mixture: Mixture

    @property
    def sequence_length(self) -> int:
        return self.mixture.sequence_length

    def batch_layout(self, dp_size: int) -> BatchLayout:
        """The recipe's global batch split over ``dp_size`` data-parallel shards (RecipeError
        when it does not divide)."""
        r = self.recipe
        return batch_layout(r.global_batch_sequences(self.sequence_length), dp_size, r.train.micro_batch_size)


def read_inputs(recipe: Recipe) -> Inputs:
    """Spec, run dir reachable (a URL's bucket and credentials), mixture and leakage check."""
    spec = recipe.model_spec()
    check_reachable(recipe.resolved_run_dir())
    mixture = open_training_mixture(
        recipe.data.mixture,
        sequence_length=recipe.train.sequence_length,
        model_vocab_size=spec.vocab_size,
        max_positions=spec.max_position_embeddings,
        allow_leakage=recipe.data.allow_leakage,
    )
    return Inputs(recipe, spec, mixture)


@dataclass
class RunSetup:
    """The run start-up resolved, before anything was written."""

    recipe: Recipe
    spec: ModelSpec
    mixture: Mixture
    layout: BatchLayout
    loader: MixtureLoader
    resume: tuple[int, RunPath, dict[str, Any]] | None  # (step, checkpoint dir, meta)
    init: InitSource | None  # recipe.init, resolved and checked (None when resuming)

    @property
    def run_dir(self) -> RunPath:
        return self.recipe.resolved_run_dir()

    @property
    def sequence_length(self) -> int:
        return self.mixture.sequence_length

    @property
    def total_steps(self) -> int:
        return self.recipe.total_steps()

    @property
    def start_step(self) -> int:
        return self.resume[0] if self.resume else 0

    def finished(self) -> bool:
        """Whether the run is complete: its final checkpoint, final eval and plot all exist."""
        total = self.total_steps
        return self.start_step == total and not final_eval_pending(
            self.run_dir, total, list(self.mixture.held_out_sources)
        )


def resolve_run(inputs: Inputs, framework: str, loader_ranks: Sequence[int] = (0,), dp_size: int = 1) -> RunSetup:
    """The batch layout over ``dp_size`` data-parallel shards, the loader of the shards
    ``loader_ranks`` this process reads (several: their rows in that order), and the checkpoint
    to resume or else the ``recipe.init`` source; reads the run dir, writes nothing. Raises
    RecipeError, DataError or TrainingStateError with a one-line message."""
    recipe, spec = inputs.recipe, inputs.spec
    layout = inputs.batch_layout(dp_size)
    loader = MixtureLoader(
        inputs.mixture, layout.global_batch, dp_rank=loader_ranks, dp_size=dp_size, prefetch=recipe.data.prefetch
    )
    resume = find_resume(recipe.resolved_run_dir(), recipe, spec, framework, loader, recipe.total_steps())
    init = resolve_init(recipe, spec, framework) if resume is None else None
    return RunSetup(recipe, spec, inputs.mixture, layout, loader, resume, init)


class Trainer:
    """A trainer's start-up hooks; ``start`` calls them in its one order."""

    framework: str
    prog: str  # the command's name: the summary's title and the signal lines

    def check(self, inputs: Inputs) -> None:
        """The trainer's checks that need no process group (none by default)."""

    def init_distributed(self) -> Processes:
        """Join the job's processes (a single process joins nothing)."""
        raise NotImplementedError

    def data_parallel(self, inputs: Inputs) -> tuple[tuple[int, ...], int]:
        """(loader ranks this process reads, data-parallel size) of the trainer's layout, after
        checking that layout against the spec and sequence length."""
        raise NotImplementedError

    def load_init(self, setup: RunSetup) -> None:
        """Read and check the ``recipe.init`` weights that must be checked before any write."""

    def describe(self) -> list[str]:
        """The main process's start-up lines about the layout."""
        return []

    def build_module(self, setup: RunSetup) -> TrainModule:
        """The module, once the run dir exists: its state restored or initialised."""
        raise NotImplementedError


def start(recipe: Recipe, trainer: Trainer) -> RunPath:
    """Run (or resume, or find complete) the recipe's job with ``trainer``; returns the run dir."""
    from .driver import run

    show_on_terminal()
    recipe = recipe.for_framework(trainer.framework)
    try:
        inputs: Inputs | None = read_inputs(recipe)
        unread: Exception | None = None
    except Exception as err:  # a file one host cannot read: raised once the processes can agree
        inputs, unread = None, err
    if inputs is not None:
        trainer.check(inputs)  # needs no process group: fails alike on every process, before any joins
    processes = trainer.init_distributed()
    if processes.is_main:
        log.info("# resolved recipe\n" + recipe.to_yaml())
    if processes.line:
        log.info(processes.line)
    # Before the run dir is read: processes that see different run dirs would plan different runs.
    p = processes
    check_shared_run_dir(recipe.resolved_run_dir(), p.rank, p.world_size, p.all_gather_text)
    with stop_together(processes):
        if inputs is None:
            assert unread is not None
            raise unread
        loader_ranks, dp_size = trainer.data_parallel(inputs)
        setup = resolve_run(inputs, trainer.framework, loader_ranks, dp_size)
        trainer.load_init(setup)
    if announce_finished(setup, processes.is_main):
        return setup.run_dir
    return run(
        setup,
        lambda: trainer.build_module(setup),
        is_main=processes.is_main,
        describe=trainer.describe(),
        title=f"{trainer.prog}: {setup.run_dir}",
    )


def check_shared_run_dir(
    run_dir: RunPath, process_index: int, process_count: int, all_gather: Callable[[str], list[str]]
) -> None:
    """Refuse (RecipeError, one line, on every process) a run dir that some process does not see
    as process 0 does: each host's own local disk, where the first multi-process checkpoint would
    never commit. Process 0 writes a random token into the run dir, every process must read that
    token back, then the marker goes (and the folders this check created), so the check leaves
    nothing behind. ``all_gather(text)`` returns every process's text in process order, on
    every process (the trainer's collective). One process has nothing to check, nor has a URL
    run dir (every process reads the same bucket)."""
    if process_count == 1 or isinstance(run_dir, URLPath):
        return
    marker = run_dir / SHARED_CHECK_FILE
    created: list[Path] = []  # innermost first
    token, failure = "", ""
    if process_index == 0:
        try:
            created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
            run_dir.mkdir(parents=True, exist_ok=True)
            token = secrets.token_hex(16)
            fileio.write_text(marker, token)
        except OSError as err:
            token, failure = "", f"{type(err).__name__}: {err.strerror or err}"
    token = all_gather(token)[0]
    seen = False
    if token:
        deadline = time.monotonic() + SHARED_CHECK_WAIT_S
        while not (seen := _reads(marker, token)) and time.monotonic() < deadline:
            time.sleep(0.1)
    views = all_gather("seen" if seen else "")
    if process_index == 0:  # every process has looked: the marker can go
        marker.unlink(missing_ok=True)
        for folder in created:
            if folder.exists():  # a failed mkdir created only the outer ones
                folder.rmdir()
    if not token:  # every process leaves together, or the others would wait on process 0
        raise RecipeError(
            f"run_dir={run_dir}: process 0 cannot write there{f' ({failure})' if failure else ''}; "
            "choose a run dir it can create and write"
        )
    blind = [i for i, v in enumerate(views) if not v]
    if blind:
        raise RecipeError(
            f"run_dir={run_dir}: process(es) {blind} of {process_count} do not see the files process 0 writes there "
            "(each host's own disk?); put the run dir on a shared file system every host mounts at the same path, "
            "or use a remote URL (gs://, s3://)"
        )


def _reads(marker: Path, token: str) -> bool:
    """Whether ``marker`` holds ``token``; listing its folder first makes a network file system
    revalidate the folder instead of answering from its cache."""
    try:
        os.listdir(marker.parent)
        return marker.read_text() == token
    except OSError:
        return False


def announce_finished(setup: RunSetup, is_main: bool) -> bool:
    """True (and says so) when the run has nothing left to do."""
    if not setup.finished():
        return False
    if is_main:
        total = setup.total_steps
        log.info(f"{setup.run_dir}: already complete (checkpoint at step {total} of {total}); nothing to do")
    return True


@contextmanager
def stop_together(processes: Processes) -> Iterator[None]:
    """A start-up block that may fail on some processes only (a file one host cannot read): a
    process that raises tells the others, which then stop too, with a one-line RecipeError,
    instead of waiting for it in their first collective. Nothing to tell with one process."""
    if processes.world_size == 1:
        yield
        return
    try:
        yield
    except Exception:
        processes.all_gather_text("stopped")
        raise
    stopped = [i for i, v in enumerate(processes.all_gather_text("")) if v]
    if stopped:
        raise RecipeError(
            f"process(es) {stopped} of {processes.world_size} stopped at start-up (their error is in their log); "
            "nothing was written"
        )
