"""What the driver measures around the steps, written once for both trainers: the held-out
evaluation, the peak FLOP/s that MFU divides by, and the memory figures of the train line.
A trainer answers only the device questions (``driver.TrainModule``): the sums of one
held-out batch, its device kind, a matmul to time, its device memory."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from olmo_data import MixtureLoader
from olmo_model import resolve_device_kind

from .metrics import perplexity


def evaluate(
    eval_sums: Callable[[dict[str, Any]], tuple[float, float]], loader: MixtureLoader, batch_size: int
) -> dict[str, dict[str, float]]:
    """{held-out source: {loss, perplexity, tokens}}: the token-weighted CE over each source's
    fixed evaluation set. ``eval_sums(batch)`` is the trainer's (CE sum, valid tokens) of one
    batch over every process, the same on each."""
    out = {}
    for name in loader.mixture.held_out_sources:
        ce_total, n_total = 0.0, 0.0
        for batch in loader.eval_batches(name, batch_size):
            ce, n = eval_sums(batch)
            ce_total += ce
            n_total += n
        loss = ce_total / max(n_total, 1.0)
        out[name] = {"loss": loss, "perplexity": perplexity(loss), "tokens": int(n_total)}
    return out


def matmul_peak(matmul: Callable[[int], Callable[[], Any]], size: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of a size x size matmul: ``matmul(size)`` prepares one and returns the call
    that runs it to completion (the first call, compiling or warming up, is not timed). 1024 is
    large enough to reach the 2048 figure on a 2-core CI machine, at an eighth of the work."""
    run = matmul(size)
    run()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def device_peak(device_kind: str | None, matmul: Callable[[int], Callable[[], Any]]) -> tuple[float, str]:
    """(peak FLOP/s per device, label) for MFU: the bf16 table peak of an accelerator's
    ``device_kind``, or on CPU (None) a measured fp32 matmul."""
    if device_kind is None:
        peak = matmul_peak(matmul)
        return peak, f"measured cpu fp32 matmul {peak / 1e9:.1f} GFLOP/s"
    entry = resolve_device_kind(device_kind)
    return entry.bf16_flops_per_device, f"{entry.kind} bf16 {entry.bf16_flops_per_device / 1e12:.0f} TFLOP/s"


def host_memory() -> tuple[float, float, str]:
    """(resident, peak resident) bytes of this process: the CPU run's memory figure."""
    import resource

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


def memory(device_memory: tuple[float, float] | None) -> tuple[float, float, str]:
    """(in use, peak since the process started) bytes and what they measure: the trainer's
    device figures ("device"), or host RSS where its device has none (CPU)."""
    if device_memory is None:
        return host_memory()
    return device_memory[0], device_memory[1], "device"
