"""The run driver: everything a training run does around its steps, written once for both
trainers (OLMo-core's Trainer / TrainModule split, torchtitan's trainer loop).

A trainer supplies its start-up hooks (``olmo_run.startup.Trainer``) and a ``TrainModule``: its
state and how to step, evaluate one held-out batch, check and save it, and what its device is.
The driver owns the rest:

- ``olmo_run.startup``: the one start-up order (inputs, distributed init, shared run dir, the
  resolved run, the "already complete" exit), writing nothing;
- ``run``: the run dir's lock (``olmo_run.lock``: process 0 takes ``RUN_LOCK`` before its
  first write, refreshes its heartbeat from a thread and the loop, deletes it however the run
  ends; a run dir another live run holds is a one-line RecipeError), the run dir, the start-up
  lines, the preemption watch, the trainer's module, the loop (``olmo_run.loop``: LR from the
  recipe's schedule, step timing, the cadenced jobs of ``olmo_run.callbacks``: train line,
  checkpoints with the finite-state check, evaluation, profiler, heartbeat, preemption), and
  the end of the run (summary table, loss plot), with the loader, console and checkpointer
  closed in ``finally`` so a save in flight is committed even when the loop raises;
- ``olmo_run.measure``: the eval loop, the MFU peak and the memory figures.

A run whose final checkpoint exists but whose final eval or plot does not (a kill between
them) is finished by a rerun: state restored, no step trained again, eval and plot written.

No host synchronisation in a step but where a job needs host values (OLMo-core's trainer
collects its metrics every ``metrics_collect_interval`` steps the same way):

- the module's step records device values it does not read (losses, grad norm, the MoE
  statistics, whether the spike guard skipped the update), and decides the guard on its
  device from a history it keeps there (torch: a small tensor ring; JAX: arrays carried
  between its programs), so a skipped update needs no read either;
- the loop reads every step trained since the last read in one transfer (``to_host``) at a
  log step (``log.every``), a checkpoint step (before the state is checked and saved: a
  non-finite state is never checkpointed), an evaluation step and the last step
  (``Callback.reads``, ``Run.read``); each step's decision is replayed on the driver's
  ``SpikeGuard`` there, which stops the run at the first step that must stop it (exit status
  3, as a non-finite step without the guard, or too many skips in a row, always did), at the
  latest at that read; a skipped step without a train line gets a console line then;
- a train line holds its own step's values, the same numbers whatever ``log.every`` is: a
  run with ``log.every`` 3 logs at steps 3, 6, ... exactly what one with 1 logs there; its
  ``step_time`` (and the throughput from it) is the mean over the steps read together, the
  wait for the device at the read included, since the host runs ahead of the device between
  reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .callbacks import default_callbacks
from .console import ProgressConsole, print_summary
from .lock import acquire as acquire_run_lock
from .loop import Callback, Run, StepMetrics
from .metrics import plot_loss
from .preempt import PreemptionWatch
from .recipe import BatchLayout
from .run_dir import RunPath, prepare_run_dir
from .spike_guard import SpikeGuard
from .startup import RunSetup
from .terminal import show_on_terminal

log = logging.getLogger(__name__)


class TrainModule(Protocol):
    """What a trainer supplies to ``run``; built after the run dir exists, holding the state
    restored from ``setup.resume`` or initialised (fresh or from ``setup.init``)."""

    framework: str
    n_devices: int  # devices the step runs on (tokens/s per device divides by it)

    def train_step(
        self, batch: dict[str, np.ndarray], step: int, lr: float, guard: SpikeGuard, metrics: StepMetrics
    ) -> None:
        """One optimizer step (1-based) on this process's rows of global batch step - 1,
        reading nothing to the host. ``guard`` holds the spike guard's settings and, at the
        first step of this process, the history to start from (a resume's); the module keeps
        the history on its device from then on and decides there whether to skip the update
        (``SpikeGuard.should_skip``'s rule). Records loss, ce_loss, z_loss, grad_norm and
        skipped on ``metrics``, then its extras (the MoE statistics first), as device values
        or host ones; ``to_host`` turns them into the train line's."""
        ...

    def to_host(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The figures ``train_step`` recorded for some steps (in order), read to the host in
        one transfer: floats, ints, bools and lists, keyed as the train line's keys (the MoE
        statistics become the moe_* keys) in the recorded order; host values pass through."""
        ...

    def eval_sums(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """(CE sum, valid tokens) of one held-out batch (every process holds all of it), summed
        over the processes: the same on each."""
        ...

    def state_is_finite(self) -> bool:
        """Whether every parameter and optimizer moment is finite (on every process)."""
        ...

    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Checkpoint the state as of ``step``; ``meta`` goes to its meta.json at commit."""
        ...

    def checkpoint_extra(self) -> dict[str, Any]:
        """The trainer's own meta.json entries (layout details, RNG state)."""
        ...

    def poll(self) -> None:
        """Called after every step: commit a background save that has finished."""
        ...

    def device_kind(self) -> str | None:
        """The accelerator's kind (``olmo_model.resolve_device_kind`` gives its peak), None on CPU."""
        ...

    def matmul(self, size: int) -> Callable[[], Any]:
        """A size x size fp32 matmul on this process's CPU, ready to run: a call runs it to
        completion (``measure.matmul_peak`` times it: the CPU's MFU peak)."""
        ...

    def device_memory(self) -> tuple[float, float] | None:
        """(in use, peak since the process started) bytes of this process's accelerator memory;
        None where the framework has no device figure (CPU): the driver reports host RSS."""
        ...

    def start_trace(self, folder: Path) -> None:
        """Start the framework's profiler, writing this process's trace under ``folder``."""
        ...

    def stop_trace(self) -> None:
        """Stop it once the traced steps' work is done, and write the trace."""
        ...

    def close(self) -> None:
        """Finish (commit) any save in flight and release the trainer's resources."""
        ...

    def all_gather_text(self, text: str) -> list[str]:
        """Every process's ``text``, in process order, on every process."""
        ...


def run(
    setup: RunSetup,
    build_module: Callable[[], TrainModule],
    *,
    is_main: bool,
    describe: list[str],
    title: str,
    callbacks: list[Callback] | None = None,
) -> RunPath:
    """Write the run dir, build the trainer's module, train to the end; returns the run dir.
    ``describe`` are the trainer's start-up lines (its parallel layout); ``callbacks`` the
    loop's cadenced jobs (default: ``callbacks.default_callbacks()``)."""
    show_on_terminal()
    # The main process's first write: the run dir's lock (olmo_run.lock), released however the
    # run ends; the other processes never touch it.
    lock = acquire_run_lock(setup.run_dir) if is_main else None
    try:
        if lock is not None:
            lock.start()  # the heartbeat thread: restoring or compiling may outlast lock.STALE_S
        console = ProgressConsole(setup.recipe.log.progress, is_main, setup.total_steps, setup.start_step)
        for line in describe:
            console.line(line)
        console.line(f"batch layout: {setup.layout.describe()} (sequence length {setup.sequence_length})")
        prepare_run_dir(setup.recipe, setup.spec, is_main, resumed_at=setup.resume[0] if setup.resume else None)
        prog = title.split(":")[0]
        timeout = setup.recipe.checkpoint.preempt_timeout_s
        with PreemptionWatch(prog, timeout, lock.release if lock else None) as watch:
            module = build_module()
            jobs = default_callbacks() if callbacks is None else callbacks
            the_run = Run(setup, module, jobs, console, is_main, lock, watch)
            if line := start_line(setup):
                console.line(line)
            the_run.loop()
        finish(the_run, title)
    finally:
        if lock is not None:
            lock.release()
    return setup.run_dir


def start_line(setup: RunSetup) -> str:
    """Where the state came from: the checkpoint resumed (and the layout it was written with,
    when that differs) or the init source."""
    if setup.resume is not None:
        step, ckpt, meta = setup.resume
        before = meta.get("layout")
        written = f" (written with {BatchLayout(**before).describe()}; now {setup.layout.describe()})" if before else ""
        return f"resumed from {ckpt} at step {step}{written}"
    return setup.init.describe() if setup.init is not None else ""


def finish(the_run: Run, title: str) -> None:
    """The end of a run on the main process: the log uploaded, the summary table, the loss plot."""
    if the_run.is_main:
        the_run.metrics.flush()
        print_summary(the_run.setup.run_dir, title)
        png = plot_loss(the_run.setup.run_dir)
        if png is not None:
            log.info(f"loss curve: {png}")
