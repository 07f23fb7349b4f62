"""``optim.sharded`` in the JAX trainer, as MaxText's ``shard_optimizer_over_data``: the parameters
keep their placement (replicated over the data-parallel axes ``data`` and, for dense weights,
``expert``), and each tensor's AdamW moments are split over those axes as well, so a device keeps
1/dp of them (``parallelize.state_shardings`` places them with ``over_data``). The update then
runs on each device's block of the moments, and XLA all-gathers it into the replicated
parameters. The parameters are the float32 master weights in either precision (bf16 casts them
in the matmuls), so they stay whole on every device. Orbax restores a checkpoint onto whichever
placement the current recipe gives (``checkpoint.load_checkpoint``), so the sharding can change on
resume.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .expert_parallel import EXPERT_AXIS

# Moments of fewer elements stay replicated (OLMo-core's do_not_shard_tensor_smaller_than,
# optim/moe_optimizer.py; the torch trainer's sharded optimizer has the same rule).
MIN_SHARDED_NUMEL = 4096


def over_data(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` split also over the data-parallel axes it replicates over (``data``, and
    ``expert`` for a dense weight), on the largest free dimension they divide, for a tensor of
    ``MIN_SHARDED_NUMEL`` elements or more (``optim.sharded``, MaxText's
    ``shard_optimizer_over_data``); unchanged for a smaller tensor, or with no such dimension."""
    axes = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for ax in axes if ax is not None for a in (ax if isinstance(ax, tuple) else (ax,))}
    replicas = tuple(a for a in ("data", EXPERT_AXIS) if mesh.shape.get(a, 1) > 1 and a not in used)
    n = math.prod(mesh.shape[a] for a in replicas)
    free = [i for i, size in enumerate(shape) if axes[i] is None and size % n == 0]
    if n == 1 or math.prod(shape) < MIN_SHARDED_NUMEL or not free:
        return spec
    axes[max(free, key=lambda i: shape[i])] = replicas if len(replicas) > 1 else replicas[0]
    return P(*axes)
