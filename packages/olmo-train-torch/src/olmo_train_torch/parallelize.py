"""Process group, device mesh and data parallelism for the torch trainer.

The model (``model.py``) knows nothing of parallelism; this module wraps an unchanged
``OlmoModel`` from the outside, per ``recipe.torch``:

- ``fsdp``: FSDP2 (``fully_shard``) units for the embedding, every block, the final norm with
  the output head, then the root, over a 1-D mesh ``(dp,)`` of all ranks;
- ``hsdp``: the same over a 2-D mesh ``(dp_replicate, dp_shard)`` = ``(replicate,
  world / replicate)``: parameters sharded within a group, replicated across groups;
- ``ddp``: ``DistributedDataParallel`` (every rank holds the full model); with ``optim.sharded``
  no wrapper: every rank holds the full compute weights and 1/dp of the fp32 master weights and
  AdamW moments, gradients reduce-scattered per tensor (``sharded_optimizer.py``);
- ``none``: no wrapper (one process only).

Every mode is data parallelism: each rank is one data-parallel rank of the loader,
so the data-parallel size is always the world size. MoE specs may add expert parallelism
(``torch.expert_parallel = EP > 1``): an ``(edp, ep)`` mesh of the same ranks
(``expert_parallel.expert_mesh``), each rank keeping E/EP experts of every MoE layer
(DTensor shards, never FSDP-sharded, left out of the wrapper) with tokens moved to them
by all-to-all; the dense parts (attention, router, shared experts, embeddings) stay under
the mode's wrapper over all ranks. The wrapper averages dense gradients over the ranks;
a hook gives the expert gradients the same convention (``prepare_expert_parallel``).

Context parallelism (``torch.context_parallel = C > 1``): each sequence is split over C
consecutive ranks (``olmo_model.context``'s zigzag layout; ``context_parallel.ContextParallel``,
installed as ``OlmoModel.context``, carries the attention across the split). The world is then
``dp x C``: the loader's data-parallel rank is ``rank // C`` and all C ranks of a group read the
same rows, keeping their own columns. FSDP2/HSDP shard parameters over all ranks, data x context
flattened (torchtitan's ``dp_shard_cp``), not over data only: the C ranks of a group hold the
same parameters and their gradients must be summed anyway, so sharding over them too costs the
same reduce-scatter bytes per rank and divides parameter, gradient and AdamW memory by C (at
olmo3-7b stage 3, CP 8 on 512 GPUs: 512-way rather than 64-way shards). The wrapper's mean over
all ranks with each rank's loss scaled by the world size gives the global-token mean, as for
pure data parallelism. DDP takes it as is (all ranks, one all-reduce). Not with MoE specs.

With precision bf16, FSDP/HSDP use ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` over fp32 master weights; DDP and ``none`` use ``torch.autocast``
instead (see ``autocast_context``). Activation checkpointing (``checkpoint_wrapper``,
non-reentrant) and ``torch.compile`` apply per block, before sharding, as torchtitan orders
them. The trainer parallelizes a model built on the meta device and gives it values only then,
this rank's shards only (``parallelize(..., materialize=...)``, ``step.start_model``).

A single process started without torchrun gets no process group at all: the model is
not wrapped, and checkpoints go through DCP's no-process-group path.

Multi-node launch (the same command on every node; torchrun's c10d rendezvous)::

    torchrun --nnodes=$NNODES --node-rank=$NODE_RANK --nproc-per-node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=$JOB_ID \\
        -m olmo_train_torch recipe.yaml
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from olmo_model import ModelSpec
from olmo_run.recipe import RecipeError, TorchSection

from .context_parallel import ContextParallel
from .expert_parallel import apply_expert_parallel, expert_mesh, expert_parameters, hook_expert_gradients, ignore_in_ddp
from .model import OlmoModel
from .sharded_optimizer import attach_sharded_masters, sharded_masters_of


@dataclass(frozen=True)
class Distributed:
    """Where this process sits: rank, world size, its device; ``initialized`` when a
    process group exists (launched by torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.initialized and self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.initialized and self.world_size > 1:
            dist.barrier()

    def all_gather_text(self, text: str) -> list[str]:
        """Every rank's ``text`` in rank order, on every rank."""
        if not (self.initialized and self.world_size > 1):
            return [text]
        out: list[str] = [""] * self.world_size
        dist.all_gather_object(out, text)
        return out


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def process_layout() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it.
    Known before joining the process group, so start-up checks can run first."""
    if not launched_by_torchrun():
        return 0, 1, 0
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(backend: str) -> Distributed:
    """Join torchrun's process group (if launched by it) and pick this rank's device.

    backend ``auto``: nccl for GPUs (with gloo alongside for CPU tensors, which async DCP
    saves need), gloo on CPU."""
    cuda = torch.cuda.is_available()
    rank, world, local = process_layout()
    if not launched_by_torchrun():
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        return Distributed(rank=0, world_size=1, local_rank=0, device=device, initialized=False)
    if backend == "nccl" and not cuda:
        raise RecipeError("torch.backend=nccl needs CUDA GPUs, and none is visible; use torch.backend=gloo or auto")
    use_cuda = cuda and backend != "gloo"
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    pg_backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=pg_backend, device_id=device if use_cuda else None)
    return Distributed(rank=rank, world_size=world, local_rank=local, device=device, initialized=True)


def check_parallel(
    section: TorchSection, world_size: int, spec: ModelSpec | None = None, *, optim_sharded: bool = False
) -> None:
    """Refuse a parallel mode the world size (or, for expert parallelism, the spec; for
    ``optim.sharded``, the mode) cannot run, before anything starts."""
    if optim_sharded:
        check_sharded_optimizer(section, world_size)
    if section.parallel == "none" and world_size > 1:
        raise RecipeError(
            f"torch.parallel=none runs one process, but {world_size} were launched; "
            "use torch.parallel=fsdp, hsdp or ddp, or launch a single process"
        )
    if section.parallel == "hsdp" and world_size % section.replicate:
        raise RecipeError(
            f"torch.replicate={section.replicate} does not divide the {world_size} ranks; "
            f"choose a divisor of {world_size}"
        )
    cp = section.context_parallel
    if cp > 1:
        if world_size % cp:
            raise RecipeError(
                f"torch.context_parallel={cp} does not divide the {world_size} ranks; "
                f"choose a divisor of {world_size} (or launch a multiple of {cp} processes)"
            )
        if section.parallel == "hsdp" and (world_size // section.replicate) % cp:
            raise RecipeError(
                f"torch.context_parallel={cp} does not divide the HSDP shard group of "
                f"{world_size // section.replicate} ranks (torch.replicate={section.replicate}); "
                "choose a context degree that divides world / replicate"
            )
        if spec is not None and spec.moe is not None:
            raise RecipeError(
                f"torch.context_parallel={cp} with a mixture-of-experts model is not supported "
                "(routing and aux losses count tokens per data-parallel rank); set torch.context_parallel=1"
            )
    ep = section.expert_parallel
    if ep == 1:
        return
    if spec is not None and spec.moe is None:
        raise RecipeError(
            f"torch.expert_parallel={ep} needs a mixture-of-experts model, but the spec has no moe section; "
            "set torch.expert_parallel=1 or choose an MoE model (e.g. --model=tiny-moe)"
        )
    if world_size % ep:
        raise RecipeError(
            f"torch.expert_parallel={ep} does not divide the {world_size} ranks; "
            f"choose a divisor of {world_size} (or launch a multiple of {ep} processes)"
        )
    if spec is not None and spec.moe is not None and spec.moe.n_experts % ep:
        raise RecipeError(
            f"torch.expert_parallel={ep} does not divide moe.n_experts={spec.moe.n_experts}; "
            f"choose a common divisor of {spec.moe.n_experts} and {world_size}"
        )


def check_sharded_optimizer(section: TorchSection, world_size: int) -> None:
    """``optim.sharded`` shards AdamW over the data-parallel ranks of ``torch.parallel=ddp``."""
    if section.parallel in ("fsdp", "hsdp"):
        raise RecipeError(
            f"optim.sharded=true with torch.parallel={section.parallel}: FSDP2 shards the optimizer state "
            "already; set optim.sharded=false, or torch.parallel=ddp"
        )
    if section.parallel == "none" or world_size == 1:
        raise RecipeError(
            "optim.sharded=true shards the optimizer state over data-parallel ranks, and this run has one; "
            "set optim.sharded=false, or torch.parallel=ddp with 2 or more processes"
        )


def check_sequence_split(section: TorchSection, sequence_length: int) -> None:
    """Refuse a context degree the sequence cannot be split by (2 x degree equal chunks)."""
    cp = section.context_parallel
    if cp > 1 and sequence_length % (2 * cp):
        raise RecipeError(
            f"torch.context_parallel={cp} splits each sequence into {2 * cp} equal chunks, but the sequence "
            f"length {sequence_length} is not a multiple of {2 * cp}; choose a degree whose double divides it"
        )


def check_layout(
    section: TorchSection, world_size: int, spec: ModelSpec, sequence_length: int, *, optim_sharded: bool = False
) -> None:
    """Every check of the recipe's torch section (and ``optim.sharded``) against the ranks, the
    spec and the sequence, before anything is written (the trainer and its dry run call this one
    function)."""
    check_parallel(section, world_size, spec, optim_sharded=optim_sharded)
    check_sequence_split(section, sequence_length)


def build_context(section: TorchSection, device_type: str) -> ContextParallel | None:
    """The context group of this rank for ``torch.context_parallel > 1`` (an ``(dp, cp)``
    mesh of all ranks, named ``(data, context)``, context innermost: a group is C consecutive ranks, one node's NVLink
    domain for C <= 8); None for degree 1."""
    cp = section.context_parallel
    if cp == 1:
        return None
    if not dist.is_initialized():
        raise RecipeError(
            f"torch.context_parallel={cp} needs {cp} or more processes under torchrun; "
            "set torch.context_parallel=1 for a single process"
        )
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("data", "context"))
    return ContextParallel(
        group=mesh["context"].get_group(),
        degree=cp,
        rank=mesh["context"].get_local_rank(),
        dp_rank=mesh["data"].get_local_rank(),
        dp_size=world // cp,
    )


def context_of(model: nn.Module) -> ContextParallel | None:
    """The context parallelism ``parallelize`` installed on ``model`` (None: none)."""
    context = getattr(unwrap(model), "context", None)
    return context if isinstance(context, ContextParallel) else None


def build_mesh(d: Distributed, section: TorchSection) -> DeviceMesh | None:
    """The data-parallel mesh for ``section.parallel``; None for ``none`` or no process group."""
    check_parallel(section, d.world_size)
    mode = section.parallel
    if mode == "none" or not d.initialized:
        return None
    if mode == "hsdp":
        shape = (section.replicate, d.world_size // section.replicate)
        return init_device_mesh(d.device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("dp",))


def build_expert_mesh(d: Distributed, section: TorchSection) -> DeviceMesh | None:
    """The ``(edp, ep)`` mesh for ``torch.expert_parallel > 1``; None otherwise."""
    if section.expert_parallel == 1 or not d.initialized:
        return None
    return expert_mesh(d.device.type, d.world_size, section.expert_parallel)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap each block in ``checkpoint_wrapper`` (non-reentrant): only its input is kept for
    backward, the block is recomputed there."""
    blocks = cast(nn.ModuleList, model.blocks)  # nn.Module.__getattr__ is typed Tensor | Module
    for i, block in enumerate(blocks):
        # preserve_rng_state=False: the model has no dropout, so there is no RNG to replay.
        blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block in place (one graph per block, reused by every layer)."""
    for block in cast(nn.ModuleList, model.blocks):
        block.compile()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, precision: str, ignored: set[nn.Parameter]) -> None:
    """FSDP2 units: the embedding (with its norm, OLMo-core 3's ``embedding_norm``), each block,
    the final norm with the output head, then the root (holding no parameter of its own). The head unit stays gathered after its forward: backward
    starts there, and resharding would gather it again at once. ``ignored``: parameters left out
    (the experts under expert parallelism)."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    shard([model.embed, model.embed_norm] if model.embed_norm is not None else model.embed)
    for block in cast(nn.ModuleList, model.blocks):
        shard(block)
    shard([model.final_norm, model.lm_head], reshard_after_forward=False)
    shard(model)


def apply_ddp(model: nn.Module, device: torch.device, ignored: set[nn.Parameter]) -> nn.Module:
    if ignored:
        ignore_in_ddp(model, ignored)
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    section: TorchSection,
    precision: str,
    device: torch.device,
    experts: DeviceMesh | None = None,
    *,
    materialize: Callable[[nn.Module], None] | None = None,
    sharded_optimizer: bool = False,
) -> nn.Module:
    """Lay an unchanged model out over the ranks, in torchtitan's order: context parallelism
    (``section.context_parallel``: the context group installed as ``model.context``), expert
    parallelism (over ``experts``), activation checkpointing, compile, FSDP2/HSDP over ``mesh``; then a
    model built on the meta device is materialised by ``materialize`` (storage for this rank's
    shards only, and their values), the expert gradients are hooked and, last, DDP wraps it
    (DDP needs values: it checks and broadcasts them when built).

    ``sharded_optimizer`` (``optim.sharded`` under ``ddp``): no DDP wrapper and no expert gradient
    hook; the fp32 masters of ``sharded_optimizer.attach_sharded_masters`` reduce-scatter every
    gradient instead (DDP's all-reduce would reduce them twice).

    Every step but DDP works on a meta model; an initialised one is accepted too (the shards are
    then cut from its values). Returns the module to call (the same object except for DDP)."""
    if on_meta(model) and materialize is None:
        raise ValueError("parallelize: the model is on the meta device; pass materialize= to give it values")
    context = build_context(section, device.type)
    if context is not None:
        if not isinstance(model, OlmoModel):
            raise TypeError(f"parallelize: context parallelism needs an OlmoModel, got {type(model).__name__}")
        context.compiled = section.compile
        model.context = context
    if experts is not None:
        apply_expert_parallel(model, experts)
    if section.activation_checkpointing:
        apply_activation_checkpointing(model)
    if section.compile:
        apply_compile(model)
    ignored = set(expert_parameters(model)) if experts is not None else set()
    if mesh is not None and section.parallel in ("fsdp", "hsdp"):
        apply_fsdp(model, mesh, precision, ignored)
    if materialize is not None:
        materialize(model)
    if sharded_optimizer:
        if mesh is None or section.parallel != "ddp":
            raise ValueError("parallelize: sharded_optimizer needs torch.parallel=ddp and a data-parallel mesh")
        attach_sharded_masters(model, mesh, experts, precision)
        return model
    if experts is not None:
        # After materialize, which may replace the expert parameters (to_empty).
        edp = experts["edp"]
        ignored = hook_expert_gradients(model, experts.size(), edp.get_group() if edp.size() > 1 else None)
    if mesh is not None and section.parallel == "ddp":
        return apply_ddp(model, device, ignored)
    return model


def uses_fsdp_precision(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def autocast_context(model: nn.Module, precision: str, device: torch.device):
    """bf16 compute for modes without FSDP's mixed precision; a no-op otherwise."""
    if precision == "bf16" and not uses_fsdp_precision(model):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gradient_sync(model: nn.Module, enabled: bool):
    """On accumulation micro-steps that are not the last one (``enabled`` False): DDP skips its
    all-reduce, HSDP its all-reduce across replicas. FSDP2 still reduce-scatters every micro-step
    and accumulates the sharded gradients: skipping it would keep a full unsharded fp32 gradient
    on every rank until the last micro-step (4 bytes per parameter: 129 GB for olmo3-32b). The
    sharded optimizer's masters reduce-scatter on the last micro-step only."""
    if (masters := sharded_masters_of(model)) is not None:
        return masters.syncing(enabled)
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The OlmoModel inside a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
