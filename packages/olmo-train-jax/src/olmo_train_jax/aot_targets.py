"""The devices a dry run compiles for ahead of time without having them (``dry_run``).

The TPU kinds of ``TPU_TOPOLOGY_DIMS`` through libtpu (the ``tpu`` extra), and the GPU kinds
of ``GPU_TARGETS`` through JAX's CUDA plugin (the ``gpu-aot`` extra), which compiles for a GPU it
cannot see when given the card's description (``gpu_targets/KIND.txtpb``, a
``GpuTargetConfigProto``) and a topology of hosts x GPUs: COUNT GPUs are ``GPUS_PER_HOST`` to a host
(an HGX board), fewer on one host. XLA:GPU compiles without autotuning there (no card to time
kernels on), so its GEMM tilings are its defaults, which move the temporaries little and the speed
more; cuDNN's fused attention is planned, not built. On a GPU JAX's allocator holds
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card (0.75 unless set) and the step must fit in that, so
the GPU report's ``hbm_bytes_per_device`` is that share of the card.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import math
import os
from collections.abc import Iterator

from olmo_run.recipe import RecipeError

# Kinds XLA:TPU compiles for here: torus dimensions of the topology name (3D: v5p and tpu7x; 2D: v6e).
TPU_TOPOLOGY_DIMS = {"v5p": 3, "v6e": 2, "tpu7x": 3}


def topology_shape(kind: str, chips: int) -> tuple[int, ...]:
    """A slice shape of ``chips`` chips for ``kind``, as TPU slices are named: the most cubic (or
    square) factorisation, sizes non-decreasing (v5p:512 -> 8x8x8, v5p:128 -> 4x4x8, v6e:256 ->
    16x16); for 3D kinds a slice of fewer than 8 chips is flat (4 -> 2x2x1, 2 -> 1x2x1)."""
    n_dims = TPU_TOPOLOGY_DIMS[kind]
    best: tuple[int, ...] | None = None
    for a in range(1, chips + 1):
        if chips % a:
            continue
        if n_dims == 2:
            shape: tuple[int, ...] = (a, chips // a)
        else:
            rest = chips // a
            b = next((b for b in range(math.isqrt(rest), 0, -1) if rest % b == 0), 1)
            shape = (a, b, rest // b)
        shape = tuple(sorted(shape))
        if best is None or shape[-1] / shape[0] < best[-1] / best[0]:
            best = shape
    assert best is not None  # chips >= 1 always has the factorisation 1 x ... x chips
    if n_dims == 3 and best[0] == 1:
        best = (best[1], best[2], 1)
    return best


def _host_bounds(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Chips per host for the compile: a TPU VM host holds 2x2x1 chips; a slice smaller than a host
    names its own shape (libtpu refuses a topology its host bounds do not divide)."""
    return min(shape[0], 2), min(shape[1], 2), 1


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 while libtpu starts: on a host with no TPU metadata it prints a page
    of warnings about the accelerator type and worker hostnames it cannot find, which concern a
    real TPU VM and not an ahead-of-time compile; failures still come back as exceptions."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def topology_devices(kind: str, chips: int) -> tuple[str, list]:
    """(topology name, the abstract devices XLA:TPU compiles for) of a ``chips``-chip ``kind`` slice."""
    if importlib.util.find_spec("libtpu") is None:
        raise RecipeError(
            f"--devices {kind}:{chips}: compiling for a TPU topology needs libtpu; install it with "
            "`uv sync --extra tpu` (the dev group has it)"
        )
    from jax.experimental import topologies

    # libtpu takes a host-wide lock file when it loads, so that one process owns the chips; a
    # compile-only process owns none, and a second dry run (or a test) must not fail on the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    shape = topology_shape(kind, chips)
    name = f"{kind}:{'x'.join(map(str, shape))}"
    try:
        with _quiet_stderr():
            topo = topologies.get_topology_desc(
                platform="tpu", topology_name=name, chips_per_host_bounds=_host_bounds(shape)
            )
    except Exception as err:  # libtpu's own refusal, e.g. a shape it does not build
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(
            f"--devices {kind}:{chips}: XLA:TPU has no topology {name} ({first}); use a chip count with "
            "a TPU slice shape, e.g. a power of two"
        ) from None
    return name, list(topo.devices)


# GPU kinds XLA:GPU compiles for here, each described by gpu_targets/KIND.txtpb, and the GPUs of one
# host: an HGX board's 8, the node of the Olmo 3 recipes (torchrun, 8 GPUs per node).
GPU_TARGETS = ("h100", "h200", "b200", "b300")
GPUS_PER_HOST = 8
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def gpu_topology_shape(kind: str, count: int) -> tuple[int, int]:
    """(hosts, GPUs per host) of ``count`` GPUs: up to ``GPUS_PER_HOST`` on one host, more in whole
    hosts of ``GPUS_PER_HOST``."""
    if count <= GPUS_PER_HOST:
        return 1, count
    if count % GPUS_PER_HOST:
        raise RecipeError(
            f"--devices {kind}:{count}: more than {GPUS_PER_HOST} GPUs come in whole hosts of {GPUS_PER_HOST}; "
            f"use a multiple of {GPUS_PER_HOST}"
        )
    return count // GPUS_PER_HOST, GPUS_PER_HOST


def gpu_topology_devices(kind: str, count: int) -> tuple[str, list]:
    """(topology name, the abstract devices XLA:GPU compiles for) of ``count`` GPUs of ``kind``."""
    if not any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS):
        raise RecipeError(
            f"--devices {kind}:{count}: compiling for a GPU target needs JAX's CUDA plugin; install it with "
            "`uv sync --extra gpu-aot` (the dev group has it)"
        )
    from jax.experimental import topologies

    hosts, per_host = gpu_topology_shape(kind, count)
    target = (importlib.resources.files("olmo_train_jax") / "gpu_targets" / f"{kind}.txtpb").read_text()
    shape = f"1x{hosts}x{per_host}"  # the plugin's <partitions>x<hosts>x<GPUs per host>
    # The plugin tries to start the CUDA driver first and logs its failure on a host without one.
    with _quiet_stderr():
        topo = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=target)
    hosts_text = f"{hosts} host{'s' if hosts > 1 else ''}"
    return f"{kind}:{count} ({hosts_text} x {per_host} GPU{'s' if per_host > 1 else ''})", list(topo.devices)


def target_devices(kind: str, count: int) -> tuple[str, list]:
    """(topology name, abstract devices) of ``count`` devices of a TPU or GPU ``kind``."""
    if kind in TPU_TOPOLOGY_DIMS:
        return topology_devices(kind, count)
    if kind in GPU_TARGETS:
        return gpu_topology_devices(kind, count)
    raise RecipeError(
        f"--devices {kind}:{count}: the JAX dry run compiles for {', '.join((*TPU_TOPOLOGY_DIMS, *GPU_TARGETS))} "
        f"(no target description of {kind} here); use olmo-train-torch --dry-run for other GPU layouts"
    )


def gpu_memory_fraction() -> float:
    """The share of a GPU that JAX's allocator holds: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise RecipeError(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION='{text}': write the share of the GPU JAX may hold, a number in (0, 1]"
        )
    return fraction
