"""The run driver: everything a training run does around its steps, written once for both
trainers (OLMo-core's Trainer / TrainModule split, torchtitan's trainer loop).

A trainer supplies a ``TrainModule``: its state and how to step, evaluate, check and save it.
The driver owns the rest:

- ``plan_run``: recipe -> spec -> mixture and held-out leakage check -> the trainer's layout
  check -> batch layout -> loader -> the checkpoint to resume (checked against spec,
  framework, mixture fingerprint and loader state) or else the ``recipe.init`` source. It
  writes nothing, so bad input leaves the run dir untouched.
- ``check_shared_run_dir``: in a multi-process run, that every process sees the run dir process
  0 writes (a marker with a random token); else a one-line refusal, not a hang at the first
  checkpoint. The trainer passes its own all-gather, so this package stays framework-free.
- ``run``: the run dir's lock (``olmo_run.lock``: process 0 takes ``RUN_LOCK`` before its
  first write, refreshes its heartbeat from a thread and the loop, deletes it however the run ends; a
  run dir another live run holds is a one-line RecipeError), the run dir, the loop (LR from
  the recipe's schedule, step timing, the log / checkpoint / eval cadence, the console, the
  train line of ``metrics.TRAIN_KEYS``), the spike guard's state, the finite-state check
  before every checkpoint, and the end of the run (final eval, summary table, loss plot),
  with the loader, console and checkpointer closed in ``finally`` so a save in flight is
  committed even when the loop raises.

A run whose final checkpoint exists but whose final eval or plot does not (a kill between
them) is finished by a rerun: state restored, no step trained again, eval and plot written.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from olmo_data import Mixture, MixtureLoader, fileio, open_training_mixture
from olmo_data.digest import combine_digests, loader_rows, rows_digest
from olmo_data.fileio import URLPath
from olmo_model import ModelSpec, flops_per_token, mfu
from olmo_run import run_dir as _run_dir
from olmo_run.checkpoints import checkpoint_dir, training_meta
from olmo_run.console import ProgressConsole, print_summary
from olmo_run.init_source import InitSource, resolve_init
from olmo_run.lock import RunLock
from olmo_run.lock import acquire as acquire_run_lock
from olmo_run.metrics import TRAIN_KEYS, MetricsLog, eval_logged, final_eval_pending, plot_loss
from olmo_run.preempt import Preempted, PreemptionWatch
from olmo_run.recipe import BatchLayout, Recipe, RecipeError, batch_layout
from olmo_run.resume import find_resume
from olmo_run.run_dir import RunPath, local_copy, prepare_run_dir
from olmo_run.sinks import open_sinks
from olmo_run.spike_guard import SpikeGuard, refuse_non_finite_state

# Process 0's marker in the run dir while the processes check that they share it.
SHARED_CHECK_FILE = ".shared-run-dir-check"
# How long a process looks for the marker: a file another host just created can take a moment
# to appear on a network file system (its directory attributes are cached).
SHARED_CHECK_WAIT_S = 5.0


@dataclass
class RunPlan:
    """What start-up decided, before anything was written."""

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


def plan_run(
    recipe: Recipe,
    framework: str,
    *,
    dp_size: int,
    loader_rank: int | Sequence[int] = 0,
    loader_size: int = 1,
    check_spec: Callable[[ModelSpec], None] | None = None,
) -> RunPlan:
    """Check everything checkable without writing; raises RecipeError, SpecError, DataError,
    LeakageError or TrainingStateError with a one-line message. ``dp_size`` is the number of
    data-parallel shards of a batch (the layout); ``loader_rank`` / ``loader_size`` the loader
    slice(s) this process reads (several ranks: their rows in that order); ``check_spec`` the
    trainer's own checks of its layout."""
    spec = recipe.model_spec()
    _run_dir.check_reachable(recipe.resolved_run_dir())
    mixture = open_training_mixture(
        recipe.data.mixture,
        sequence_length=recipe.train.sequence_length,
        model_vocab_size=spec.vocab_size,
        max_positions=spec.max_position_embeddings,
        allow_leakage=recipe.data.allow_leakage,
    )
    if check_spec is not None:
        check_spec(spec)
    global_batch = recipe.global_batch_sequences(mixture.sequence_length)
    layout = batch_layout(global_batch, dp_size, recipe.train.micro_batch_size)
    loader = MixtureLoader(
        mixture, global_batch, dp_rank=loader_rank, dp_size=loader_size, prefetch=recipe.data.prefetch
    )
    resume = find_resume(recipe.resolved_run_dir(), recipe, spec, framework, loader, recipe.total_steps())
    init = resolve_init(recipe, spec, framework) if resume is None else None
    return RunPlan(recipe, spec, mixture, layout, loader, resume, init)


@dataclass
class StepResult:
    """One optimizer step as the train line reports it."""

    loss: float
    ce_loss: float
    z_loss: float
    grad_norm: float
    skipped: bool
    extra: dict[str, Any] = field(default_factory=dict)  # keys after TRAIN_KEYS (moe_*, ...)


class TrainModule(Protocol):
    """What a trainer supplies to ``run``; built after the run dir exists, holding the state
    restored from ``plan.resume`` or initialised (fresh or from ``plan.init``)."""

    framework: str
    n_devices: int  # devices the step runs on (tokens/s per device divides by it)
    peak: tuple[float, str]  # (peak FLOP/s per device, label) for MFU

    def train_step(self, batch: dict[str, np.ndarray], step: int, lr: float, guard: SpikeGuard) -> StepResult:
        """One optimizer step (1-based) on this process's rows of global batch step - 1;
        ``guard.decide`` says whether to skip its update (and raises when the run must stop)."""
        ...

    def evaluate(self) -> dict[str, dict[str, float]]:
        """{held-out source: {loss, perplexity, tokens}} over each fixed evaluation set."""
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

    def memory(self) -> tuple[float, float, str] | None:
        """(in use, peak) bytes of this process's accelerator memory and "device"; None where the
        framework has no device figure (CPU), and the driver reports host RSS instead."""
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


def host_memory() -> tuple[float, float, str]:
    """(resident, peak resident) bytes of this process: the CPU run's memory figure."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs: the peak is the best figure there is
        now = peak
    # The kernel updates ru_maxrss lazily, so a fresh reading of the resident set can pass it;
    # the largest figure seen keeps the peak from ever going down.
    _HOST_PEAK[0] = max(_HOST_PEAK[0], peak, now)
    return float(now), float(_HOST_PEAK[0]), "host_rss"


_HOST_PEAK = [0]


def announce_finished(plan: RunPlan, is_main: bool) -> bool:
    """True (and says so) when the run has nothing left to do."""
    if not plan.finished():
        return False
    if is_main:
        total = plan.total_steps
        print(f"{plan.run_dir}: already complete (checkpoint at step {total} of {total}); nothing to do", flush=True)
    return True


class Run:
    """One run of a plan with a trainer's module: the loop and what surrounds it."""

    def __init__(
        self,
        plan: RunPlan,
        module: TrainModule,
        console: ProgressConsole,
        is_main: bool,
        lock: RunLock | None = None,
        watch: PreemptionWatch | None = None,
    ):
        self.plan, self.module, self.console, self.is_main = plan, module, console, is_main
        self.lock = lock  # the run-dir lock process 0 holds; its heartbeat is refreshed every step
        self.watch = watch  # SIGTERM / SIGINT seen (olmo_run.preempt)
        self.n_processes = len(module.all_gather_text(""))  # one gather at start: is agreement needed?
        self.recipe = plan.recipe
        self.guard = SpikeGuard.from_recipe(self.recipe)
        self.metrics = MetricsLog(plan.run_dir, resume_step=plan.start_step, enabled=is_main)
        self.tokens_per_step = plan.layout.global_batch * plan.sequence_length
        self.flops_per_token = flops_per_token(plan.spec, plan.sequence_length)
        self.started = time.time()
        self.sinks = open_sinks(self.recipe, local_copy(plan.run_dir), enabled=is_main)  # local even for a URL
        self.tracing = False
        if plan.resume is not None:
            step, ckpt, meta = plan.resume
            self.guard.load_state_dict(meta.get("spike_guard", {}))
            before = meta.get("layout")
            console.line(
                f"resumed from {ckpt} at step {step}"
                + (
                    f" (written with {BatchLayout(**before).describe()}; now {plan.layout.describe()})"
                    if before
                    else ""
                )
            )
        elif plan.init is not None:
            console.line(plan.init.describe())

    def batch_digest(self, batch: dict[str, np.ndarray], step: int) -> str:
        """The digest of global batch ``step - 1`` (``olmo_data.digest``): each process hashes its
        own rows, and the processes exchange one line each, not rows. Processes that read the
        same rows (a context-parallel group) send the same line, counted once."""
        loader = self.plan.loader
        rows = loader_rows(loader.dp_ranks, loader.global_batch_size, loader.dp_size)
        mine = f"{','.join(map(str, loader.dp_ranks))}:{rows_digest(batch, step - 1, rows)}"
        return combine_digests(line.split(":")[1] for line in sorted(set(self.module.all_gather_text(mine))))

    def train_record(
        self, step: int, lr: float, result: StepResult, step_time: float, data_wait: float, digest: str
    ) -> dict[str, Any]:
        """The train line: exactly ``TRAIN_KEYS``, then the trainer's extras."""
        n = self.module.n_devices
        in_use, peak_bytes, memory_kind = self.module.memory() or host_memory()
        tps = self.tokens_per_step / step_time
        peak, label = self.module.peak
        values = (
            "train",
            step,
            result.loss,
            result.ce_loss,
            result.z_loss,
            lr,
            result.grad_norm,
            result.skipped,
            step * self.tokens_per_step,
            tps,
            tps / n,
            self.flops_per_token * tps / n / 1e12,
            mfu(self.plan.spec, self.plan.sequence_length, tps / n, peak_flops_per_device=peak),
            label,
            step_time,
            data_wait,
            in_use / 2**30,
            peak_bytes / 2**30,
            memory_kind,
            digest,
            time.time() - self.started,
        )
        return {**dict(zip(TRAIN_KEYS, values, strict=True)), **result.extra}

    def save(self, step: int) -> None:
        if not self.module.state_is_finite():
            refuse_non_finite_state(step, self.plan.run_dir)
        extra = {
            "spike_guard": self.guard.state_dict(),
            "layout": self.plan.layout.model_dump(),
            **self.module.checkpoint_extra(),
        }
        meta = training_meta(
            self.module.framework, step, self.plan.spec, self.recipe, self.plan.loader.state_dict(), extra
        )
        self.module.save(step, meta)
        self.metrics.flush()  # a URL run dir: the log up to this checkpoint goes with it

    def evaluate(self, step: int) -> None:
        if not self.plan.mixture.held_out_sources:
            return
        result = self.module.evaluate()
        allowed = {"leakage_allowed": True} if self.recipe.data.allow_leakage else {}
        self.write({"kind": "eval", "step": step, "eval": result, **allowed})
        self.console.line(
            f"eval step {step}: "
            + ", ".join(f"{k} loss {v['loss']:.4f} ppl {v['perplexity']:.2f}" for k, v in result.items())
        )

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        for sink in self.sinks:
            sink.write(record)

    def log(
        self, step: int, lr: float, result: StepResult, step_time: float, data_wait: float, batch: dict[str, np.ndarray]
    ) -> None:
        record = self.train_record(step, lr, result, step_time, data_wait, self.batch_digest(batch, step))
        self.write(record)
        self.console.line(
            f"step {step}/{self.plan.total_steps} loss {result.loss:.4f} lr {lr:.3e} grad_norm {result.grad_norm:.3f}"
            f" {record['tokens_per_second']:,.0f} tok/s mfu {record['mfu']:.1%}"
            + (" SKIPPED" if result.skipped else "")
        )

    def loop(self) -> None:
        r, total, start = self.recipe, self.plan.total_steps, self.plan.start_step
        batches = iter(self.plan.loader)
        try:
            if self.eval_pending(start):
                self.evaluate(start)
            for step in range(start + 1, total + 1):
                self.trace(step)
                # The step time includes waiting for the batch, not checkpointing or evaluation.
                t0 = time.perf_counter()
                batch = next(batches)
                data_wait = time.perf_counter() - t0
                lr = r.schedule.lr(step, r.optim.lr, total)
                result = self.module.train_step(batch, step, lr, self.guard)
                step_time = time.perf_counter() - t0
                self.module.poll()
                if step % r.log.every == 0 or step == total:
                    self.log(step, lr, result, step_time, data_wait, batch)
                self.console.advance(f"loss {result.loss:.4f}")
                saved = step % r.checkpoint.every == 0 or step == total
                if saved:
                    self.save(step)
                stop = self.preempt_requested(step)
                if stop:  # its eval, if one was due, runs when the run resumes here
                    if not saved:
                        self.save(step)
                    raise Preempted(stop, step, str(checkpoint_dir(self.plan.run_dir, step)))
                if step % r.eval.every == 0 or step == total:
                    self.evaluate(step)
                if self.lock is not None:
                    self.lock.refresh()  # a write at most every lock.HEARTBEAT_S
            self.trace(total + 1)
        finally:
            batches.close()  # stops the loader's prefetch threads
            self.console.close()
            if self.tracing:  # the loop raised inside the traced steps: keep what was traced
                self.stop_trace()
            self.module.close()  # a save in flight was checked finite: it is committed
            for sink in self.sinks:
                sink.close()
            if self.sinks:
                self.upload_local("tensorboard")

    def eval_pending(self, step: int) -> bool:
        """Whether the resumed-at ``step`` was due an evaluation that the run dir lacks: a run
        stopped (killed, preempted) between that checkpoint and its eval line gets it now, so
        no point of the held-out curve is lost; the final one included."""
        if step == 0 or not self.plan.mixture.held_out_sources:
            return False
        if step % self.recipe.eval.every != 0 and step != self.plan.total_steps:
            return False
        return not eval_logged(self.plan.run_dir, step)

    def preempt_requested(self, step: int) -> str:
        """The signal that stops the run after ``step`` ("" for none), the same on every process:
        one process's flag stops them all. With several processes they agree by a gather every
        ``checkpoint.preempt_check_every`` steps (and at the last step); one process needs none."""
        local = (self.watch.signal_name if self.watch is not None else None) or ""
        if self.n_processes == 1:
            return local
        every = self.recipe.checkpoint.preempt_check_every
        if step % every != 0 and step != self.plan.total_steps:
            return ""
        return next((name for name in self.module.all_gather_text(local) if name), "")

    def trace(self, step: int) -> None:
        """Before ``step``: start the profiler at ``profile.start_step``, stop it after the last
        traced step (``step`` is then the one after it, or total + 1 at the loop's end)."""
        p = self.recipe.profile
        if p.start_step is None:
            return
        last = min(p.start_step + p.steps - 1, self.plan.total_steps)
        if step == p.start_step and not self.tracing and step <= last:
            folder = local_copy(self.plan.run_dir) / "profile" / f"steps_{p.start_step}-{last}"
            folder.mkdir(parents=True, exist_ok=True)
            self.module.start_trace(folder)
            self.tracing = True
            self.console.line(f"profiling steps {p.start_step}-{last} into {folder}")
        elif self.tracing and step > last:
            self.stop_trace()

    def stop_trace(self) -> None:
        self.module.stop_trace()
        self.tracing = False
        self.upload_local("profile")

    def upload_local(self, folder: str) -> None:
        """For a URL run dir: this process's files of ``folder`` in the local copy go to the
        bucket (traces: every process its own; the sinks' files: process 0's)."""
        run_dir = self.plan.run_dir
        if not isinstance(run_dir, URLPath):
            return
        local = local_copy(run_dir)
        for path in sorted((local / folder).rglob("*")):
            if path.is_file():
                fileio.put_file(path, run_dir / path.relative_to(local).as_posix())

    def finish(self, title: str) -> None:
        if self.is_main:
            self.metrics.flush()
            print_summary(self.plan.run_dir, title)
            png = plot_loss(self.plan.run_dir)
            if png is not None:
                print(f"loss curve: {png}", flush=True)


def run(
    plan: RunPlan,
    build_module: Callable[[], TrainModule],
    *,
    is_main: bool,
    describe: list[str],
    title: str,
) -> RunPath:
    """Write the run dir, build the trainer's module, train to the end; returns the run dir.
    ``describe`` are the trainer's start-up lines (its parallel layout)."""
    # The main process's first write: the run dir's lock (olmo_run.lock), released however the
    # run ends; the other processes never touch it.
    lock = acquire_run_lock(plan.run_dir) if is_main else None
    try:
        if lock is not None:
            lock.start()  # the heartbeat thread: restoring or compiling may outlast lock.STALE_S
        console = ProgressConsole(plan.recipe.log.progress, is_main, plan.total_steps, plan.start_step)
        for line in describe:
            console.line(line)
        console.line(f"batch layout: {plan.layout.describe()} (sequence length {plan.sequence_length})")
        prepare_run_dir(plan.recipe, plan.spec, is_main, resumed_at=plan.resume[0] if plan.resume else None)
        prog = title.split(":")[0]
        with PreemptionWatch(prog, plan.recipe.checkpoint.preempt_timeout_s, lock.release if lock else None) as watch:
            module = build_module()
            the_run = Run(plan, module, console, is_main, lock, watch)
            the_run.loop()
        the_run.finish(title)
    finally:
        if lock is not None:
            lock.release()
    return plan.run_dir
