"""The JAX trainer: one recipe in, a run dir with metrics, checkpoints and a loss curve out.

Run it with ``uv run --frozen olmo-train-jax [RECIPE.yaml] [--key=value ...]`` (see cli.py);
with no recipe it trains the default toy job (model "small", the embedded sample mixture,
100 steps of 16 x 512 tokens). The step is ``step.py``; this module is the JAX side of
``olmo_run``'s start-up and driver: ``JaxTrainer`` (join the job and build the mesh from
``jax.mesh``, the loader shards of this process's devices, the HF init weights read and
checked before anything is written) and ``JaxTrainModule`` (parameters and AdamW state on the
mesh, the jitted step and eval, Orbax checkpoints). The start-up order, and that bad input
leaves the run dir untouched, are ``olmo_run.startup``'s.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_run import Processes, RunSetup, StepMetrics, Trainer, start
from olmo_run.errors import TrainingStateError
from olmo_run.recipe import Recipe
from olmo_run.run_dir import RunPath
from olmo_run.spike_guard import SpikeGuard
from olmo_run.startup import Inputs

from . import parallelize
from .checkpoint import Checkpointer, abstract_like, load_checkpoint
from .hf_adapter import initial_params, model_from_hf, validate_hf
from .model import build_model
from .moe import RoutingStats, moe_metrics
from .step import BATCH_KEYS, GuardState, all_finite, for_mesh, step_functions

FRAMEWORK = "jax"


def train(recipe: Recipe) -> RunPath:
    """Run (or resume) the recipe's training job on this process; returns the run dir. Every
    process checks the same inputs and reads the run dir before any process writes it, so bad
    input (a layout that cannot work included) stops every process with the same line."""
    return start(recipe, JaxTrainer(recipe))


class JaxTrainer(Trainer):
    """The JAX start-up hooks of ``olmo_run.startup``."""

    framework = FRAMEWORK
    prog = "olmo-train-jax"

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.init_tensors: dict[str, np.ndarray] | None = None

    def init_distributed(self) -> Processes:
        """Join the job (``jax.distributed``) and build the ``jax.mesh`` over all its devices."""
        parallelize.init_distributed(self.recipe)
        self.mesh = parallelize.build_mesh(self.recipe.jax.mesh)
        return Processes(
            jax.process_index(),
            jax.process_count(),
            parallelize.all_gather_text,
            line=parallelize.describe_process(self.mesh),  # the mesh, on every process
        )

    def data_parallel(self, inputs: Inputs) -> tuple[tuple[int, ...], int]:
        parallelize.check_layout(self.mesh, self.recipe, inputs.spec, inputs.sequence_length)
        return parallelize.process_batch_shards(self.mesh), parallelize.dp_size(self.mesh)

    def load_init(self, setup: RunSetup) -> None:
        if setup.init is not None and setup.init.is_hf:
            from safetensors.numpy import load_file

            self.init_tensors = {k: v for f in setup.init.safetensors_files() for k, v in load_file(f).items()}
            validate_hf(setup.spec, self.init_tensors, source=f"init.checkpoint={self.recipe.init.checkpoint}")

    def build_module(self, setup: RunSetup) -> JaxTrainModule:
        return JaxTrainModule(setup, self.mesh, self.init_tensors)


def cpu_matmul(size: int):
    """A size x size fp32 matmul on one CPU device of this process, compiled by its first call;
    each call runs it to completion (``olmo_run.measure.matmul_peak`` times it)."""
    dev = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), dev)
    f = jax.jit(lambda x: x @ x)
    return lambda: f(a).block_until_ready()


def _put_eval_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """Every process holds the whole evaluation batch; split it over data-parallel devices when
    its rows divide, else replicate it (a short last batch); columns in the context layout's
    order and split over the context axis under CP."""
    sh = parallelize.eval_sharding(mesh, batch["input_ids"].shape[0])
    cols = {k: parallelize.to_context_order(batch[k], mesh) for k in BATCH_KEYS}
    # ignore: mypy cannot infer a lambda whose default binds the array (one per key).
    return {k: jax.make_array_from_callback(cols[k].shape, sh, lambda idx, a=cols[k]: a[idx]) for k in BATCH_KEYS}  # type: ignore[misc]


class JaxTrainModule:
    """The JAX trainer's state (parameters and AdamW state placed on the mesh) and its jitted
    step, eval and Orbax checkpoints, as ``olmo_run.TrainModule``."""

    framework = FRAMEWORK

    def __init__(self, setup: RunSetup, mesh: jax.sharding.Mesh, init_tensors: dict[str, np.ndarray] | None):
        recipe, spec = setup.recipe, setup.spec
        self.setup, self.mesh = setup, mesh
        compute_dtype = jnp.bfloat16 if recipe.train.precision == "bf16" else jnp.float32
        make_model = partial(
            build_model,
            spec,
            seed=recipe.train.seed,
            dtype=compute_dtype,
            remat=recipe.jax.remat,
            attention=recipe.jax.attention,
        )
        prepared = for_mesh(nnx.eval_shape(make_model), spec, recipe, mesh)
        abstract_params = abstract_like(prepared.params, prepared.params_sh)
        abstract_opt = abstract_like(prepared.abstract_opt, prepared.opt_sh)
        if setup.resume is not None:
            step, ckpt, _ = setup.resume
            self.params, self.opt_state, saved_step = load_checkpoint(ckpt, abstract_params, abstract_opt)
            if saved_step != step:
                raise TrainingStateError(f"{ckpt}: state holds step {saved_step} but meta.json says {step}; damaged")
        else:
            self.params, self.opt_state = _initial_state(setup, init_tensors, abstract_params, abstract_opt)
            if self.opt_state is None:
                self.opt_state = jax.jit(prepared.tx.init, out_shardings=prepared.opt_sh)(self.params)
        self.fns = step_functions(prepared, spec, recipe, mesh)
        self.n_devices = jax.device_count()
        self.guard: GuardState | None = None  # the spike guard's history, on the devices from step 1
        self.checkpointer = Checkpointer(
            setup.run_dir, async_save=recipe.checkpoint.async_save, keep=recipe.checkpoint.keep
        )

    def train_step(
        self, local: dict[str, np.ndarray], step: int, lr: float, guard: SpikeGuard, metrics: StepMetrics
    ) -> None:
        """One step, its stats recorded as device arrays, unread; with the spike guard, its
        history goes to the devices at this process's first step and is carried from there."""
        layout = self.setup.layout
        batch = {
            k: parallelize.global_batch_array(local[k], self.mesh, layout.accumulation_steps, layout.global_batch)
            for k in BATCH_KEYS
        }
        lr_arg, step_arg = np.float32(lr), np.int32(step)
        skipped: Any = False
        if guard.enabled:
            if self.guard is None:
                self.guard = guard_state(guard, self.mesh)
            grads, stats = self.fns.grads(self.params, batch, step_arg)
            self.params, self.opt_state, self.guard, skipped = self.fns.apply(
                self.params, self.opt_state, grads, stats["loss"], stats["grad_norm"], lr_arg, self.guard
            )
            del grads
        else:
            # The update is applied in the same program; a non-finite loss stops the run at the
            # driver's next read, before anything of that state is saved.
            self.params, self.opt_state, stats = self.fns.fused(self.params, self.opt_state, batch, lr_arg, step_arg)
        for name in ("loss", "ce_loss", "z_loss", "grad_norm"):
            metrics.record(name, stats[name])
        metrics.record("skipped", skipped)
        if "moe" in stats:  # the MoE contract's moe_* keys, made by to_host
            metrics.record("moe", stats["moe"])

    def to_host(self, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One ``jax.device_get`` of every step's arrays; scalars as Python numbers, the routing
        stats as the moe_* keys in their place."""
        out = []
        for row in jax.device_get(values):
            host: dict[str, Any] = {}
            for name, value in row.items():
                if isinstance(value, RoutingStats):
                    host.update(moe_metrics(value, ep_size=parallelize.expert_size(self.mesh)))
                else:
                    host[name] = value.item() if isinstance(value, np.ndarray | np.generic) else value
            out.append(host)
        return out

    def eval_sums(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        b = _put_eval_batch(batch, self.mesh)
        ce, n = self.fns.evaluate(self.params, b["input_ids"], b["labels"], b["doc_ids"])
        return float(ce), float(n)

    def state_is_finite(self) -> bool:
        return bool(all_finite(self.params, self.opt_state))

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"mesh": dict(self.mesh.shape)}

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.checkpointer.save(step, self.params, self.opt_state, meta)

    def poll(self) -> None:
        """Orbax writes and the commit runs on their own threads; a failure of theirs (a full
        disk) is raised here, after the step it happened in, so no further step runs."""
        self.checkpointer.poll()

    def device_memory(self) -> tuple[float, float] | None:
        """The fullest local device's bytes in use and peak (TPU and GPU report them; CPU does not)."""
        stats = [d.memory_stats() for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        if not stats or any(s is None for s in stats):
            return None
        return float(max(s.get("bytes_in_use", 0) for s in stats)), float(
            max(s.get("peak_bytes_in_use", 0) for s in stats)
        )

    def device_kind(self) -> str | None:
        dev = jax.local_devices()[0]
        return None if dev.platform == "cpu" else dev.device_kind

    def matmul(self, size: int):
        return cpu_matmul(size)

    def start_trace(self, folder: Path) -> None:
        jax.profiler.start_trace(str(folder))  # TensorBoard's profile plugin layout (xplane.pb)

    def stop_trace(self) -> None:
        jax.profiler.stop_trace()

    def all_gather_text(self, text: str) -> list[str]:
        return parallelize.all_gather_text(text)

    def close(self) -> None:
        self.checkpointer.close()


def guard_state(guard: SpikeGuard, mesh: jax.sharding.Mesh) -> GuardState:
    """``guard``'s history (a resume's, or empty) as the replicated ``GuardState``."""
    known = list(zip(guard.losses, guard.norms))[-guard.window :]
    history = np.zeros((guard.window, 2), np.float32)
    if known:
        history[guard.window - len(known) :] = np.asarray(known, np.float32)
    replicated = NamedSharding(mesh, P())
    return GuardState(_replicated(history, replicated), _replicated(np.asarray(len(known), np.int32), replicated))


def _replicated(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The same host ``value`` on every device of ``sharding`` (every process passes it)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _initial_state(
    setup: RunSetup, init_tensors: dict[str, np.ndarray] | None, abstract_params: Any, abstract_opt: Any
) -> tuple[Any, Any | None]:
    """(params, AdamW state or None) to start from: fresh weights from recipe.train.seed
    (``olmo_model.init``, the torch trainer's), or init.checkpoint's weights (and moments when
    init.load_optimizer), on the current mesh."""
    init = setup.init
    params_sh = jax.tree.map(lambda a: a.sharding, abstract_params)
    if init is None:
        return initial_params(setup.spec, setup.recipe.train.seed, abstract_params), None
    if init_tensors is not None:
        pure = nnx.to_pure_dict(nnx.split(model_from_hf(setup.spec, init_tensors))[1])
        return jax.tree.map(jax.device_put, pure, params_sh), None
    params, opt_state, _ = load_checkpoint(init.path, abstract_params, abstract_opt if init.load_optimizer else None)
    return params, opt_state
