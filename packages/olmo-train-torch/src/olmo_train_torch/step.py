"""The torch trainer's step: the model built and parallelized (``start_model``), AdamW, and one
optimizer step ``s`` (1-based) over a global batch of sequences, identically to the JAX trainer
(``olmo_train_jax.step``):

- the global batch is ``MixtureLoader.batch_at(s - 1)``; this rank holds rows
  ``[r*B/R, (r+1)*B/R)``, split into ``accumulation_steps`` micro-batches; with
  ``torch.context_parallel = C`` the C consecutive ranks of a context group share one such slice
  (``r`` and ``R`` count data-parallel ranks: ``rank // C`` of ``world / C``) and each keeps its
  columns of it (``context_parallel.py``);
- the loss is normalised by the number of valid labels (!= -100) in the whole global batch
  (all-reduced before the first micro-step), not averaged per rank or micro-batch:
  ``ce = sum CE / n``, ``z = sum logsumexp(logits)^2 / n``, ``loss = ce + spec.z_loss_weight * z``,
  logits and logsumexp in float32. The data-parallel reduction (FSDP reduce-scatter, DDP
  all-reduce) averages gradients over ranks, so each rank's loss is scaled by the rank count;
  the sum of the ranks' gradients is then exactly the gradient of the global loss;
- with ``train.document_masking`` the batch's ``doc_ids`` go to the model, so attention stays
  within a document; off (Olmo 3), a query sees the earlier documents of its window and global
  layers keep the fused causal kernel;
- grad norm: global L2 over all gradients in float32 (DTensor shards included), logged
  before clipping; clipping multiplies by ``min(1, clip / (norm + 1e-6))`` as
  ``torch.nn.utils.clip_grad_norm_``;
- AdamW (``torch.optim.AdamW``, decoupled decay ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``),
  LR ``recipe.schedule.lr(s, optim.lr, total)`` set on the host every step; no decay on the
  input embedding unless ``optim.decay_embeddings``; norms decayed iff ``optim.decay_norms``;
- nothing is read to the host: the step's figures stay on the device (``StepStats``; the
  driver reads them every ``log.every`` steps, ``host_values``); the spike guard decides on
  the device (``spike_guard.DeviceSpikeGuard``), and a skipped step leaves parameters, moments
  and Adam's step count as they were (``spike_guard.step_unless``) and still consumes its
  batch;
- MoE specs: each micro-step adds the aux losses of its global micro-batch (weighted by the
  spec, zero unless ``moe.routing`` is learned), scaled by the rank count like the CE and
  averaged over micro-steps; ``moe.routing`` and ``moe.mxfp8`` set the block's runtime knobs
  (``moe.configure_moe``), random routing is seeded by (train.seed, step, micro-step,
  layer); ``torch.expert_parallel`` splits the routed experts over that many ranks
  (``parallelize``); the train line carries the ``moe_*`` metrics, the per-rank load for
  that expert-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from olmo_data.order import IGNORE_INDEX  # the loader's label for "no next token"
from olmo_model import ModelSpec
from olmo_run.decay import DECAY_GROUPS, decay_group, group_weight_decay
from olmo_run.recipe import BatchLayout, Recipe

from .hf_adapter import SafetensorsBlocks, fill_local_shards, init_reader
from .model import OlmoModel
from .moe import (
    RoutingStats,
    aux_loss,
    configure_moe,
    merge_micro_steps,
    moe_metrics,
    routing_stats,
    set_routing_step,
)
from .parallelize import (
    Distributed,
    autocast_context,
    context_of,
    gradient_sync,
    parallelize,
    unwrap,
)
from .sharded_optimizer import ShardedAdamW, sharded_masters_of
from .spike_guard import DeviceSpikeGuard, step_unless

# torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6); the JAX trainer writes the same.
CLIP_EPS = 1e-6


def param_groups(model: nn.Module, recipe: Recipe) -> list[dict[str, Any]]:
    """AdamW groups by ``olmo_run.decay``'s groups of the parameter names: matrices / experts /
    embedding / norms (the name travels in checkpoints). The routed experts of MoE specs have a
    group of their own, whatever the parallel layout (so checkpoints move between layouts):
    under expert parallelism they are DTensors while DDP's dense parameters are plain tensors,
    and one foreach kernel cannot take both."""
    members: dict[str, list[nn.Parameter]] = {g: [] for g in DECAY_GROUPS}
    for name, p in unwrap(model).named_parameters():
        members[decay_group(name)].append(p)
    return [
        {"name": g, "params": ps, "weight_decay": group_weight_decay(g, recipe.optim)}
        for g, ps in members.items()
        if ps
    ]


def make_optimizer(model: nn.Module, recipe: Recipe, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's parameters; with ``optim.sharded``, ``ShardedAdamW`` over the fp32
    masters ``parallelize`` attached (1/dp of each large tensor per rank)."""
    o = recipe.optim
    # fused kernels on GPU; foreach (multi-tensor) on CPU, where it is the fastest exact path.
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    masters = sharded_masters_of(unwrap(model))
    if o.sharded != (masters is not None):
        raise ValueError(f"make_optimizer: optim.sharded={o.sharded}, but the model was parallelized for the other")
    if masters is not None:
        return ShardedAdamW(masters, recipe, **fast)
    return torch.optim.AdamW(param_groups(model, recipe), lr=o.lr, betas=o.betas, eps=o.eps, **fast)


def apply_recipe_hyperparams(optimizer: torch.optim.Optimizer, recipe: Recipe) -> None:
    """After loading optimizer state: the recipe, not the checkpoint, decides betas, eps and
    weight decay (the moments and step count come from the checkpoint)."""
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = recipe.optim.betas, recipe.optim.eps
        group["weight_decay"] = group_weight_decay(group["name"], recipe.optim)


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by DTensor mesh (plain tensors together): a foreach kernel takes
    one kind only, and expert parallelism puts the experts on a mesh of their own."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def grad_global_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients (float32); a sharded DTensor norm is reduced over ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_gradients(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` on each mesh's gradients with the global norm."""
    with_grad = [p for p in params if p.grad is not None]
    for group in _by_mesh(with_grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


@dataclass
class StepStats:
    """One step's figures as device tensors, unread: loss, ce_loss and z_loss (float64, over the
    global batch; loss = ce + z_loss_weight x z + the MoE aux term), the grad norm (float32,
    before clipping), whether the spike guard skipped the update (a bool tensor; False without
    the guard) and, for MoE specs, the step's routing statistics."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    z_loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor | bool
    moe: RoutingStats | None = None

    def values(self) -> dict[str, Any]:
        """The figures by train-line key (the routing statistics as "moe"), still on the device."""
        keys = ("loss", "ce_loss", "z_loss", "grad_norm", "skipped")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        if self.moe is not None:
            out["moe"] = self.moe
        return out

    def read(self, ep_size: int = 1) -> dict[str, Any]:
        """The figures on the host (``host_values``)."""
        return host_values([self.values()], ep_size)[0]


def _routing_fields(stats: RoutingStats) -> list[torch.Tensor]:
    return [stats.load_balancing, stats.router_z, stats.tokens_per_expert, stats.dropped]


def host_values(steps: list[dict[str, Any]], ep_size: int) -> list[dict[str, Any]]:
    """Each step's recorded values with every tensor read to the host in ONE transfer (as
    float64: exact for float32 values and for counts below 2^53): a one-element tensor becomes a
    bool, int or float by its dtype, a longer one a list, a ``RoutingStats`` the moe_* keys in
    its place (``moe_metrics``, ``ep_size`` ranks for the load figure); host values pass
    through."""
    tensors = []
    for values in steps:
        for v in values.values():
            if isinstance(v, RoutingStats):
                tensors += _routing_fields(v)
            elif isinstance(v, torch.Tensor):
                tensors.append(v)
    if not tensors:
        return [dict(values) for values in steps]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).cpu()
    pieces = iter(torch.split(flat, [t.numel() for t in tensors]))

    def host(t: torch.Tensor) -> Any:
        got = next(pieces).to(t.dtype)
        return got.tolist() if t.dim() > 0 else got.item()

    out = []
    for values in steps:
        row: dict[str, Any] = {}
        for k, v in values.items():
            if isinstance(v, RoutingStats):
                read = RoutingStats(*(next(pieces).to(t.dtype).reshape(t.shape) for t in _routing_fields(v)))
                row.update(moe_metrics(read, ep_size))
            else:
                row[k] = host(v) if isinstance(v, torch.Tensor) else v
        out.append(row)
    return out


def accumulate_gradients(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    layout: BatchLayout,
    d: Distributed,
    spec: ModelSpec,
    recipe: Recipe,
    step: int = 1,
    micro_steps: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[RoutingStats]]:
    """Forward and backward of this rank's micro-batches (``tensors``: its rows of the global
    batch); gradients reduced over the ranks after the last micro-step. Returns (this rank's
    float64 [CE sum, z sum], the global valid-label count, each micro-step's MoE aux losses),
    reading nothing back to the host. ``micro_steps``: which of the accumulation micro-steps to
    run (default all; the dry run runs the first two and the last, whose memory the others repeat)."""
    device = d.device
    context = context_of(model)
    if context is not None:  # context parallelism: this rank's columns of its rows
        tensors = {k: context.shard(v) for k, v in tensors.items()}
    # float64 counts and sums: exact token counts for global batches beyond 2^24 tokens.
    count = (tensors["labels"] != IGNORE_INDEX).sum().to(torch.float64)
    n_global = d.all_reduce_sum(count).clamp_min(1.0)
    # Gradients are averaged over data-parallel ranks by FSDP/DDP: scale up by the rank count.
    scale = (d.world_size / n_global).to(torch.float32)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    micro = layout.per_device_batch
    moe_terms = []  # per micro-step MoE aux losses of the global micro-batch
    moe_group = dist.group.WORLD if d.initialized and d.world_size > 1 else None
    routing = recipe.moe.routing
    last = layout.accumulation_steps - 1
    for i in range(layout.accumulation_steps) if micro_steps is None else micro_steps:
        rows = slice(i * micro, (i + 1) * micro)
        if spec.moe is not None:
            set_routing_step(model, step, i)
        with gradient_sync(model, i == last):
            with autocast_context(model, recipe.train.precision, device):
                doc_ids = tensors["doc_ids"][rows] if recipe.train.document_masking else None
                # Head + CE + z-loss fused over token chunks (head_loss.py): [objective, ce, z].
                out = model(tensors["input_ids"][rows], doc_ids, labels=tensors["labels"][rows])
            objective, ce, z = out.loss_sums.unbind()
            step_loss = objective * scale
            if out.moe:
                # Global values, gradient through this rank's tokens: scaled by the rank count
                # like the CE (the wrapper averages), averaged over micro-steps.
                aux = routing_stats(out.moe, group=moe_group)
                assert spec.moe is not None  # only MoE layers return stats
                step_loss = step_loss + aux_loss(aux, spec.moe, routing) * (d.world_size / layout.accumulation_steps)
                moe_terms.append(aux)
            step_loss.backward()
        sums += torch.stack([ce.detach(), z.detach()]).double()
    return sums, n_global, moe_terms


def batch_tensor(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """``rows`` as int64 on ``device``. To a GPU from pinned memory without waiting: a copy from
    pageable memory waits for the stream (a synchronisation every step)."""
    t = torch.from_numpy(rows.astype(np.int64, copy=False))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, np.ndarray],
    *,
    layout: BatchLayout,
    d: Distributed,
    spec: ModelSpec,
    recipe: Recipe,
    lr: float,
    guard: DeviceSpikeGuard | None = None,
    step: int = 1,
) -> StepStats:
    """One optimizer step (1-based ``step``, which seeds random MoE routing) over this
    rank's slice of a global batch, reading nothing to the host: its figures stay on the
    device (``StepStats.read`` reads them); ``guard`` (None: no spike guard) decides there
    whether the update is undone (``spike_guard.step_unless``)."""
    tensors = {k: batch_tensor(batch[k], d.device) for k in ("input_ids", "labels", "doc_ids")}
    sums, n_global, moe_terms = accumulate_gradients(
        model, tensors, layout=layout, d=d, spec=spec, recipe=recipe, step=step
    )
    d.all_reduce_sum(sums)
    ce_mean, z_mean = (sums / n_global).unbind()
    # float64, in the order Python added the read values: the same numbers on the host.
    loss = ce_mean + spec.z_loss_weight * z_mean
    moe = None
    if moe_terms:
        moe = merge_micro_steps(moe_terms)
        assert spec.moe is not None  # only MoE layers return stats
        loss = loss + aux_loss(moe, spec.moe, recipe.moe.routing).detach().double()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = grad_global_norm(params)
    skip = guard.skip(loss, norm) if guard is not None else None
    if recipe.optim.grad_clip is not None:
        clip_gradients(params, recipe.optim.grad_clip, norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
    step_unless(optimizer, model, skip)
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss, ce_mean, z_mean, norm, False if skip is None else skip, moe)


def state_is_finite(model: nn.Module, optimizer: torch.optim.Optimizer, d: Distributed) -> bool:
    """Whether every parameter and optimizer moment is finite on every rank (each rank checks
    its own shards; one all-reduce of the count of non-finite tensors)."""
    tensors = [
        *model.parameters(),
        *(
            v
            for st in optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        ),
    ]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    # One read: the count of non-finite tensors summed on the device, then over the ranks.
    # (AdamW's step counts may live on the host: each flag goes to the device.)
    bad = torch.stack([(~torch.isfinite(t.detach()).all()).to(d.device) for t in local]).sum().to(torch.float64)
    return d.all_reduce_sum(bad).item() == 0


@torch.no_grad()
def eval_sums(model: nn.Module, batch: dict[str, np.ndarray], d: Distributed, recipe: Recipe) -> tuple[float, float]:
    """(CE sum, valid tokens) of one held-out batch over all ranks. A batch whose rows divide
    over the (data-parallel) ranks is split; otherwise every rank runs it whole (sharded weights
    need every rank in each forward) and only rank 0's sums count (under context parallelism:
    its context group's, each rank its own columns)."""
    context = context_of(model)
    dp_rank, dp_size = (context.dp_rank, context.dp_size) if context is not None else (d.rank, d.world_size)
    rows = batch["input_ids"].shape[0]
    if rows % dp_size == 0:
        per = rows // dp_size
        part, counts = slice(dp_rank * per, (dp_rank + 1) * per), True
    else:
        part, counts = slice(0, rows), dp_rank == 0
    t = {k: torch.from_numpy(batch[k][part]).to(d.device, dtype=torch.long) for k in ("input_ids", "labels", "doc_ids")}
    if context is not None:
        t = {k: context.shard(v) for k, v in t.items()}
    with autocast_context(model, recipe.train.precision, d.device):
        loss_sums = model(
            t["input_ids"], t["doc_ids"] if recipe.train.document_masking else None, labels=t["labels"]
        ).loss_sums
    sums = torch.zeros(2, dtype=torch.float64, device=d.device)
    if counts:
        sums += torch.stack([loss_sums[1].double(), (t["labels"] != IGNORE_INDEX).sum().double()])
    d.all_reduce_sum(sums)
    ce, n = sums.tolist()
    return ce, n


def prepare_model(
    model: OlmoModel,
    recipe: Recipe,
    d: Distributed,
    mesh: DeviceMesh | None,
    experts: DeviceMesh | None,
    *,
    materialize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The recipe's MoE knobs (``moe.routing``, ``moe.mxfp8``; this rank's place among the
    data-parallel ranks) on a freshly built model, then ``parallelize`` (expert parallelism
    over ``experts``, the ``torch.parallel`` wrapper over ``mesh``; ``materialize`` gives a
    model built on the meta device its storage and values)."""
    if model.spec.moe is not None:
        configure_moe(
            model,
            routing=recipe.moe.routing,
            seed=recipe.train.seed,
            dp_rank=d.rank,
            dp_size=d.world_size,
            mxfp8=recipe.moe.mxfp8,
            capacity_factor=recipe.moe.capacity_factor,
        )
    return parallelize(
        model,
        mesh,
        recipe.torch,
        recipe.train.precision,
        d.device,
        experts,
        materialize=materialize,
        sharded_optimizer=recipe.optim.sharded,
    )


def start_model(
    recipe: Recipe,
    spec: ModelSpec,
    d: Distributed,
    mesh: DeviceMesh | None,
    experts: DeviceMesh | None,
    *,
    hf_files: list[Path] | None = None,
    allocate_only: bool = False,
) -> nn.Module:
    """The trainer's start-up: build on the meta device, ``prepare_model`` (parallelize), then
    allocate this rank's shards only (``to_empty``) and fill them: from ``olmo_model.init`` for
    ``train.seed``, from the blocks of the HF ``hf_files`` this rank holds (headers checked
    first), or not at all with ``allocate_only`` (a DCP checkpoint is loaded into them next, or
    the dry run measures memory). No rank holds the full model unless the layout gives it one
    (DDP, one process)."""

    def materialize(model: nn.Module) -> None:
        model.to_empty(device=d.device)
        if allocate_only:
            return
        if hf_files is None:
            fill_local_shards(model, init_reader(spec, recipe.train.seed))
            return
        with SafetensorsBlocks(hf_files) as blocks:
            blocks.validate(spec, f"init.checkpoint={recipe.init.checkpoint}")
            fill_local_shards(model, blocks)

    with torch.device("meta"):
        model = OlmoModel(spec)
    return prepare_model(model, recipe, d, mesh, experts, materialize=materialize)
