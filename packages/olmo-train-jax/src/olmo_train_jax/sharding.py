"""Where every array of the JAX trainer lives: the device mesh and explicit NamedShardings.

The mesh has named axes (``recipe.jax.mesh``; one of them may be -1 = the devices left):

- ``data``: plain data parallelism; parameters are replicated over it;
- ``fsdp``: data parallelism with fully sharded parameters and optimizer state (ZeRO-3): each
  weight is split along its largest axis that the fsdp size divides; the stacked-layer axis is
  never split, because ``lax.scan`` slices it and a split there would gather per layer anyway;
- ``expert`` (MoE specs, only in the mesh when larger than 1): expert parallelism. The routed
  experts' weights (and their AdamW moments) are split on their expert axis in contiguous
  blocks; the axis also carries data (MaxText / DeepSeek style), so dense parameters are
  replicated over it like over ``data``, and ``expert_parallel`` moves each token to the
  rank that owns its expert with an all-to-all;
- ``tensor``: Megatron-style tensor parallelism: attention heads (q/k/v output, o input), the
  MLP hidden axis (gate/up output, down input) and the vocabulary of the output head are split
  when the tensor size divides them.

A batch is split over (data, fsdp, expert) on its batch axis, so the data-parallel size is
data x fsdp x expert. XLA inserts the all-gathers and reduce-scatters the placements imply;
the model code holds no parallelism (docs/design.md contract 6).

Multi-host: with ``recipe.jax.distributed`` the trainer calls ``jax.distributed.initialize()``
first (on a TPU pod slice or under SLURM/Open MPI it finds the coordinator itself; elsewhere
set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID). Every process then loads
only its rows of the global batch (loader rank = process index) and
``jax.make_array_from_process_local_data`` assembles the global array from them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_model import ModelSpec
from olmo_model.recipe import Recipe, RecipeError

from .expert_parallel import EXPERT_AXIS, TOKEN_AXES, expert_partition_spec

# In mesh order; the expert axis is present only when the recipe asks for more than one
# expert rank, so dense runs keep their (data, fsdp, tensor) mesh.
MESH_AXES = ("data", "fsdp", EXPERT_AXIS, "tensor")


def initialize_distributed(recipe: Recipe) -> None:
    """Join the multi-host job when the recipe asks for it (idempotent for one process)."""
    if recipe.jax.distributed and not jax.distributed.is_initialized():
        jax.distributed.initialize()


def make_mesh(mesh_axes: dict[str, int], devices: list | None = None) -> Mesh:
    """A (data, fsdp[, expert], tensor) mesh over all devices; a -1 axis takes the devices left."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    sizes = {axis: int(mesh_axes.get(axis, 1)) for axis in MESH_AXES}
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise RecipeError(f"jax.mesh={mesh_axes}: axis sizes must be positive or -1")
    if sizes[EXPERT_AXIS] == -1:
        raise RecipeError(
            f"jax.mesh={mesh_axes}: jax.mesh.expert cannot be -1; give the number of expert ranks "
            "(a divisor of moe.n_experts) and let data or fsdp take the devices left"
        )
    ep = sizes[EXPERT_AXIS]
    if n % ep:
        raise RecipeError(f"jax.mesh.expert={ep} does not divide the {n} devices; choose a divisor of {n}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    free = [axis for axis, s in sizes.items() if s == -1]
    if free:
        if n % fixed:
            raise RecipeError(
                f"jax.mesh={mesh_axes}: the fixed axes ({fixed} devices) do not divide the {n} devices; "
                f"choose axis sizes whose product divides {n}"
            )
        sizes[free[0]] = n // fixed
    elif fixed != n:
        raise RecipeError(
            f"jax.mesh={mesh_axes} needs {fixed} devices but {n} are visible; "
            f"make the product {n} or set one axis to -1"
        )
    axes = tuple(a for a in MESH_AXES if a != EXPERT_AXIS or ep > 1)
    shape = tuple(sizes[a] for a in axes)
    # Auto axes: explicit placements of inputs and outputs, XLA propagates the rest.
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def check_mesh_for_spec(mesh: Mesh, spec: ModelSpec) -> None:
    """Refuse an expert axis the spec cannot use (a dense spec, or one that does not divide
    ``moe.n_experts``) with a one-line RecipeError."""
    ep = expert_size(mesh)
    if ep == 1:
        return
    if spec.moe is None:
        raise RecipeError(
            f"jax.mesh.expert={ep} but model '{spec.name}' is dense (no moe section); set jax.mesh.expert=1"
        )
    if spec.moe.n_experts % ep:
        raise RecipeError(
            f"jax.mesh.expert={ep} does not divide moe.n_experts={spec.moe.n_experts} of model '{spec.name}'; "
            "choose a divisor of n_experts"
        )


def expert_size(mesh: Mesh) -> int:
    return mesh.shape.get(EXPERT_AXIS, 1)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch axis of every input is split over (all data-parallel axes)."""
    return tuple(a for a in TOKEN_AXES if a in mesh.axis_names)


def dp_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def describe_mesh(mesh: Mesh) -> str:
    kind = mesh.devices.flat[0].device_kind
    axes = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"mesh {axes} over {mesh.size} {kind} device(s) in {jax.process_count()} process(es)"


# ---- parameter placement -------------------------------------------------------------------


def _tensor_axis(name: str, shape: tuple[int, ...], spec: ModelSpec, tensor: int) -> int | None:
    """Axis of a weight that tensor parallelism splits (heads / MLP hidden / vocab), if it divides."""
    if tensor == 1:
        return None
    heads_ok = spec.n_heads % tensor == 0
    kv_ok = spec.kv_heads % tensor == 0
    mlp_ok = spec.mlp_hidden % tensor == 0
    # Stacked layer weights are [n_layers, in, out].
    choice = {
        "q_proj": (2, heads_ok),
        "k_proj": (2, kv_ok),
        "v_proj": (2, kv_ok),
        "o_proj": (1, heads_ok),
        "gate_proj": (2, mlp_ok),
        "up_proj": (2, mlp_ok),
        "down_proj": (1, mlp_ok),
        "lm_head": (1, spec.padded_vocab_size % tensor == 0),
    }.get(name)
    if choice is None or not choice[1] or len(shape) <= choice[0]:
        return None
    return choice[0]


def param_partition_spec(path: tuple[str, ...], shape: tuple[int, ...], spec: ModelSpec, mesh: Mesh) -> P:
    """The PartitionSpec of one parameter, from its name in the model's state and its shape."""
    name = path[-1]
    axes: list[Any] = [None] * len(shape)
    stacked = path[0] == "layers"
    if expert_size(mesh) > 1 and (expert_axes := expert_partition_spec(path, shape)) is not None:
        axes = list(expert_axes)
    t_axis = _tensor_axis(name, shape, spec, mesh.shape["tensor"])
    if t_axis is not None:
        axes[t_axis] = "tensor"
    fsdp = mesh.shape["fsdp"]
    # Norm scales are a few KB: replicating them costs nothing and saves a gather per use.
    is_matrix = len(shape) - (1 if stacked else 0) >= 2
    if fsdp > 1 and is_matrix:
        candidates = [i for i in range(1 if stacked else 0, len(shape)) if axes[i] is None and shape[i] % fsdp == 0]
        if candidates:
            axes[max(candidates, key=lambda i: shape[i])] = "fsdp"
    return P(*axes)


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def tree_paths(tree) -> list[tuple[tuple[str, ...], Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in leaves]


def param_shardings(params: dict, spec: ModelSpec, mesh: Mesh) -> dict:
    """NamedShardings for the parameter dict (same structure as ``params``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(
            mesh, param_partition_spec(tuple(_key_name(k) for k in path), tuple(x.shape), spec, mesh)
        ),
        params,
    )


def state_shardings(state: Any, params_sharding: dict, mesh: Mesh) -> Any:
    """Shardings for a tree that embeds copies of the parameter tree (AdamW's mu and nu): a
    leaf whose path ends with a parameter's path gets that parameter's sharding; scalars
    (the step count, hyperparameters) are replicated."""
    by_path = {path: s for path, s in tree_paths(params_sharding)}
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        names = tuple(_key_name(k) for k in path)
        if getattr(leaf, "ndim", 0) == 0:
            return replicated
        for n in range(len(names)):
            if names[n:] in by_path:
                return by_path[names[n:]]
        raise ValueError(f"optimizer state leaf {'/'.join(names)} matches no parameter; cannot place it")

    return jax.tree_util.tree_map_with_path(pick, state)


# ---- batches -----------------------------------------------------------------------------


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[accumulation, batch, seq] arrays: micro-steps unsplit, batch over (data, fsdp, expert)."""
    return NamedSharding(mesh, P(None, batch_axes(mesh), None))


def to_micro_batches(local: np.ndarray, local_dp: int, accumulation: int) -> np.ndarray:
    """This process's rows [rows, seq] -> [accumulation, rows / accumulation, seq] such that every
    micro-step takes an equal share of every device's rows: the rows a device holds are
    contiguous in the loader's slice, so each micro-batch stays spread over all devices and
    no row moves between devices."""
    rows, seq = local.shape
    per_device = rows // (local_dp * accumulation)
    x = local.reshape(local_dp, accumulation, per_device, seq)
    return x.transpose(1, 0, 2, 3).reshape(accumulation, local_dp * per_device, seq)


def global_batch_array(local: np.ndarray, mesh: Mesh, accumulation: int, global_rows: int) -> jax.Array:
    """Assemble the global [accumulation, global_rows / accumulation, seq] array from this
    process's contiguous rows of the global batch."""
    local_dp = dp_size(mesh) // jax.process_count()
    micro = to_micro_batches(local, local_dp, accumulation)
    shape = (accumulation, global_rows // accumulation, local.shape[1])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), micro, shape)
