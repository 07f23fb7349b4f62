"""Expert parallelism for the torch MoE blocks, applied from outside the model.

Each rank of an expert-parallel group of size ``ep`` keeps a contiguous slice of
``E / ep`` experts of every MoE layer (rank r: experts ``[r*E/ep, (r+1)*E/ep)``); the
router, the shared experts and every dense part stay replicated (data parallel).
One MoE forward on a rank:

1. the block routes its own tokens and sorts the (token, slot) assignments by expert
   (``moe.MoE``); ``sizes[e]`` counts them;
2. the per-expert counts are exchanged with one ``all_to_all_single`` of E integers, so
   every rank knows how many rows each source sends for each of its experts;
3. the split sizes go to the host (``.tolist()``: the one host sync of the routing path
   on GPU; ``all_to_all_single`` takes Python split lists, as in torchtitan) and the
   rows move by ``all_to_all_single`` (dispatch); they arrive ordered by (source rank,
   expert) and are regrouped by (expert, source rank) with a stable argsort;
4. the local experts run one grouped GEMM per projection;
5. the inverse permutation and a second ``all_to_all_single`` (combine) return every
   row to its source, in the order it was sent; the block weights and sums them.

With a capacity factor (``moe.capacity_factor``; ``capacity``) the block hands the dispatcher
a static buffer of E x B x C rows instead (``ExpertParallelDispatcher.exchange``): one
``all_to_all_single`` of equal splits sends rank r the rows of its E/ep experts, which it
regroups by expert with a transpose (every (source, expert) block has B x C rows), runs as
batched matmuls, and sends back with a second equal exchange. No split sizes, no counts, no
host read: every shape follows from (B, S, k, E, C, ep), so the path also runs under a fake
process group, whose all-to-all outputs are garbage.

Both all-to-alls are autograd functions whose backward is the opposite all-to-all, so
expert gradients collect the contributions of every rank's tokens. gloo (CPU) supports
``all_to_all_single`` with uneven splits in torch 2.15 (checked), NCCL does on GPU.

Where the expert shards live: ``apply_expert_parallel`` takes a process group (the
shards stay plain tensors: enough for a training loop that never checkpoints) or a
DeviceMesh whose last axis is named ``ep`` (``expert_mesh``: ``(edp, ep)``, ``edp``
replicas of each expert slice); then the expert weights become DTensors ``Shard(0)`` on
``ep`` and ``Replicate()`` on ``edp``, so ``get_state_dict`` / DCP save every shard once
under the full [E, ...] shape and load them onto any other expert-parallel size (or onto
an unsharded model), and the AdamW moments follow the same layout.

Two gradient conventions:

- summed (``reduce_gradients``, no wrapper): each rank's loss is its share of the global
  loss (its tokens' CE over the global token count, plus the aux losses whose gradient
  flows through its own tokens, ``moe.routing_stats``); dense gradients are summed over
  the data-parallel group, expert gradients over the ranks that hold the same experts
  (``expert_dp_group``; None when ep equals the data-parallel size);
- averaged (DDP / FSDP2 on the dense parts, ``prepare_expert_parallel``): each rank's loss
  is scaled by the data-parallel size and the wrapper averages dense gradients; the expert
  weights are left out of the wrapper (``ignored_params``) and a gradient hook divides
  their incoming gradients by the data-parallel size (and sums them over
  ``expert_dp_group``), which gives the same gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .grouped_gemm import GroupedExperts
from .moe import moe_modules


def _rows(x: torch.Tensor, splits: list[int] | None) -> int:
    return x.shape[0] if splits is None else sum(splits)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (uneven splits, or equal ones for None); backward is the
    reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((_rows(x, out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((_rows(grad, ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """Send ``in_splits[r]`` consecutive rows of ``x`` to rank r, receive ``out_splits[r]``
    rows from rank r (differentiable); None for both: equal splits of x's rows, no host list."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelDispatcher:
    """Moves sorted rows to the ranks owning their experts and back (see module doc).

    ``last_received`` is the number of rows this rank's experts computed in the latest
    dropless forward (the real per-rank load, for metrics and tests)."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        if n_experts % self.ep:
            raise ValueError(
                f"expert parallel: n_experts={n_experts} is not divisible by the expert-parallel size {self.ep}; "
                "choose an ep size that divides moe.n_experts"
            )
        self.local_experts = n_experts // self.ep
        self.last_received = 0

    def __call__(self, xs: torch.Tensor, sizes: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """``xs`` [N, d] sorted by global expert, ``sizes`` [E] -> expert outputs [N, d], same order."""
        ep, local = self.ep, self.local_experts
        recv_sizes = torch.empty_like(sizes)
        dist.all_to_all_single(recv_sizes, sizes.contiguous(), group=self.group)
        by_source = recv_sizes.reshape(ep, local)  # [source rank, local expert]
        # The host needs the split sizes for all_to_all_single: the one sync of this path.
        send_splits = sizes.reshape(ep, local).sum(1).tolist()
        recv_splits = by_source.sum(1).tolist()
        received = all_to_all_rows(xs, recv_splits, send_splits, self.group)
        total = sum(recv_splits)
        self.last_received = total
        segment = torch.repeat_interleave(
            torch.arange(ep * local, device=xs.device), by_source.reshape(-1), output_size=total
        )
        source, expert = segment // local, segment % local
        # Stable: rows of one (expert, source) pair keep the order they were sent in.
        perm = torch.argsort(expert * ep + source, stable=True)
        ys_local = experts(received[perm], by_source.sum(0))
        ys = torch.empty_like(ys_local).index_copy(0, perm, ys_local)
        return all_to_all_rows(ys, send_splits, recv_splits, self.group)

    def exchange(self, buffer: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """The capacity buffer [E x B x C, d] (expert-major, ``capacity``) -> its expert outputs,
        same layout: equal exchanges both ways, no split sizes (module doc)."""
        ep, local, d = self.ep, self.local_experts, buffer.shape[-1]
        received = all_to_all_rows(buffer, None, None, self.group)  # [source, local expert, B x C]
        by_expert = received.view(ep, local, -1, d).transpose(0, 1).reshape(local, -1, d)
        out = experts.forward_batched(by_expert)
        by_source = out.view(local, ep, -1, d).transpose(0, 1).reshape(-1, d)
        return all_to_all_rows(by_source, None, None, self.group)


def expert_mesh(device_type: str, world_size: int, ep: int) -> DeviceMesh:
    """The ``(edp, ep)`` mesh of ``world_size`` ranks: expert-parallel groups of ``ep``
    consecutive ranks (one node's fast links first), ``world_size / ep`` replicas of them."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {world_size} ranks; choose a divisor")
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("edp", "ep"))


def apply_expert_parallel(model: nn.Module, group) -> None:
    """Keep this rank's contiguous slice of every MoE layer's experts and route tokens
    through the expert-parallel group: ``group`` is a process group (plain local shards),
    or a DeviceMesh whose last axis is ``ep`` (1-D, or ``expert_mesh``'s ``(edp, ep)``;
    the shards become DTensors, see the module doc). Call it on a model built on the meta
    device (the shards get their values later, ``olmo_train_torch.parallelize``), or after the
    weights are initialised or loaded (every rank must hold the same full weights then)."""
    mesh = group if isinstance(group, DeviceMesh) else None
    if mesh is not None:
        if mesh.mesh_dim_names is None or mesh.mesh_dim_names[-1] != "ep":
            raise ValueError(f"expert parallel: the mesh's last axis must be named 'ep', got {mesh.mesh_dim_names}")
        group = mesh.get_group("ep")
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    rank = dist.get_rank(group)
    for moe in moe_modules(model):
        dispatcher = ExpertParallelDispatcher(group, moe.spec.n_experts)
        lo = rank * dispatcher.local_experts
        hi = lo + dispatcher.local_experts
        experts = moe.experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(experts, name)
            shard = full.detach()[lo:hi].clone()
            if mesh is not None:
                shard = DTensor.from_local(shard, mesh, placements, run_check=False)
            setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        moe.dispatcher = dispatcher


def prepare_expert_parallel(model: nn.Module, ep_group, dp_size: int, expert_dp_group=None) -> set[nn.Parameter]:
    """Expert parallelism under a data-parallel wrapper that averages gradients over
    ``dp_size`` ranks (the averaged convention in the module doc): shard the experts over
    ``ep_group`` and hook their gradients. Returns the expert parameters, which the wrapper
    must ignore: ``fully_shard(..., ignored_params=...)`` or ``ignore_in_ddp``."""
    apply_expert_parallel(model, ep_group)
    return hook_expert_gradients(model, dp_size, expert_dp_group)


def hook_expert_gradients(model: nn.Module, dp_size: int, expert_dp_group=None) -> set[nn.Parameter]:
    """The gradient hook of ``prepare_expert_parallel`` on the (already sharded) expert weights;
    returns them. Hooks live on the parameter objects, so this runs after anything that replaces
    them (``to_empty`` on a meta model)."""
    params = set(expert_parameters(model))

    def to_sum(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / dp_size
        if expert_dp_group is not None:
            # In place on the local shard (a DTensor gradient knows nothing of the replicas).
            dist.all_reduce(_local(grad), group=expert_dp_group)
        return grad

    for p in params:
        # A hook on the incoming gradient (not post-accumulate): with gradient accumulation
        # each micro-step's share is scaled once.
        p.register_hook(to_sum)
    return params


def ignore_in_ddp(model: nn.Module, params: set[nn.Parameter]) -> None:
    """Tell a DistributedDataParallel built afterwards on ``model`` to leave ``params`` alone."""
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights (sharded by expert parallelism, not data-parallel)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter that is replicated over the data-parallel ranks."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sum_gradients(params: list[nn.Parameter], group) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` as one flat buffer."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_gradients(model: nn.Module, dp_group, expert_dp_group=None) -> None:
    """Sum gradients over ranks (the summed convention in the module doc): dense ones over
    ``dp_group``, expert ones over ``expert_dp_group`` (if any); one all-reduce each.
    (None means no such group here, never the default group.)"""
    if dp_group is not None:
        sum_gradients(dense_parameters(model), dp_group)
    if expert_dp_group is not None:
        sum_gradients(expert_parameters(model), expert_dp_group)
