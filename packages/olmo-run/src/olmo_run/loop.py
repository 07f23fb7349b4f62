"""The training loop and what its cadenced jobs share (after OLMo-core's trainer and callbacks,
Levanter's hooks): the loop steps, times and feeds the trainer's module; everything done every
so many steps (the train line, checkpoints, evaluation, the profiler, the lock's heartbeat,
the preemption check) is a ``Callback`` in ``olmo_run.callbacks``, called in list order. The
loop names none of them: a new cadenced job is one new class there.

Each step's figures are recorded by name on its ``StepMetrics`` (the module records its loss,
gradient norm and extras, the loop the step, LR and timing); the train line
(``callbacks.train_line``) orders them as ``metrics.TRAIN_KEYS``, then the rest as recorded.

The module records its figures as device values, unread: the loop keeps the steps trained
since the last read and reads them all in one transfer (``Run.read``, the module's
``to_host``) only where a job needs host values, which a job says with ``Callback.reads``:
a log step (the train line), a checkpoint step (``Run.save`` reads first: a state is checked
before it is saved) and an evaluation step; so a step in between costs no host
synchronisation. The read replays each step's spike-guard decision on the driver's history
(``SpikeGuard.observe``), which stops the run (exit status 3) at the first step that must stop
it: a non-finite step is found at the latest at the next read, before any checkpoint of it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from olmo_data import fileio
from olmo_data.fileio import URLPath
from olmo_model import flops_per_token

from .checkpoints import checkpoint_dir, training_meta
from .console import ProgressConsole
from .lock import RunLock
from .measure import device_peak
from .metrics import MetricsLog
from .preempt import PreemptionWatch
from .run_dir import RunPath, local_copy
from .sinks import open_sinks
from .spike_guard import SpikeGuard, refuse_non_finite_state

if TYPE_CHECKING:
    from .driver import TrainModule
    from .startup import RunSetup


class StepMetrics:
    """One step's figures by name, in the order they were recorded."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def record(self, name: str, value: Any) -> None:
        self.values[name] = value

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


@dataclass
class Step:
    """A step the module has just trained: its 1-based number, LR, this process's rows of its
    global batch, and its figures."""

    number: int
    lr: float
    batch: dict[str, np.ndarray]
    metrics: StepMetrics = field(default_factory=StepMetrics)


class Callback:
    """One cadenced job. Each hook is called for every callback, in list order (``order``:
    lower first); the defaults do nothing. A hook may raise to end the run (``Preempted``)."""

    order = 100

    def on_start(self, run: Run) -> None:
        """Before the first step of this process's run (after any resume)."""

    def before_step(self, run: Run, step: int) -> None:
        """Before ``step`` fetches its batch."""

    def reads(self, run: Run, number: int) -> bool:
        """Whether this job needs step ``number``'s figures (and the state's check) on the host
        after it: the loop then reads every step trained since the last read, before any
        ``after_step``."""
        return False

    def after_step(self, run: Run, step: Step) -> None:
        """After ``step`` is trained (its background save polled), with its figures on the host
        where some job ``reads`` them at this step (device values otherwise)."""

    def on_end(self, run: Run) -> None:
        """After the last step (not when the loop raised)."""

    def close(self, run: Run) -> None:
        """However the loop ended, before the module closes."""


class Run:
    """One run of a set-up with a trainer's module: the loop and the state its callbacks share."""

    def __init__(
        self,
        setup: RunSetup,
        module: TrainModule,
        callbacks: list[Callback],
        console: ProgressConsole,
        is_main: bool,
        lock: RunLock | None = None,
        watch: PreemptionWatch | None = None,
    ):
        self.setup, self.module, self.callbacks, self.console = setup, module, callbacks, console
        self.is_main, self.lock, self.watch = is_main, lock, watch
        self.recipe, self.total_steps = setup.recipe, setup.total_steps
        self.n_processes = len(module.all_gather_text(""))  # one gather at start: is agreement needed?
        self.guard = SpikeGuard.from_recipe(self.recipe)
        self.metrics = MetricsLog(setup.run_dir, resume_step=setup.start_step, enabled=is_main)
        self.tokens_per_step = setup.layout.global_batch * setup.sequence_length
        self.flops_per_token = flops_per_token(setup.spec, setup.sequence_length)
        # Only process 0 writes the train line, whose MFU the peak divides; measured there alone,
        # so that no other process's measurement competes with it for the CPU.
        self.peak = device_peak(module.device_kind(), module.matmul) if is_main else (math.nan, "measured by process 0")
        self.started = time.time()
        self.sinks = open_sinks(self.recipe, local_copy(setup.run_dir), enabled=is_main)  # local even for a URL
        self.saved_step = -1
        self.pending: list[tuple[int, StepMetrics]] = []  # steps trained since the last read
        self.unread_seconds = 0.0  # the host's time in them (batch wait and step calls)
        if setup.resume is not None:
            self.guard.load_state_dict(setup.resume[2].get("spike_guard", {}))

    def loop(self) -> None:
        r, total, start = self.recipe, self.total_steps, self.setup.start_step
        batches = iter(self.setup.loader)
        try:
            for callback in self.callbacks:
                callback.on_start(self)
            for number in range(start + 1, total + 1):
                for callback in self.callbacks:
                    callback.before_step(self, number)
                # The step time includes waiting for the batch and, at the read, for the device;
                # not checkpointing or evaluation.
                t0 = time.perf_counter()
                batch = next(batches)
                data_wait = time.perf_counter() - t0
                step = Step(number, r.schedule.lr(number, r.optim.lr, total), batch)
                self.module.train_step(step.batch, number, step.lr, self.guard, step.metrics)
                self.unread_seconds += time.perf_counter() - t0
                step.metrics.record("data_wait", data_wait)
                self.module.poll()
                self.pending.append((number, step.metrics))
                if any(callback.reads(self, number) for callback in self.callbacks):
                    self.read()
                for callback in self.callbacks:
                    callback.after_step(self, step)
            for callback in self.callbacks:
                callback.on_end(self)
        finally:
            batches.close()  # stops the loader's prefetch threads
            self.console.close()
            for callback in self.callbacks:
                callback.close(self)
            self.module.close()  # a save in flight was checked finite: it is committed
            for sink in self.sinks:
                sink.close()
            if self.sinks:
                self.upload_local("tensorboard")

    def is_log_step(self, number: int) -> bool:
        """Whether step ``number`` has a train line: every ``log.every`` steps and the last."""
        return number % self.recipe.log.every == 0 or number == self.total_steps

    def read(self) -> None:
        """The figures of the steps trained since the last read to the host, in one transfer
        (the module's ``to_host``), and their spike-guard decisions replayed in order on the
        driver's history (``SpikeGuard.observe`` raises at the first step that stops the run).
        A skipped step that has no train line gets a console line. The device may run behind
        the host until this read: the steps read together share one ``step_time``, their
        host time plus this read's wait, over their count."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        started = time.perf_counter()
        values = self.module.to_host([metrics.values for _, metrics in pending])
        seconds = (self.unread_seconds + time.perf_counter() - started) / len(pending)
        self.unread_seconds = 0.0
        for (number, metrics), host in zip(pending, values, strict=True):
            metrics.values = host
            metrics.record("step_time", seconds)
            if self.guard.observe(number, host["loss"], host["grad_norm"], host["skipped"]):
                if not self.is_log_step(number):
                    self.console.line(
                        f"step {number}: skipped by the spike guard "
                        f"(loss {host['loss']:.4f}, grad norm {host['grad_norm']:.3f})"
                    )

    def write(self, record: dict[str, Any]) -> None:
        """One line of the metrics log and every sink."""
        self.metrics.write(record)
        for sink in self.sinks:
            sink.write(record)

    def save(self, step: int) -> None:
        """Checkpoint the state as of ``step`` (once: a second call for the same step does
        nothing), refusing a non-finite state: the steps not yet read are read first."""
        if step == self.saved_step:
            return
        self.read()
        if not self.module.state_is_finite():
            refuse_non_finite_state(step, self.setup.run_dir)
        extra = {
            "spike_guard": self.guard.state_dict(),
            "layout": self.setup.layout.model_dump(),
            **self.module.checkpoint_extra(),
        }
        s = self.setup
        meta = training_meta(self.module.framework, step, s.spec, self.recipe, s.loader.state_dict(), extra)
        self.module.save(step, meta)
        self.saved_step = step
        self.metrics.flush()  # a URL run dir: the log up to this checkpoint goes with it

    def checkpoint_path(self, step: int) -> RunPath:
        return checkpoint_dir(self.setup.run_dir, step)

    def upload_local(self, folder: str) -> None:
        """For a URL run dir: this process's files of ``folder`` in the local copy go to the
        bucket (traces: every process its own; the sinks' files: process 0's)."""
        run_dir = self.setup.run_dir
        if not isinstance(run_dir, URLPath):
            return
        local = local_copy(run_dir)
        for path in sorted((local / folder).rglob("*")):
            if path.is_file():
                fileio.put_file(path, run_dir / path.relative_to(local).as_posix())
