"""The train line (every ``log.every`` steps and the last): one "train" record of the metrics
log and the sinks, and its console line; and the progress bar, advanced every step (showing
the last logged loss: the steps in between are not read to the host)."""

from __future__ import annotations

import time
from typing import Any

from olmo_data.digest import combine_digests, loader_rows, rows_digest
from olmo_model import mfu

from ..loop import Callback, Run, Step, StepMetrics
from ..measure import memory
from ..metrics import TRAIN_KEYS


class TrainLine(Callback):
    order = 20

    def __init__(self) -> None:
        self.info = ""  # the progress bar's text: the last logged loss

    def reads(self, run: Run, number: int) -> bool:
        return run.is_log_step(number)

    def after_step(self, run: Run, step: Step) -> None:
        if run.is_log_step(step.number):
            self.log(run, step)
            self.info = f"loss {step.metrics['loss']:.4f}"
        run.console.advance(self.info)

    def log(self, run: Run, step: Step) -> None:
        m = step.metrics
        record_figures(run, step)
        record = {key: m[key] for key in TRAIN_KEYS}
        record.update((k, v) for k, v in m.values.items() if k not in record)  # the module's extras, as recorded
        run.write(record)
        run.console.line(console_line(step.number, run.total_steps, step.lr, m))


def console_line(number: int, total_steps: int, lr: float, m: StepMetrics) -> str:
    """The train record in one console line: loss, LR, grad norm, throughput and MFU, then the
    seconds of the step spent waiting for the batch and memory in use / its peak, in GiB
    ("mem": the device's; "rss": the host process's, on CPU)."""
    memory_label = "mem" if m["memory_kind"] == "device" else "rss"
    return (
        f"step {number}/{total_steps} loss {m['loss']:.4f} lr {lr:.3e} grad_norm {m['grad_norm']:.3f}"
        f" {m['tokens_per_second']:,.0f} tok/s mfu {m['mfu']:.1%} wait {m['data_wait']:.2f}s"
        f" {memory_label} {m['memory_gib']:.1f}/{m['memory_peak_gib']:.1f} GiB" + (" SKIPPED" if m["skipped"] else "")
    )


def record_figures(run: Run, step: Step) -> None:
    """The train line's figures besides the module's: throughput and MFU from the step time,
    memory, the batch digest and the wall time since the run started."""
    m, setup = step.metrics, run.setup
    n = run.module.n_devices
    in_use, peak_bytes, memory_kind = memory(run.module.device_memory())
    tps = run.tokens_per_step / m["step_time"]
    peak, label = run.peak
    m.record("kind", "train")
    m.record("step", step.number)
    m.record("lr", step.lr)
    m.record("tokens_seen", step.number * run.tokens_per_step)
    m.record("tokens_per_second", tps)
    m.record("tokens_per_second_per_device", tps / n)
    m.record("tflops_per_device", run.flops_per_token * tps / n / 1e12)
    m.record("mfu", mfu(setup.spec, setup.sequence_length, tps / n, peak_flops_per_device=peak))
    m.record("mfu_peak", label)
    m.record("memory_gib", in_use / 2**30)
    m.record("memory_peak_gib", peak_bytes / 2**30)
    m.record("memory_kind", memory_kind)
    m.record("batch_digest", batch_digest(run, step.batch, step.number))
    m.record("time", time.time() - run.started)


def batch_digest(run: Run, batch: dict[str, Any], step: int) -> str:
    """The digest of global batch ``step - 1`` (``olmo_data.digest``): each process hashes its
    own rows, and the processes exchange one line each, not rows. Processes that read the
    same rows (a context-parallel group) send the same line, counted once."""
    loader = run.setup.loader
    rows = loader_rows(loader.dp_ranks, loader.global_batch_size, loader.dp_size)
    mine = f"{','.join(map(str, loader.dp_ranks))}:{rows_digest(batch, step - 1, rows)}"
    return combine_digests(line.split(":")[1] for line in sorted(set(run.module.all_gather_text(mine))))
