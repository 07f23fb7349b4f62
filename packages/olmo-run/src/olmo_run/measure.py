"""What the driver measures around the steps, written once for both trainers: the held-out
evaluation, the peak FLOP/s that MFU divides by (on CPU a matmul timed once per machine and kept
under $OLMO_CACHE/matmul-peak), and the memory figures of the train line.
A trainer answers only the device questions (``driver.TrainModule``): the sums of one
held-out batch, its device kind, a matmul to time, its device memory."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from olmo_data import MixtureLoader
from olmo_data.content_hash import cache_root
from olmo_model import resolve_device_kind

from .metrics import perplexity

log = logging.getLogger(__name__)


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


def peak_cache_key(matmul: Callable[[int], Callable[[], Any]]) -> dict[str, Any]:
    """What a CPU matmul peak depends on: the CPU model, the cores this process may use, the
    framework's matmul that was timed (its module and name) and the thread settings a process
    can change (torch's intra-op threads, the OpenMP / MKL / XLA variables): a one-thread test
    run's figure never stands for a default run's."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS): every core
        cores = os.cpu_count() or 1
    settings = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS") if k in os.environ}
    torch = sys.modules.get("torch")  # read only if the process already uses torch: never imported here
    if torch is not None:
        settings["torch_threads"] = str(torch.get_num_threads())
    name = getattr(matmul, "__qualname__", None) or type(matmul).__qualname__  # a method's, or a callable's class
    implementation = f"{getattr(matmul, '__module__', None) or type(matmul).__module__}.{name}"
    return {"cpu": cpu_model(), "cores": cores, "matmul": implementation, "settings": settings}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_cache_file(key: dict[str, Any]) -> Path:
    """$OLMO_CACHE/matmul-peak/<key digest>.json (default ~/.cache/olmo-twin/...)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "matmul-peak" / f"{digest}.json"


def cached_matmul_peak(matmul: Callable[[int], Callable[[], Any]]) -> tuple[float, str]:
    """(FLOP/s, when measured) of ``matmul_peak``, measured once per ``peak_cache_key`` and kept
    in ``peak_cache_file``: runs on one machine divide by the same peak, where a measurement per
    run moves with the machine's load (44-146 GFLOP/s run to run on one 2-core AMD machine). Deleting the file measures again; an
    unreadable one is measured again and replaced."""
    key = peak_cache_key(matmul)
    path = peak_cache_file(key)
    try:
        entry = json.loads(path.read_text())
        if entry["key"] == key and float(entry["flops"]) > 0:
            log.info(
                f"MFU peak: cpu fp32 matmul read from {path} (measured {entry['measured']}; delete it to re-measure)"
            )
            return float(entry["flops"]), str(entry["measured"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or not one this code wrote: measure
    flops = matmul_peak(matmul)
    measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "flops": flops, "measured": measured}, indent=1) + "\n")
        os.replace(tmp, path)  # whole: a concurrent run reads the old file or this one
        log.info(f"MFU peak: cpu fp32 matmul measured, kept in {path} (delete it to re-measure)")
    except OSError as err:  # a read-only cache: this run's figure is still right
        log.warning(f"MFU peak: cannot keep the measured matmul peak in {path}: {err}")
    return flops, measured


def device_peak(device_kind: str | None, matmul: Callable[[int], Callable[[], Any]]) -> tuple[float, str]:
    """(peak FLOP/s per device, label) for MFU: the bf16 table peak of an accelerator's
    ``device_kind``, or on CPU (None) an fp32 matmul measured once per machine
    (``cached_matmul_peak``)."""
    if device_kind is None:
        peak, measured = cached_matmul_peak(matmul)
        return peak, f"measured cpu fp32 matmul {peak / 1e9:.1f} GFLOP/s (kept since {measured[:10]})"
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
