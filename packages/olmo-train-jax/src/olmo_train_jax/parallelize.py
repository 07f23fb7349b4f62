"""Where every array of the JAX trainer lives: the device mesh and explicit NamedShardings.

The mesh has named axes (``recipe.jax.mesh``; one of them may be -1 = the devices left):

- ``data``: plain data parallelism; parameters are replicated over it, and so is their AdamW
  state unless ``optim.sharded`` splits each tensor's moments over it (and over ``expert`` for
  the dense weights, which that axis replicates too: ``state_shardings``);
- ``fsdp``: data parallelism with fully sharded parameters and optimizer state (ZeRO-3): each
  weight is split along its largest axis that the fsdp size divides; the stacked-layer axis is
  never split, because ``lax.scan`` slices it and a split there would gather per layer anyway;
- ``expert`` (MoE specs, only in the mesh when larger than 1): expert parallelism. The routed
  experts' weights (and their AdamW moments) are split on their expert axis in contiguous
  blocks; the axis also carries data (MaxText / DeepSeek style), so dense parameters are
  replicated over it like over ``data``, and ``expert_parallel`` moves each token to the
  rank that owns its expert with an all-to-all;
- ``context`` (only in the mesh when larger than 1): context parallelism. Every row's sequence
  is split over it in ``olmo_model.context.ContextLayout``'s zigzag order (2C chunks, device r
  holds chunks r and 2C-1-r, so causal attention costs every device the same):
  ``global_batch_array`` permutes each row's columns to that order before placing it, and the
  trainer passes each column's true position (``sequence_positions``) to the model, whose
  attention exchanges keys over the axis (``context_parallel.context_attention``: an all-gather
  of K/V for global layers, the window's tail from the neighbours for sliding ones). Everything
  else is per token and needs no change; the loss is a sum over tokens, so it does not see the
  order. It is a model-parallel axis for the loader: the devices of one context group read the
  same rows. Parameters are replicated over it, as over ``data`` (FSDP does not extend over
  context, unlike torchtitan's dp_shard_cp): the output head and the embedding meet the tokens
  along the axis that splits them, and with the head split over context too XLA chose to
  all-gather the context group's hidden states for the head matmul rather than the head (the
  tiny test shape, where the activations are the smaller), which undoes the split it exists for.
  With context out of the weight placement every weight gather runs over fsdp only and the
  gradients are reduced over context like over data; the state is divided by fsdp x tensor,
  which for stage 3 (CP=8 on 512 devices, fsdp=64) is 1.8 GB per device for the 7B;
- ``tensor``: Megatron-style tensor parallelism: attention heads (q/k/v output, o input), the
  MLP hidden axis (gate/up output, down input) and the vocabulary of the output head are split
  when the tensor size divides them.

A batch is split over (data, fsdp, expert) on its batch axis, so the data-parallel size is
data x fsdp x expert, and over context on its sequence axis. XLA inserts the all-gathers and reduce-scatters the placements imply;
the model code holds no parallelism (docs/design.md contract 6).

Multi-process (``distributed_settings``): with ``jax.distributed`` or any of
``jax.coordinator_address`` / ``jax.num_processes`` / ``jax.process_id`` (or their environment
variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) the trainer joins the job
with ``jax.distributed.initialize()`` before anything else; what none of them gives, JAX detects
(a TPU VM's metadata, Slurm, Open MPI). Under Slurm a task that has its node's GPUs to itself
(``--ntasks-per-node=1``) uses all of them, and with one task per GPU each uses its own.

Rows are read per data-parallel shard, not per process (``process_batch_shards``): a process
reads the rows of every shard one of its devices holds, so a model-parallel group (tensor, or
a device order that interleaves hosts, as a TPU torus does) that spans processes reads the same
rows on each, and ``global_batch_array`` places them: the global batch is the same array,
row for row, whatever the process layout.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_model import ModelSpec
from olmo_model.context import ContextLayout, ContextLayoutError
from olmo_run.recipe import Recipe, RecipeError

from .context_parallel import ContextParallel
from .expert_parallel import EXPERT_AXIS, TOKEN_AXES, expert_partition_spec
from .grouped_gemm import check_gemm
from .sharded_optimizer import over_data

CONTEXT_AXIS = "context"
# In mesh order; the expert and context axes are present only when the recipe asks for more than
# one rank on them, so other runs keep their (data, fsdp, tensor) mesh. Context sits next to
# tensor: both exchange activations every layer, so their groups are the nearest devices.
MESH_AXES = ("data", "fsdp", EXPERT_AXIS, CONTEXT_AXIS, "tensor")


# The explicit launch's environment variables (this JAX reads only the first one itself).
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
# What JAX's Slurm detection requires (jax._src.clusters.slurm_cluster).
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def distributed_settings(recipe: Recipe, environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """``jax.distributed.initialize`` keyword arguments for this process, or None when the run is
    one process: the recipe's keys first, then their environment variables; what is still None,
    JAX detects. A malformed value is a one-line RecipeError."""
    j = recipe.jax

    def from_env(name: str, key: str) -> int | None:
        raw = environ.get(name, "")
        if not raw:
            return None
        try:
            return int(raw)
        except ValueError:
            raise RecipeError(f"${name}={raw!r} is not an integer; unset it or set jax.{key}") from None

    address = j.coordinator_address or environ.get(COORDINATOR_ENV) or None
    count = j.num_processes if j.num_processes is not None else from_env(NUM_PROCESSES_ENV, "num_processes")
    index = j.process_id if j.process_id is not None else from_env(PROCESS_ID_ENV, "process_id")
    if not j.distributed and address is None and count is None and index is None:
        return None
    if count is not None and index is not None and not 0 <= index < count:
        raise RecipeError(
            f"jax.process_id={index} is outside the {count} processes of jax.num_processes; "
            f"give each process an index in 0..{count - 1}"
        )
    return {
        "coordinator_address": address,
        "num_processes": count,
        "process_id": index,
        "heartbeat_timeout_seconds": j.heartbeat_timeout_seconds,
    }


def slurm_task_owns_its_gpus(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this Slurm task should use every GPU it sees. JAX's Slurm detection restricts each
    task to GPU number SLURM_LOCALID (one task per GPU); that is wrong for one task per node
    (it would use one of the node's GPUs) and for a task Slurm bound one GPU to (its only GPU is
    number 0). An explicit JAX_LOCAL_DEVICE_IDS is left to JAX."""
    if not all(v in environ for v in _SLURM_VARS) or environ.get("JAX_LOCAL_DEVICE_IDS"):
        return False
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    one_task_per_node = nodes is not None and int(nodes) == int(environ["SLURM_NTASKS"])
    bound = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    return one_task_per_node or len(bound) == 1


def init_distributed(recipe: Recipe) -> None:
    """Join the multi-process job when the recipe or the environment asks for it (see
    ``distributed_settings``); a job that cannot be joined is a one-line RecipeError."""
    settings = distributed_settings(recipe)
    if settings is None or jax.distributed.is_initialized():
        return
    try:
        jax.distributed.initialize(**settings)
    except (ValueError, jax.errors.JaxRuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(
            f"jax.distributed: cannot join the job ({first}); outside a TPU VM or Slurm set jax.coordinator_address, "
            f"jax.num_processes and jax.process_id (or ${COORDINATOR_ENV}, ${NUM_PROCESSES_ENV}, ${PROCESS_ID_ENV}) "
            "the same on every process but the index"
        ) from None
    if slurm_task_owns_its_gpus():
        # initialize() only set the flag; no backend exists yet, so this takes effect.
        jax.config.update("jax_cuda_visible_devices", "all")
        jax.config.update("jax_rocm_visible_devices", "all")


TEXT_SLOT = 256  # bytes of text per process in all_gather_text's one gather (a digest line, a token)


def all_gather_text(text: str) -> list[str]:
    """Every process's ``text`` (ASCII, any length), in process order, on every process: the
    collective ``olmo_run.driver`` takes (the run-dir check, each process's batch-digest line,
    every log step). One gather of a fixed slot per process (its length, then up to
    ``TEXT_SLOT`` bytes) when every text fits, as those do; when one does not, every process
    sees so in the gathered lengths, and all gather again, every text zero-padded to the longest."""
    raw = np.frombuffer(text.encode("ascii"), np.uint8)
    slot = np.zeros(4 + TEXT_SLOT, np.uint8)
    slot[:4] = np.array([raw.size], "<i4").view(np.uint8)
    slot[4 : 4 + min(raw.size, TEXT_SLOT)] = raw[:TEXT_SLOT]
    slots = np.asarray(multihost_utils.process_allgather(slot)).reshape(-1, 4 + TEXT_SLOT)
    lengths = slots[:, :4].copy().view("<i4").reshape(-1)
    if int(lengths.max()) <= TEXT_SLOT:
        return [bytes(row[4 : 4 + n]).decode("ascii") for row, n in zip(slots, lengths, strict=True)]
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [bytes(row[:n]).decode("ascii") for row, n in zip(rows, lengths, strict=True)]


def build_mesh(mesh_axes: dict[str, int], devices: list | None = None) -> Mesh:
    """A (data, fsdp[, expert][, context], tensor) mesh over all devices; a -1 axis takes the devices left."""
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
    if sizes[CONTEXT_AXIS] == -1:
        raise RecipeError(
            f"jax.mesh={mesh_axes}: jax.mesh.context cannot be -1; give the context degree (ranks one "
            "sequence is split over) and let data or fsdp take the devices left"
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
    optional = {EXPERT_AXIS: ep, CONTEXT_AXIS: sizes[CONTEXT_AXIS]}
    axes = tuple(a for a in MESH_AXES if optional.get(a, 2) > 1)
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


def context_size(mesh: Mesh) -> int:
    return mesh.shape.get(CONTEXT_AXIS, 1)


def context_layout(mesh: Mesh, sequence_length: int) -> ContextLayout | None:
    """The zigzag split of a row over the mesh's context axis (None without one); a sequence the
    degree cannot split is a one-line RecipeError."""
    degree = context_size(mesh)
    if degree == 1:
        return None
    try:
        return ContextLayout(sequence_length, degree)
    except ContextLayoutError as err:
        raise RecipeError(f"jax.mesh.context={degree}: {err}") from None


def check_sequence_split(mesh: Mesh, sequence_length: int) -> None:
    """Refuse a context degree the sequence cannot be split by (before anything is written)."""
    context_layout(mesh, sequence_length)


def check_layout(mesh: Mesh, recipe: Recipe, spec: ModelSpec, sequence_length: int) -> None:
    """Every check of the recipe against the mesh, before anything is written (the trainer and
    its dry run call this one function): the expert axis against the spec, the context degree
    against the sequence, ``jax.moe_gemm`` against the devices and precision."""
    check_mesh_for_spec(mesh, spec)
    check_sequence_split(mesh, sequence_length)
    check_gemm(recipe.jax.moe_gemm, spec, recipe.train.precision, mesh.devices.flat[0])


def to_context_order(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """``x`` [..., seq] with its columns in the context layout's order (unchanged without CP)."""
    layout = context_layout(mesh, x.shape[-1])
    return x if layout is None else layout.shard(x, axis=-1)


def sequence_positions(mesh: Mesh, sequence_length: int) -> np.ndarray | None:
    """[seq] int32: the true position of each column of a context-ordered row, the model's RoPE
    positions (None without CP: the columns are the positions)."""
    layout = context_layout(mesh, sequence_length)
    return None if layout is None else layout.order.astype(np.int32)


def hidden_spec(mesh: Mesh) -> P:
    """Where the residual stream [B, S, d_model] lives: batch over the data-parallel axes,
    sequence over context."""
    return P(batch_axes(mesh), CONTEXT_AXIS if context_size(mesh) > 1 else None, None)


def build_context(mesh: Mesh, spec: ModelSpec) -> ContextParallel | None:
    """What the model's attention needs to run over the context axis (None without one); the
    heads stay split over tensor inside it when both head counts divide the tensor size."""
    degree = context_size(mesh)
    if degree == 1:
        return None
    tensor = mesh.shape["tensor"]
    heads = "tensor" if tensor > 1 and spec.n_heads % tensor == 0 and spec.kv_heads % tensor == 0 else None
    return ContextParallel(mesh, batch_axes(mesh), degree, CONTEXT_AXIS, heads)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch axis of every input is split over (all data-parallel axes)."""
    return tuple(a for a in TOKEN_AXES if a in mesh.axis_names)


def dp_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def describe_mesh(mesh: Mesh) -> str:
    kind = mesh.devices.flat[0].device_kind
    axes = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"mesh {axes} over {mesh.size} {kind} device(s) in {jax.process_count()} process(es)"


def process_batch_shards(mesh: Mesh) -> tuple[int, ...]:
    """The data-parallel shards (0 .. dp-1, in the order the batch axis is split) that this
    process's devices hold, ascending: the loader ranks it reads. Taken from the sharding's own
    index map, so it holds for any device order (a TPU torus interleaves hosts)."""
    dp = dp_size(mesh)
    index_map = NamedSharding(mesh, P(batch_axes(mesh))).addressable_devices_indices_map((dp,))
    return tuple(sorted({_first_row(index, 0) for index in index_map.values()}))


def _first_row(index: tuple[slice, ...] | None, axis: int) -> int:
    """Where a device's piece of an array starts along ``axis`` (an unsplit axis: 0)."""
    return 0 if index is None else index[axis].start or 0


def describe_process(mesh: Mesh) -> str:
    """This process's start-up line: its index, its devices, the shards it reads, the mesh."""
    local = ", ".join(str(d.id) for d in jax.local_devices())
    shards = process_batch_shards(mesh)
    return (
        f"process {jax.process_index()} of {jax.process_count()}: local devices [{local}], reads data-parallel "
        f"shard(s) {list(shards)} of {dp_size(mesh)}; {describe_mesh(mesh)}"
    )


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


def state_shardings(state: Any, params_sharding: dict, mesh: Mesh, *, shard_over_data: bool = False) -> Any:
    """Shardings for a tree that embeds copies of the parameter tree (AdamW's mu and nu): a
    leaf whose path ends with a parameter's path gets that parameter's sharding, split over the
    data-parallel axes too with ``shard_over_data`` (``optim.sharded``: each data-parallel rank
    keeps its block of the moments, and XLA all-gathers the update into the replicated
    parameters; ``over_data``); scalars (the step count, hyperparameters) are replicated."""
    by_path = {path: s for path, s in tree_paths(params_sharding)}
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        names = tuple(_key_name(k) for k in path)
        if getattr(leaf, "ndim", 0) == 0:
            return replicated
        for n in range(len(names)):
            if names[n:] in by_path:
                spec = by_path[names[n:]].spec
                return NamedSharding(mesh, over_data(spec, tuple(leaf.shape), mesh) if shard_over_data else spec)
        raise ValueError(f"optimizer state leaf {'/'.join(names)} matches no parameter; cannot place it")

    return jax.tree_util.tree_map_with_path(pick, state)


# ---- batches -----------------------------------------------------------------------------


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[accumulation, batch, seq] arrays: micro-steps unsplit, batch over (data, fsdp, expert),
    sequence over context."""
    return NamedSharding(mesh, P(None, *hidden_spec(mesh)[:2]))


def eval_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """[rows, seq] evaluation arrays: rows over the data-parallel axes when they divide (else
    every device holds them all), sequence over context."""
    split = batch_axes(mesh) if rows % dp_size(mesh) == 0 else None
    return NamedSharding(mesh, P(split, CONTEXT_AXIS if context_size(mesh) > 1 else None))


def to_micro_batches(local: np.ndarray, local_dp: int, accumulation: int) -> np.ndarray:
    """``local_dp`` shards' rows [rows, seq] (each shard's rows contiguous) -> [accumulation,
    rows / accumulation, seq] such that every micro-step takes an equal share of every shard's
    rows: each micro-batch stays spread over all devices and no row moves between devices."""
    rows, seq = local.shape
    per_device = rows // (local_dp * accumulation)
    x = local.reshape(local_dp, accumulation, per_device, seq)
    return x.transpose(1, 0, 2, 3).reshape(accumulation, local_dp * per_device, seq)


def global_batch_array(local: np.ndarray, mesh: Mesh, accumulation: int, global_rows: int) -> jax.Array:
    """The global [accumulation, global_rows / accumulation, seq] array from this process's rows:
    those of the shards ``process_batch_shards`` names, in that order (the loader's rows for
    those ranks). Each device gets its shard's rows whichever process it is on, so devices of
    one shard on several processes get the same rows. Under context parallelism the columns are
    put in the context layout's order first and each device gets its columns of those rows."""
    shards = process_batch_shards(mesh)
    micro = to_micro_batches(to_context_order(local, mesh), len(shards), accumulation)
    per_device = micro.shape[1] // len(shards)
    column = {d: i * per_device for i, d in enumerate(shards)}

    def rows_of(index: tuple[slice, ...] | None) -> np.ndarray:
        first = column[_first_row(index, 1) // per_device]
        columns = slice(None) if index is None else index[2]
        return micro[:, first : first + per_device, columns]

    shape = (accumulation, global_rows // accumulation, local.shape[1])
    return jax.make_array_from_callback(shape, batch_sharding(mesh), rows_of)
