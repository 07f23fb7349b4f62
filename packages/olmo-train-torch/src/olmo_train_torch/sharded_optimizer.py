"""A sharded optimizer state for ``torch.parallel: ddp`` (``optim.sharded: true``), as OLMo-core 3's
distributed optimizer (branch olmo-ddp, ``optim/moe_optimizer.py``): every rank keeps the full
compute weights, and 1/dp of each large tensor's fp32 master weights and AdamW moments.

Per parameter (one ``_Slot``):

- the master is an fp32 DTensor of the parameter's full shape: ``Shard(dim)`` over the
  data-parallel ranks for a tensor of ``MIN_SHARDED_NUMEL`` elements or more with a dimension
  the ranks divide (the first such), ``Replicate()`` otherwise (OLMo-core's
  ``do_not_shard_tensor_smaller_than = 4096``: a collective per tiny norm weight costs more
  than its bytes). Routed experts under expert parallelism are DTensors ``(Replicate(),
  Shard(0))`` on the ``(edp, ep)`` mesh already; their masters shard over ``edp`` (the ranks
  holding the same experts) on another dimension, ``(Shard(dim), Shard(0))``, so every master
  is a plain block of the full tensor and DCP saves and reshards it like FSDP's shards;
- gradients: a post-accumulate hook reduce-scatters the parameter's gradient in fp32 over its
  group as soon as backward has produced it on the last micro-step (``gradient_sync``), and
  divides by the data-parallel size (dense: the mean over ranks, as DDP; experts: the sum over
  ``edp`` of gradients that already hold every expert-parallel rank's tokens, divided by the
  same size, as ``expert_parallel.hook_expert_gradients``); replicated masters get an
  all-reduce. bf16 compute weights accumulate their micro-steps' gradients in an fp32 buffer;
- the step is ``torch.optim.AdamW`` on the master DTensors (``ShardedAdamW``): the same maths,
  groups, LR and clipping as the unsharded optimizer (the global grad norm over DTensor shards
  is reduced over ranks by DTensor), then the updated masters are all-gathered into the compute
  weights, cast to bf16 when ``train.precision`` is bf16.

Checkpoints (``checkpoint_state``): the masters under the model's parameter names and the
moments under the optimizer's, each a DTensor of the full shape: DCP writes each block once
and loads onto any other layout (another data-parallel size, FSDP2, plain DDP, one process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from olmo_run.decay import DECAY_GROUPS, decay_group, group_weight_decay
from olmo_run.recipe import Recipe

from .expert_parallel import expert_parameters

# OLMo-core's do_not_shard_tensor_smaller_than (moe_optimizer.py): smaller tensors stay replicated.
MIN_SHARDED_NUMEL = 4096


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_dim(shape: torch.Size, ranks: int, skip: int | None = None) -> int | None:
    """The dimension a tensor of ``shape`` is sharded on over ``ranks`` (the first the ranks
    divide, ``skip`` excluded), or None to replicate it (small, or no dimension divides)."""
    if ranks == 1 or shape.numel() < MIN_SHARDED_NUMEL:
        return None
    return next((i for i, n in enumerate(shape) if i != skip and n % ranks == 0), None)


@dataclass
class _Slot:
    """One parameter: its compute weight, its fp32 master, and how the master is laid out."""

    fqn: str  # the name checkpoints use (wrappers' prefixes removed)
    param: nn.Parameter  # the compute weight (full local tensor, or the expert-parallel DTensor)
    master: nn.Parameter  # fp32 DTensor of the full shape
    group: Any  # the process group the gradient is reduced over and the master gathered from
    dim: int | None  # dimension of the local weight sharded over ``group``; None: replicated
    acc: torch.Tensor | None = field(default=None)  # fp32 gradient of earlier micro-steps (bf16 weights)

    def reduce(self, grad: torch.Tensor, dp_size: int) -> None:
        """Reduce-scatter (or all-reduce) ``grad``, this rank's fp32 gradient, into the master's."""
        if self.dim is None:
            dist.all_reduce(grad, group=self.group)
            out = grad
        else:
            moved = grad.movedim(self.dim, 0).contiguous()
            out = moved.new_empty((moved.shape[0] // dist.get_world_size(self.group), *moved.shape[1:]))
            dist.reduce_scatter_tensor(out, moved, group=self.group)
            out = out.movedim(0, self.dim).contiguous()
        out.div_(dp_size)
        m = self.master
        assert isinstance(m, DTensor)  # a Parameter of a DTensor is a DTensor
        self.master.grad = DTensor.from_local(
            out, m.device_mesh, m.placements, run_check=False, shape=m.shape, stride=m.stride()
        )

    @torch.no_grad()
    def gather(self) -> None:
        """The master's blocks all-gathered over the group into the compute weight."""
        local, target = _local(self.master), _local(self.param)
        if self.dim is None:
            target.copy_(local)
            return
        moved = local.movedim(self.dim, 0).contiguous()
        full = moved.new_empty((moved.shape[0] * dist.get_world_size(self.group), *moved.shape[1:]))
        dist.all_gather_into_tensor(full, moved, group=self.group)
        target.copy_(full.movedim(0, self.dim))


class ShardedMasters:
    """The fp32 masters of a model's parameters and their gradient reduction (see the module
    doc); ``parallelize`` attaches one to the model as ``model.sharded_masters``."""

    def __init__(self, slots: list[_Slot], dp_size: int):
        self.slots = slots
        self.dp_size = dp_size
        self.sync = True  # reduce on this backward (False on accumulation micro-steps but the last)
        for slot in slots:  # a frozen router (random / uniform routing) gets no gradient to reduce
            if slot.param.requires_grad:
                slot.param.register_post_accumulate_grad_hook(lambda _p, s=slot: self._on_grad(s))

    def _on_grad(self, slot: _Slot) -> None:
        p = slot.param
        assert p.grad is not None  # a post-accumulate hook runs on a produced gradient
        grad = _local(p.grad)
        if grad.dtype != torch.float32:  # bf16 weights: micro-steps accumulate in fp32
            slot.acc = grad.float() if slot.acc is None else slot.acc.add_(grad)
            p.grad = None
        if not self.sync:
            return
        full = grad if slot.acc is None else slot.acc
        slot.acc, p.grad = None, None
        slot.reduce(full, self.dp_size)

    @contextlib.contextmanager
    def syncing(self, enabled: bool) -> Iterator[None]:
        self.sync = enabled
        try:
            yield
        finally:
            self.sync = True

    def gather(self) -> None:
        for slot in self.slots:
            slot.gather()

    def clear(self) -> None:
        """Drop the gradients of a finished (or skipped) step."""
        for slot in self.slots:
            slot.acc, slot.param.grad, slot.master.grad = None, None, None

    def by_name(self) -> dict[str, nn.Parameter]:
        return {s.fqn: s.master for s in self.slots}


def _master_layout(
    p: torch.Tensor, mesh: DeviceMesh, experts: DeviceMesh | None, is_expert: bool
) -> tuple[DeviceMesh, list[Placement], Any, int | None]:
    """(mesh, placements, group, local dimension) of the master of compute weight ``p``."""
    if is_expert and experts is not None:
        edp = experts["edp"]
        dim = shard_dim(_local(p).shape, edp.size(), skip=0)  # dim 0 is the expert-parallel split
        return experts, [Replicate() if dim is None else Shard(dim), Shard(0)], edp.get_group(), dim
    dim = shard_dim(p.shape, mesh.size())
    return mesh, [Replicate() if dim is None else Shard(dim)], mesh.get_group(), dim


def attach_sharded_masters(model: nn.Module, mesh: DeviceMesh, experts: DeviceMesh | None, precision: str) -> None:
    """Make the fp32 masters of every parameter of a materialised model from its values, cast the
    compute weights to bf16 if ``precision`` is bf16, and hook their gradients."""
    expert_ids = {id(p) for p in expert_parameters(model)}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    slots = []
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}".lstrip(".").replace(_CHECKPOINT_PREFIX, "")
            m_mesh, placements, group, dim = _master_layout(p, mesh, experts, id(p) in expert_ids)
            local = _local(p).detach().float()
            if dim is not None:
                rank = dist.get_rank(group)
                local = local.chunk(dist.get_world_size(group), dim)[rank]
            master = DTensor.from_local(
                local.clone(), m_mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            weight = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            setattr(module, name, weight)
            slots.append(_Slot(fqn, weight, nn.Parameter(master, requires_grad=p.requires_grad), group, dim))
    # A plain attribute (nn.Module.__setattr__ is typed for tensors and modules only).
    object.__setattr__(model, "sharded_masters", ShardedMasters(slots, mesh.size()))


def sharded_masters_of(model: nn.Module) -> ShardedMasters | None:
    masters = getattr(model, "sharded_masters", None)
    return masters if isinstance(masters, ShardedMasters) else None


class ShardedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over the masters of ``masters`` (groups as ``step.param_groups``,
    named by ``olmo_run.decay``), its moments made at once (so checkpoints load into them);
    ``step`` all-gathers the updated masters into the compute weights."""

    def __init__(self, masters: ShardedMasters, recipe: Recipe, **kwargs: Any):
        o = recipe.optim
        members: dict[str, list[nn.Parameter]] = {g: [] for g in DECAY_GROUPS}
        for slot in masters.slots:
            members[decay_group(slot.fqn)].append(slot.master)
        groups = [
            {"name": g, "params": ps, "weight_decay": group_weight_decay(g, o)} for g, ps in members.items() if ps
        ]
        super().__init__(groups, lr=o.lr, betas=o.betas, eps=o.eps, **kwargs)
        self.masters = masters
        on_device = bool(kwargs.get("fused"))  # torch keeps a fused AdamW's step count on the device
        for group in self.param_groups:
            for m in group["params"]:
                self.state[m] = {
                    "step": torch.zeros((), dtype=torch.float32, device=m.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
                }

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.masters.gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.masters.clear()

    def local_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: masters, moments and step counts."""
        tensors = [m for g in self.param_groups for m in g["params"]]
        tensors += [v for st in self.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return sum(_local(t).numel() * t.element_size() for t in tensors)

    def checkpoint_state(self, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state dicts as ``get_state_dict`` names them: ``model_state`` and
        the moments and step counts under the parameter names. DCP loads into them in place."""
        msd = model_state(model, self.masters)
        fqn = {id(m): n for n, m in self.masters.by_name().items()}
        state = {fqn[id(m)]: st for m, st in self.state.items()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[id(m)] for m in g["params"]]}
            for g in self.param_groups
        ]
        return msd, {"state": state, "param_groups": groups}


def model_state(model: nn.Module, masters: ShardedMasters) -> dict[str, Any]:
    """``get_model_state_dict(model)`` with the masters in place of the compute weights (the fp32
    values whatever ``train.precision``); after DCP loads into it, ``masters.gather()``
    refreshes the compute weights."""
    msd = get_model_state_dict(model)
    names = masters.by_name()
    if not names.keys() <= msd.keys():
        raise RuntimeError(f"sharded optimizer: names {sorted(names.keys() - msd.keys())} are not the model's")
    msd.update(names)
    return msd
