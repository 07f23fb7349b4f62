"""``olmo-train-torch RECIPE.yaml --dry-run --devices KIND:COUNT [--json]``: rank 0's memory for one
training step of the recipe on COUNT ranks, measured on this (CPU) machine without the GPUs and
without real weights (torchtitan's fake-backend validation; contract 7).

This process joins a fake process group of COUNT ranks as rank 0 (``torch.distributed``'s
"fake" backend: collectives return at once, nothing is sent), builds the mesh and starts the
model as the trainer does (``step.start_model``: meta, ``prepare_model`` / ``parallelize``,
``to_empty`` of this rank's shards), but from ``to_empty`` on under ``FakeTensorMode``: every
tensor has a shape, dtype and device and no storage. It then runs one step of the trainer's own code (``train.accumulate_gradients``:
forward with the fused head + loss, backward, gradient reduction; ``grad_global_norm``,
clipping, ``AdamW.step``) inside torch's memory tracker (``FSDPMemTracker`` for FSDP2/HSDP,
``MemTracker`` otherwise), which counts every tensor storage the step creates and frees, by kind,
and keeps the peak. The AdamW moments exist before the step (one zero-gradient update first),
as on any step after the first.

What the peak counts: parameters (sharded fp32 masters), the bf16 copies FSDP gathers, sharded
and unsharded gradients, AdamW state, activations (with the recipe's activation checkpointing:
the recomputed block included), backward temporaries, collective buffers and the input batch.
What it does not: the CUDA caching allocator's fragmentation and reserve, NCCL and cuBLAS
workspaces, the CUDA context, kernels' own scratch space. Attention runs the CPU fused kernel's
shapes (output and log-sum-exp saved, as flash / memory-efficient attention on GPU). The step
runs eagerly: ``torch.compile`` is not traced (the recipe's compile setting is reported, not
applied). With gradient accumulation the first two micro-steps and the last run; the others
repeat the second one's memory.

With ``torch.context_parallel = C`` the fake ranks form ``world / C`` context groups; rank 0
holds 1/C of each sequence (its zigzag chunks) and the step includes the K/V all-gathers of the
global layers and the halo exchanges of the sliding ones (their buffers counted like any
other tensor), as on the GPUs.

The trackers are torch's with the per-module peaks left out. torch's also keep each module's
own peak, refreshed at every op by a walk over every module seen so far (a cost of ops x modules),
and the report reads no per-module figure: ``_PeakMemTracker`` and ``_PeakFSDPMemTracker`` keep
the step's peak and its parts only, by torch's rule (a new peak when the total exceeds the last
one), so the figures are the same bytes. Every hook that sorts storage by kind (gradients,
FSDP2's gathered parameters and buffers, the recomputed block) is torch's, unchanged. Without a
wrapper the per-module stats also start again at each micro-step's forward, which torch's
``MemTracker`` refuses otherwise (one iteration per tracker). ``dry_run(..., module_stats=True)``
runs torch's trackers as they are.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import partial
from typing import Any, Self

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

from olmo_model import DevicePeak
from olmo_run.dry_run import DryRunReport, DryRunTarget, dry_run_target
from olmo_run.plan import TPU_KINDS
from olmo_run.recipe import BatchLayout, Recipe, RecipeError, batch_layout

from .model import OlmoModel
from .moe import moe_modules
from .parallelize import Distributed, build_expert_mesh, build_mesh, check_layout
from .step import accumulate_gradients, clip_gradients, grad_global_norm, make_optimizer, prepare_model

CPU = torch.device("cpu")

# FSDPMemTracker's / MemTracker's kinds of storage -> the report's names for the parts of the peak.
PARTS = {
    "Sharded Param": "params",
    "Parameter": "params",
    "Unsharded Param": "gathered_params",
    "All Gather": "gathered_params",
    "Sharded Grad": "grads",
    "Gradient": "grads",
    "Unsharded Grad": "unsharded_grads",
    "Reduce Scatter": "unsharded_grads",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Inputs": "inputs",
    "Buffer": "other",
    "Other": "other",
}
_TOTAL = "Total"  # the trackers' key for the sum over the kinds


def _check_tracker_internals() -> None:
    """The private parts of torch's trackers that the peak-only trackers build on; a torch that
    renamed them would otherwise leave the peak unrecorded or the per-module walk in place."""
    missing = [
        f"{cls.__name__}.{name}"
        for cls, name in (
            (MemTracker, "_update_peak_stats"),
            (MemTracker, "_pre_fw_hook"),
            (FSDPMemTracker, "_update_peak_stats"),
            (FSDPMemTracker, "_update_and_maybe_create_winfos"),
            (FSDPMemTracker, "_fsdp_state_pre_forward"),
        )
        if not callable(getattr(cls, name, None))
    ]
    if "_curr_mem_snap" not in vars(MemTracker()):
        missing.append("MemTracker()._curr_mem_snap")
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}: {', '.join(missing)} not found; olmo_train_torch.dry_run's "
            "peak-only trackers are written against torch 2.15's MemTracker and need updating"
        )


class _Peak:
    """The step's peak by device: the largest total the tracker's running counts reached, and
    the counts by kind at that moment (torch's rule: a new peak only when the total is larger)."""

    def __init__(self) -> None:
        self.totals: dict[torch.device, int] = {}
        self.parts: dict[torch.device, dict[str, int]] = {}
        self.ops = 0  # updates seen: 0 after a step means torch stopped calling _update_peak_stats

    def start(self, current: dict[torch.device, dict[str, int]]) -> None:
        """The counts on entering the tracker (parameters, optimizer state, inputs) are the
        first peak, as in torch's trackers."""
        self.totals = {dev: counts[_TOTAL] for dev, counts in current.items()}
        self.parts = {dev: dict(counts) for dev, counts in current.items()}

    def update(self, current: dict[torch.device, dict[str, int]]) -> None:
        self.ops += 1
        for dev, counts in current.items():
            if counts[_TOTAL] > self.totals.get(dev, 0):
                self.totals[dev] = counts[_TOTAL]
                self.parts[dev] = dict(counts)  # keys are str enums, values ints: a flat copy is a deep one


class _PeakOnly(MemTracker):
    """What both peak-only trackers change in torch's (module docstring): the per-module peak walk
    at every op replaced by one ``_Peak`` record, started from the counts on entering."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.peak = _Peak()

    def __enter__(self) -> Self:
        super().__enter__()
        self.peak.start(self._curr_mem_snap)
        return self

    def _update_peak_stats(self, peak_state: Any) -> None:
        self.peak.update(self._curr_mem_snap)


class _PeakMemTracker(_PeakOnly):
    """torch's ``MemTracker`` (one process, no wrapper) keeping the peak only, for the step of ``root``."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self._root = root

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # The model's forward again, outside backward: the next micro-step. torch's tracker
        # refuses a second iteration of the per-module stats; the peak needs none of them.
        if module is self._root and not self._mod_tracker.is_bw:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


class _PeakFSDPMemTracker(_PeakOnly, FSDPMemTracker):
    """torch's ``FSDPMemTracker`` keeping the peak only. Its per-module stats start again at every
    forward outside backward: torch's refuses a root module's second forward (the next micro-step)
    once its module tracker has the root's parents right, which depends on the model's modules."""

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def fresh(*args: Any, **kwargs: Any) -> Any:
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return fresh


def _tracker(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...], module_stats: bool
) -> MemTracker:
    """The tracker for ``model``'s step, with the tensors from before it registered: FSDP2 /
    HSDP's, or the plain one; peak-only unless ``module_stats`` (torch's own, per-module peaks
    kept)."""
    tracker: MemTracker
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer) if module_stats else _PeakFSDPMemTracker(model, optimizer)
        tracker.track_inputs(inputs)
        # Expert-parallel shards stay outside the FSDP wrapper, whose parameters are the only ones
        # FSDPMemTracker registers (its track_external is a no-op): registered here as shards.
        for moe in moe_modules(model):
            for p in moe.experts.parameters() if moe.dispatcher is not None else ():
                tracker._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)
    else:
        tracker = MemTracker() if module_stats else _PeakMemTracker(model)
        tracker.track_external(model, optimizer, *inputs)
    return tracker


def _peak_parts(tracker: MemTracker) -> dict[str, int]:
    """The tracker's peak on the CPU device (where the fake tensors live): the counts by kind
    and ``Total``; checked to add up and to hold only kinds ``PARTS`` names."""
    if isinstance(tracker, _PeakOnly):
        if tracker.peak.ops == 0:
            raise RuntimeError(
                f"torch {torch.__version__}: the memory tracker ran the step without calling "
                "_update_peak_stats; olmo_train_torch.dry_run's peak-only trackers need updating"
            )
        snapshot = tracker.peak.parts.get(CPU, {})
    else:
        snapshot = tracker.get_tracker_snapshot("peak").get(CPU, {})
    kinds = {str(k.value) if hasattr(k, "value") else str(k): int(v) for k, v in snapshot.items()}
    unknown = sorted(k for k, v in kinds.items() if v and k != _TOTAL and k not in PARTS)
    if unknown or sum(v for k, v in kinds.items() if k != _TOTAL) != kinds.get(_TOTAL, 0):
        raise RuntimeError(
            f"torch {torch.__version__}: the memory tracker's peak {kinds} does not add up over the kinds "
            f"olmo_train_torch.dry_run.PARTS names (unknown: {unknown}); PARTS needs updating"
        )
    return kinds


@contextlib.contextmanager
def fake_process_group(ranks: int) -> Iterator[Distributed]:
    """This process as rank 0 of ``ranks`` over torch's fake backend (one process, no process
    group when ``ranks`` is 1, as the trainer without torchrun)."""
    if ranks == 1:
        yield Distributed(rank=0, world_size=1, local_rank=0, device=CPU, initialized=False)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        yield Distributed(rank=0, world_size=ranks, local_rank=0, device=CPU, initialized=True)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _sharding_propagation_untracked() -> Iterator[None]:
    """DTensor works out an op's output shape on fake tensors of the full (global) shapes, made
    in the active FakeTensorMode. In an eager run that is a fake mode of its own, which the memory
    tracker leaves out; here the active mode is the dry run's, so the tracker would count those
    global-shape tensors (for ``grad_global_norm`` over all gradients: the whole model in fp32).
    Inside this context the propagation runs with the dispatch modes set aside, as in eager."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def _with_moments(optimizer: torch.optim.Optimizer) -> None:
    """One AdamW update at lr 0 with zero gradients: the moments exist, the weights do not move."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _refuse_tpu(device_kind: str, count: int, peak: DevicePeak) -> None:
    """The torch trainer's dry run targets GPUs only."""
    if peak.kind in TPU_KINDS:
        raise RecipeError(
            f"--devices {device_kind}:{count}: the torch trainer runs on GPUs; name a GPU kind (e.g. h100), "
            "or dry-run the JAX trainer for TPUs"
        )


def _check_fake_layout(target: DryRunTarget) -> None:
    """The trainer's own layout checks, then what fake tensors cannot run: dropless expert
    parallelism's routing-sized all-to-all and DDP's checks of real parameter data."""
    section = target.recipe.torch
    check_layout(section, target.count, target.spec, target.seq, optim_sharded=target.recipe.optim.sharded)
    if section.expert_parallel > 1 and target.recipe.moe.capacity_factor is None:
        raise RecipeError(
            f"--dry-run with torch.expert_parallel={section.expert_parallel} and moe.capacity_factor null "
            "(dropless): the all-to-all's split sizes come from the routing, which fake tensors do not "
            "have; set moe.capacity_factor (OLMo-core's scripts: 1.1875) for static capacity buffers, or "
            "dry-run torch.expert_parallel=1"
        )
    if section.parallel == "ddp" and target.count > 1:
        # With optim.sharded there is no DDP wrapper, but its AdamW step reads a scalar from the
        # (fake) sharded moments: not run either.
        raise RecipeError(
            "--dry-run with torch.parallel=ddp: DistributedDataParallel checks and broadcasts real parameter "
            "data when it is built, and the sharded optimizer's step reads values, which fake tensors do not "
            "have; dry-run torch.parallel=fsdp or hsdp (with optim.sharded=false)"
        )


def _track_step(
    recipe: Recipe, target: DryRunTarget, layout: BatchLayout, micro_steps: list[int], module_stats: bool
) -> tuple[dict[str, int], dict[str, int], bool]:
    """Rank 0 of a fake process group starts the model as the trainer does, then runs one step
    inside the memory tracker: (the tracker's peak by kind, the mesh's shape, whether it has a
    mesh)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq, count = target.seq, target.count
    with fake_process_group(count) as d, contextlib.ExitStack() as fake, _sharding_propagation_untracked():
        mesh, experts = build_mesh(d, recipe.torch), build_expert_mesh(d, recipe.torch)
        with torch.device("meta"):
            bare = OlmoModel(target.spec)

        def allocate(m: torch.nn.Module) -> None:
            # start_model's allocate_only, with storage-less tensors: FakeTensorMode from here on.
            # Its tensors cannot be swapped into modules, so the meta model is built before it and
            # its meta parameters (the only tensors from outside the mode) are allowed in.
            fake.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            m.to_empty(device=CPU)

        model = prepare_model(bare, recipe, d, mesh, experts, materialize=allocate)
        optimizer = make_optimizer(model, recipe, CPU)
        _with_moments(optimizer)
        rows = layout.per_device_batch * layout.accumulation_steps
        tensors = {k: torch.zeros((rows, seq), dtype=torch.long) for k in ("input_ids", "labels", "doc_ids")}
        tracker = _tracker(model, optimizer, tuple(tensors.values()), module_stats)
        with tracker:
            accumulate_gradients(
                model, tensors, layout=layout, d=d, spec=target.spec, recipe=recipe, micro_steps=micro_steps
            )
            params = [p for g in optimizer.param_groups for p in g["params"]]
            norm = grad_global_norm(params)
            if recipe.optim.grad_clip is not None:
                clip_gradients(params, recipe.optim.grad_clip, norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        snapshot = _peak_parts(tracker)
        mesh_shape = {"world": 1} if mesh is None else dict(zip(mesh.mesh_dim_names or (), mesh.shape))
        if experts is not None:
            mesh_shape.update(zip(experts.mesh_dim_names or (), experts.shape))
    return snapshot, mesh_shape, mesh is not None


def dry_run(recipe: Recipe, device_kind: str, count: int, *, module_stats: bool = False) -> DryRunReport:
    """Rank 0's memory for one step of ``recipe`` on ``count`` ranks of GPU kind ``device_kind``.
    ``module_stats``: track with torch's trackers as they are (per-module peaks kept, which the
    report does not read; slower by ops x modules), to check the peak-only ones against."""
    started = time.perf_counter()
    _check_tracker_internals()
    target = dry_run_target("torch", recipe, device_kind, count, partial(_refuse_tpu, device_kind, count))
    _check_fake_layout(target)
    section, seq = recipe.torch, target.seq
    cp = section.context_parallel
    # Context parallelism: C ranks share one data-parallel rank's rows.
    layout = batch_layout(recipe.global_batch_sequences(seq), count // cp, recipe.train.micro_batch_size)
    notes = [
        "counts tensor storage only: no CUDA allocator fragmentation or reserve, NCCL/cuBLAS workspaces "
        "or CUDA context (keep ~10% of HBM for them)"
    ]
    if section.compile:
        notes.append("torch.compile: true in the recipe, not traced: the figures are those of the eager step")
        recipe = recipe.model_copy(update={"torch": section.model_copy(update={"compile": False})})
    micro_steps = sorted({0, min(1, layout.accumulation_steps - 1), layout.accumulation_steps - 1})
    if layout.accumulation_steps > 3:
        notes.append(
            f"micro-steps 3..{layout.accumulation_steps - 1} of {layout.accumulation_steps} not run: they repeat micro-step 2's memory"
        )
    snapshot, mesh_shape, sharded = _track_step(recipe, target, layout, micro_steps, module_stats)
    if cp > 1:
        mesh_shape["context"] = cp
    parts: dict[str, int] = {}
    for kind, name in PARTS.items():
        if snapshot.get(kind):
            parts[name] = parts.get(name, 0) + snapshot[kind]
    tracked = "FSDPMemTracker" if sharded and section.parallel in ("fsdp", "hsdp") else "MemTracker"
    return target.report(
        devices=count,
        mesh=mesh_shape,
        per_device_batch=layout.per_device_batch,
        accumulation_steps=layout.accumulation_steps,
        peak_bytes_per_device=snapshot.get(_TOTAL, 0),
        hbm_bytes_per_device=int(target.peak.hbm_bytes),
        memory_bytes=parts,
        compile_seconds=time.perf_counter() - started,
        method=(
            f"{tracked} under FakeTensorMode, rank 0 of a fake process group of {count}, "
            f"torch.parallel={section.parallel}"
            + (f", context parallel {cp} (rank 0 holds {seq // cp} of {seq} tokens per sequence)" if cp > 1 else "")
            + ", eager"
        ),
        notes=notes,
    )
