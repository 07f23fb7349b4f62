"""``olmo-train-jax RECIPE.yaml --dry-run --devices KIND:COUNT [--json]``: the recipe's real train
step compiled ahead of time for a TPU topology or a cluster of NVIDIA GPUs on this machine, and the
compiler's own figures for it (MaxText's train_compile; contract 7). No weights exist and nothing runs.

Targets (``aot_targets``): TPU topologies through libtpu, NVIDIA GPU clusters through JAX's CUDA
plugin; on a GPU the report's ``hbm_bytes_per_device`` is the share of the card JAX's allocator holds.

What is compiled: the abstract model (``nnx.eval_shape``), prepared for a mesh over the topology's
devices by the trainer's own ``step.for_mesh`` (so the TPU kernels are chosen, not the host's), the
parameter / AdamW shardings and the batch layout the trainer derives (``parallelize``, ``batch_layout``),
and the fused step of ``step.step_functions`` (forward, fused head + loss, backward, gradient
accumulation in a scan when the layout has it, clipping, AdamW; parameters and moments donated),
lowered on ``jax.ShapeDtypeStruct`` arguments that carry those shardings.

Memory per device, from ``Compiled.memory_analysis()``: peak = arguments + (outputs - aliased) +
temporaries. The arguments are this device's shards of the parameters and AdamW moments plus its
batch; the step's outputs are mostly the new parameters and moments, written into the donated
argument buffers (aliased), so only outputs not aliased to an argument add to the arguments;
temporaries are the block XLA assigns to everything else the program holds at some point (saved
activations, gathered weights, gradients, collective buffers). This sum is what XLA:TPU itself
keeps within the HBM (it accepts a step of 84.75 GiB arguments + 10.65 GiB temporaries on a
95.74 GiB v5p, and shrinks the temporaries to get there); its heap simulation reports a lower
peak (``peak_memory_in_bytes``, put in the notes). When the compiler refuses the step
(RESOURCE_EXHAUSTED), its message's figures are the report: what the step needs in all (arguments
included) against the HBM it has.

FLOPs and step time (``hlo_cost``): XLA's cost analysis with every loop's body counted trip-count
times; the step time is XLA's cost model scaled the same way, an estimate, not a measurement.
"""

from __future__ import annotations

import math
import re
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_run.dry_run import DryRunReport, DryRunTarget, dry_run_target
from olmo_run.recipe import BatchLayout, Recipe, RecipeError, batch_layout

from . import parallelize
from .aot_targets import GPU_TARGETS, gpu_memory_fraction, target_devices
from .grouped_gemm import recipe_gemm
from .hlo_cost import scaled_cost, step_estimate
from .model import build_model
from .step import BATCH_KEYS, for_mesh, step_functions


def _resource_exhausted(message: str) -> tuple[int, int] | None:
    """(bytes needed, bytes available) from XLA:TPU's out-of-memory message, when it states them."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}

    def size(text: str) -> int:
        m = re.fullmatch(r"([\d.]+)([KMGTP]?)(?:i?B)?", text)
        assert m is not None
        return int(float(m.group(1)) * units[m.group(2)])

    num = r"[\d.]+[KMGTP]?(?:i?B)?"
    for pattern in (
        rf"required for HLO temporaries \(({num})\) exceeds available HBM \(({num})\)",
        rf"Used ({num}) of ({num}) hbm",
    ):
        m = re.search(pattern, message)
        if m:
            return size(m.group(1)), size(m.group(2))
    return None


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
    )


def _check_gpu_gemm(target: DryRunTarget, device: Any) -> None:
    """Refuse an MoE step whose grouped GEMM on the GPU target would be the Mosaic GPU kernels."""
    recipe = target.recipe
    if recipe_gemm(recipe.jax.moe_gemm, target.spec, recipe.train.precision, device) == "mgpu":
        kind = target.peak.kind
        raise RecipeError(
            f"--devices {kind}:{target.count}: this MoE step's grouped GEMM on {kind} is JAX's Mosaic GPU kernels "
            "(jax.moe_gemm=auto's choice on Hopper, or set), which JAX traces only on the GPU itself "
            "(transposed_ragged_dot_mgpu reads jax.devices()[0].core_count); dry-run with --jax.moe_gemm=ragged, "
            "whose lax.ragged_dot XLA:GPU lowers densely over the experts (temporaries that grow with moe.n_experts)"
        )


def _abstract_step(target: DryRunTarget, mesh: Mesh, layout: BatchLayout) -> tuple[Any, tuple]:
    """The trainer's fused step for ``mesh`` and its arguments (parameters, AdamW moments, batch,
    learning rate, step) as ShapeDtypeStructs that carry their shardings."""
    recipe, spec, seq = target.recipe, target.spec, target.seq
    make_model = partial(
        build_model,
        spec,
        seed=recipe.train.seed,
        dtype=jnp.bfloat16 if recipe.train.precision == "bf16" else jnp.float32,
        remat=recipe.jax.remat,
        attention=recipe.jax.attention,
    )
    m = for_mesh(nnx.eval_shape(make_model), spec, recipe, mesh)
    fns = step_functions(m, spec, recipe, mesh)

    def shaped(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    params, opt_state = shaped(m.params, m.params_sh), shaped(m.abstract_opt, m.opt_sh)
    rows = layout.global_batch // layout.accumulation_steps
    batch_sh = parallelize.batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct((layout.accumulation_steps, rows, seq), jnp.int32, sharding=batch_sh)
        for k in BATCH_KEYS
    }
    replicated = NamedSharding(mesh, P())
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return fns.fused, (params, opt_state, batch, lr, step)


def _notes(target: DryRunTarget, topology: str, mesh: Mesh, layout: BatchLayout, n: int, fraction: float) -> list[str]:
    """The report's first notes: the layout compiled, how the peak is summed, and what differs from a run."""
    recipe, seq, peak = target.recipe, target.seq, target.peak
    cp = parallelize.context_size(mesh)
    notes = [
        f"{topology}: {n} devices, mesh {dict(mesh.shape)}, {layout.per_device_batch} x {seq // cp} tokens per device "
        f"per micro-step{f' (context parallel: each sequence split over {cp} devices)' if cp > 1 else ''}, "
        f"{layout.accumulation_steps} micro-step(s) in the compiled program (scan), "
        f"remat {recipe.jax.remat}, {recipe.train.precision}",
        "peak = arguments + outputs not aliased to the donated state + temporaries (compiler's memory analysis)",
    ]
    if recipe.spike_guard.enabled:
        notes.append(
            "spike_guard.enabled: the trainer runs gradients and update as two programs; this is the fused "
            "step, and the split one also holds the fp32 gradients between its two programs"
        )
    if peak.kind in GPU_TARGETS:
        notes.append(
            f"memory budget: JAX's allocator holds XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g} of the "
            f"{peak.hbm_bytes / 2**30:.2f} GiB card ({fraction * peak.hbm_bytes / 2**30:.2f} GiB); XLA:GPU compiled "
            "without autotuning (no card to time kernels on)"
        )
    return notes


def _refused(message: str, target: DryRunTarget, args: tuple, hbm: int, notes: list[str]) -> dict[str, Any] | None:
    """The report's memory figures from the compiler's refusal of the step (RESOURCE_EXHAUSTED); a
    missing ptxas is a RecipeError that names the extra; None for any other failure."""
    if "Couldn't find a suitable version of ptxas" in message:
        raise RecipeError(
            f"--devices {target.peak.kind}:{target.count}: XLA:GPU needs NVIDIA's ptxas and libdevice to compile; "
            "install them with `uv sync --extra gpu-aot` (nvidia-cuda-nvcc, nvidia-nvvm) or put a CUDA toolkit on PATH"
        ) from None
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    arguments = _bytes_per_device(args)
    figures = _resource_exhausted(message)
    reason = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), message)
    notes.append(f"the compiler refused the step: {reason.strip()[:300]}")
    # The message's figures are what the step needs in all and the HBM: XLA:TPU limits arguments
    # + temporaries together (module docstring), so the figure it sets against the whole HBM
    # is their sum. Without figures the step needs more than the HBM beside its arguments, by
    # an amount the compiler did not state.
    needed, available = figures or (arguments + hbm, hbm)
    return dict(
        peak_bytes_per_device=needed,
        hbm_bytes_per_device=available,
        memory_bytes={"arguments": arguments, "temporaries": needed - arguments},
    )


def _measured(compiled: Any, target: DryRunTarget, n: int, hbm: int, notes: list[str]) -> dict[str, Any]:
    """The report's memory, FLOPs and step-time figures from the compiled step."""
    mem = compiled.memory_analysis()
    parts = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs_not_aliased": int(mem.output_size_in_bytes - mem.alias_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
    }
    heap_peak = getattr(mem, "peak_memory_in_bytes", None)
    if heap_peak:
        notes.append(f"the compiler's heap-simulated peak (arguments included): {heap_peak / 2**30:.2f} GiB")
    cost = scaled_cost(compiled.as_text())
    xla_cost = compiled.cost_analysis()
    optimal = xla_cost.get("optimal_seconds") if xla_cost else None
    step_seconds = step_estimate(optimal, cost)
    notes.append(
        f"compiled FLOPs per device: XLA counts {cost.flops_once:.3e} with each loop once; with the loops' trip "
        f"counts ({', '.join(str(t) for t in cost.trip_counts.values()) or 'none'}) {cost.flops:.3e}"
    )
    if step_seconds is not None:
        notes.append(
            "step time and MFU are XLA's cost model (optimal_seconds scaled by the loops' trip counts), "
            "an estimate on paper, not a measurement"
        )
    else:
        gpu = target.peak.kind in GPU_TARGETS
        notes.append(
            f"no step time estimate: XLA:{'GPU' if gpu else 'TPU'}'s cost model gives "
            f"{'no optimal_seconds' if optimal is None else f'optimal_seconds={optimal}'} for this program"
        )
    return dict(
        peak_bytes_per_device=sum(parts.values()),
        hbm_bytes_per_device=hbm,
        memory_bytes=parts,
        compiled_flops_per_step=cost.flops * n,
        estimated_step_seconds=step_seconds,
        estimated_mfu=(
            None
            if step_seconds is None
            else target.model_flops_per_step / (step_seconds * n * target.peak.bf16_flops_per_device)
        ),
    )


def dry_run(recipe: Recipe, device_kind: str, count: int) -> DryRunReport:
    """Compile the recipe's train step for ``count`` chips of ``device_kind`` and report it."""
    target = dry_run_target("jax", recipe, device_kind, count)
    gpu = target.peak.kind in GPU_TARGETS
    fraction = gpu_memory_fraction() if gpu else 1.0
    started = time.perf_counter()
    topology, devices = target_devices(target.peak.kind, count)
    mesh = parallelize.build_mesh(recipe.jax.mesh, devices)
    parallelize.check_layout(mesh, recipe, target.spec, target.seq)
    if gpu:
        _check_gpu_gemm(target, devices[0])
    dp = parallelize.dp_size(mesh)
    layout = batch_layout(recipe.global_batch_sequences(target.seq), dp, recipe.train.micro_batch_size)
    fused, args = _abstract_step(target, mesh, layout)
    n = len(devices)
    notes = _notes(target, topology, mesh, layout, n, fraction)
    report = partial(
        target.report,
        devices=n,
        mesh=dict(mesh.shape),
        per_device_batch=layout.per_device_batch,
        accumulation_steps=layout.accumulation_steps,
        method=f"XLA:{'GPU' if gpu else 'TPU'} ahead-of-time compile for {topology}",
        notes=notes,
    )
    lowered = fused.lower(*args)
    hbm = int(fraction * target.peak.hbm_bytes)
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA's runtime error type is private; only an out-of-memory is a result
        refused = _refused(str(err), target, args, hbm, notes)
        if refused is None:
            raise
        return report(**refused, compile_seconds=time.perf_counter() - started)
    compile_seconds = time.perf_counter() - started
    return report(**_measured(compiled, target, n, hbm, notes), compile_seconds=compile_seconds)
