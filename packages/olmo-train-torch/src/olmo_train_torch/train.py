"""The torch trainer: one recipe in, a run dir with metrics, checkpoints and a loss curve out
(``cli.py`` is its command). The step is ``step.py``; this module is the torch side of
``olmo_run``'s start-up and driver: ``TorchTrainer`` (before joining torchrun's process group,
the parallel mode, context degree and batch split are checked against the launched world size;
then the group, the device meshes and the data-parallel rank of this process) and
``TorchTrainModule`` (the parallelized model, AdamW, the eval step, DCP checkpoints). The
start-up order, and that bad input leaves the run dir untouched, are ``olmo_run.startup``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from olmo_run import Processes, RunSetup, StepMetrics, Trainer, start
from olmo_run.recipe import Recipe
from olmo_run.run_dir import RunPath
from olmo_run.spike_guard import SpikeGuard
from olmo_run.startup import Inputs

from .checkpoint import Checkpointer, load_checkpoint, rng_state, set_rng_state
from .parallelize import (
    Distributed,
    build_expert_mesh,
    build_mesh,
    check_layout,
    init_distributed,
    process_layout,
)
from .spike_guard import DeviceSpikeGuard
from .step import (
    apply_recipe_hyperparams,
    eval_sums,
    host_values,
    make_optimizer,
    start_model,
    state_is_finite,
    train_step,
)

FRAMEWORK = "torch"


def train(recipe: Recipe) -> RunPath:
    """Run (or resume) the recipe's job on this process; returns the run dir. Every check
    that needs no process group runs before this process joins one, and nothing is written
    before every check has passed."""
    return start(recipe, TorchTrainer(recipe))


class TorchTrainer(Trainer):
    """The torch start-up hooks of ``olmo_run.startup``."""

    framework = FRAMEWORK
    prog = "olmo-train-torch"

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def dp_size(self, world_size: int) -> int:
        """Data-parallel ranks: context parallelism has C consecutive ranks share one's rows."""
        return max(world_size // self.recipe.torch.context_parallel, 1)

    def check(self, inputs: Inputs) -> None:
        """The layout against torchrun's launched world size, before joining its group."""
        _, world_size, _ = process_layout()
        check_layout(
            self.recipe.torch, world_size, inputs.spec, inputs.sequence_length, optim_sharded=self.recipe.optim.sharded
        )
        inputs.batch_layout(self.dp_size(world_size))

    def init_distributed(self) -> Processes:
        """Join the process group; the device meshes of ``torch.parallel`` and the experts."""
        self.d = d = init_distributed(self.recipe.torch.backend)
        self.mesh = build_mesh(d, self.recipe.torch)
        self.experts = build_expert_mesh(d, self.recipe.torch)
        return Processes(d.rank, d.world_size, d.all_gather_text)

    def data_parallel(self, inputs: Inputs) -> tuple[tuple[int, ...], int]:
        return (self.d.rank // self.recipe.torch.context_parallel,), self.dp_size(self.d.world_size)

    def describe(self) -> list[str]:
        d, mesh, experts, cp = self.d, self.mesh, self.experts, self.recipe.torch.context_parallel
        mode = self.recipe.torch.parallel if mesh is not None else "none (single process)"
        # ignores: DeviceMesh.mesh_dim_names is None only for an unnamed mesh; both builders name theirs.
        return [
            f"parallel: {mode} over {d.world_size} rank(s) on {d.device.type}"
            + (f", mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}" if mesh is not None else "")  # type: ignore[arg-type]
            + (f", experts on mesh {dict(zip(experts.mesh_dim_names, experts.shape))}" if experts is not None else "")  # type: ignore[arg-type]
            + (f", context parallel {cp} (data-parallel {d.world_size // cp})" if cp > 1 else "")
        ]

    def build_module(self, setup: RunSetup) -> TorchTrainModule:
        return TorchTrainModule(setup, self.d, self.mesh, self.experts)


def cpu_matmul(size: int):
    """A size x size fp32 matmul in torch on this process's CPU threads; each call runs it
    (``olmo_run.measure.matmul_peak`` times it)."""
    a = torch.ones(size, size)
    return lambda: a @ a


class TorchTrainModule:
    """The torch trainer's model (parallelized), AdamW and DCP checkpoints, as
    ``olmo_run.TrainModule``."""

    framework = FRAMEWORK

    def __init__(self, setup: RunSetup, d: Distributed, mesh: DeviceMesh | None, experts: DeviceMesh | None):
        recipe = setup.recipe
        self.setup, self.d = setup, d
        d.barrier()  # rank 0 has written the run dir
        torch.manual_seed(recipe.train.seed)
        init = setup.init
        # A resume wins over recipe.init; both a resume and a trainer checkpoint as init load DCP.
        hf_init = init if setup.resume is None and init is not None and init.is_hf else None
        self.model = start_model(
            recipe,
            setup.spec,
            d,
            mesh,
            experts,
            hf_files=hf_init.safetensors_files() if hf_init is not None else None,
            allocate_only=setup.resume is not None or (init is not None and not init.is_hf),
        )
        self.optimizer = make_optimizer(self.model, recipe, d.device)
        if setup.resume is not None:
            _, ckpt, meta = setup.resume
            load_checkpoint(ckpt, d, self.model, self.optimizer)
            apply_recipe_hyperparams(self.optimizer, recipe)
            set_rng_state(meta.get("rng", {}))
        elif init is not None and not init.is_hf:
            load_checkpoint(init.path, d, self.model, self.optimizer if init.load_optimizer else None)
            if init.load_optimizer:
                apply_recipe_hyperparams(self.optimizer, recipe)
        self.n_devices = d.world_size
        self.cuda = d.device.type == "cuda"
        self.peak_before = 0.0  # the CUDA memory peak before this step's reset (start-up's included)
        self.guard: DeviceSpikeGuard | None = None  # the spike guard's history, on the device from step 1
        # Every rank builds its module at the same point: the group is made in the same order.
        group = dist.new_group(backend="gloo") if self.cuda and d.world_size > 1 else None
        self.text_group = group if isinstance(group, dist.ProcessGroup) else None
        self.checkpointer = Checkpointer(
            setup.run_dir, d, async_save=recipe.checkpoint.async_save, keep=recipe.checkpoint.keep
        )

    def train_step(
        self, batch: dict[str, np.ndarray], step: int, lr: float, guard: SpikeGuard, metrics: StepMetrics
    ) -> None:
        """``step.train_step``, its figures recorded unread; the spike guard's history goes to
        the device at this process's first step and stays there."""
        setup, d = self.setup, self.d
        if self.guard is None:
            self.guard = DeviceSpikeGuard(guard, d.device)
        if self.cuda:  # this step's own peak (gpu_peak_mem_gib); the run's is kept in peak_before
            self.peak_before = max(self.peak_before, float(torch.cuda.max_memory_allocated(d.device)))
            torch.cuda.reset_peak_memory_stats(d.device)
        stats = train_step(
            self.model,
            self.optimizer,
            batch,
            layout=setup.layout,
            d=d,
            spec=setup.spec,
            recipe=setup.recipe,
            lr=lr,
            guard=self.guard,
            step=step,
        )
        for name, value in stats.values().items():
            metrics.record(name, value)
        if self.cuda:
            metrics.record("gpu_peak_mem_gib", torch.cuda.max_memory_allocated(d.device) / 2**30)

    def to_host(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return host_values(values, ep_size=self.setup.recipe.torch.expert_parallel)

    def eval_sums(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        return eval_sums(self.model, batch, self.d, self.setup.recipe)

    def state_is_finite(self) -> bool:
        return state_is_finite(self.model, self.optimizer, self.d)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"rng": rng_state(), "world_size": self.d.world_size, "parallel": self.setup.recipe.torch.parallel}

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.checkpointer.save(step, self.model, self.optimizer, meta)

    def poll(self) -> None:
        self.checkpointer.poll()

    def device_memory(self) -> tuple[float, float] | None:
        """CUDA's allocated bytes on this rank's GPU and their peak since the process started; None on CPU."""
        if not torch.cuda.is_available() or not self.cuda:
            return None
        return float(torch.cuda.memory_allocated()), max(self.peak_before, float(torch.cuda.max_memory_allocated()))

    def device_kind(self) -> str | None:
        return torch.cuda.get_device_name(self.d.device) if self.cuda else None

    def matmul(self, size: int):
        return cpu_matmul(size)

    def start_trace(self, folder: Path) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.d.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.trace_file = folder / f"trace_rank{self.d.rank}.json"  # Chrome trace format (Perfetto, chrome://tracing)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def stop_trace(self) -> None:
        if self.d.device.type == "cuda":
            torch.cuda.synchronize()
        self.profiler.stop()
        self.profiler.export_chrome_trace(str(self.trace_file))

    def all_gather_text(self, text: str) -> list[str]:
        """Over gloo on GPUs: the preemption check's agreement (every
        ``checkpoint.preempt_check_every`` steps) then moves host bytes, not device tensors
        whose read would synchronise the step."""
        if self.text_group is None:
            return self.d.all_gather_text(text)
        out: list[str] = [""] * self.d.world_size
        dist.all_gather_object(out, text, group=self.text_group)
        return out

    def close(self) -> None:
        self.checkpointer.close()
