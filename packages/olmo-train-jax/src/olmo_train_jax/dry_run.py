"""``olmo-train-jax RECIPE.yaml --dry-run --devices KIND:COUNT [--json]``: the recipe's real train
step compiled ahead of time for a TPU topology or a cluster of NVIDIA GPUs on this machine, and the
compiler's own figures for it (MaxText's train_compile; contract 7). No weights exist and nothing runs.

Targets: the TPU kinds of ``TPU_TOPOLOGY_DIMS`` through libtpu (the ``tpu`` extra), and the GPU kinds
of ``GPU_TARGETS`` through JAX's CUDA plugin (the ``gpu-aot`` extra), which compiles for a GPU it
cannot see when given the card's description (``gpu_targets/KIND.txtpb``, a
``GpuTargetConfigProto``) and a topology of hosts x GPUs: COUNT GPUs are ``GPUS_PER_HOST`` to a host
(an HGX board), fewer on one host. XLA:GPU compiles without autotuning there (no card to time
kernels on), so its GEMM tilings are its defaults, which move the temporaries little and the speed
more; cuDNN's fused attention is planned, not built. On a GPU JAX's allocator holds
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card (0.75 unless set) and the step must fit in that, so
the GPU report's ``hbm_bytes_per_device`` is that share of the card.

What is compiled: the abstract model (``nnx.eval_shape``), prepared for a mesh over the topology's
devices by the trainer's own ``train.for_mesh`` (so the TPU kernels are chosen, not the host's), the
parameter / AdamW shardings and the batch layout the trainer derives (``sharding``, ``batch_layout``),
and the fused step of ``train.step_functions`` (forward, fused head + loss, backward, gradient
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

FLOPs: XLA's cost analysis counts the body of a while loop (every ``lax.scan``: the layer scan, its
backward, the head-loss chunks, the accumulation micro-steps) once. ``scaled_cost`` takes the
optimized program's text, reads each loop's trip count from its condition, costs each loop body on
its own with XLA's cost analysis (``hlo_module_cost_analysis``, the CPU client's HloCostAnalysis,
the same FLOP count as the TPU executable's; the program-level totals agree) and adds
(trip count - 1) x body for every loop, nested loops included. The compiler's ``optimal_seconds``
is scaled by the same factor as its FLOPs (the loop bodies are taken to run at the program's mean
FLOP rate): an estimate of the step time from XLA's cost model, not a measurement. XLA:GPU states a
loop's trip count on the loop itself (``known_trip_count``), which is taken where present. Its cuDNN
attention calls are opaque to the cost analysis; ``cudnn_attention_flops`` counts them from their
shapes. XLA:GPU's compiled program has no ``optimal_seconds``, so a GPU report has no step estimate.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_model import flops_per_token, resolve_device_kind
from olmo_run.dry_run import DryRunReport
from olmo_run.recipe import Recipe, RecipeError, batch_layout

from . import sharding, train
from .model import build_model
from .moe import recipe_gemm

# Kinds XLA:TPU compiles for here: torus dimensions of the topology name (3D: v5p and tpu7x; 2D: v6e).
TPU_TOPOLOGY_DIMS = {"v5p": 3, "v6e": 2, "tpu7x": 3}


def topology_shape(kind: str, chips: int) -> tuple[int, ...]:
    """A slice shape of ``chips`` chips for ``kind``, as TPU slices are named: the most cubic (or
    square) factorisation, sizes non-decreasing (v5p:512 -> 8x8x8, v5p:128 -> 4x4x8, v6e:256 ->
    16x16); for 3D kinds a slice of fewer than 8 chips is flat (4 -> 2x2x1, 2 -> 1x2x1)."""
    n_dims = TPU_TOPOLOGY_DIMS[kind]
    best: tuple[int, ...] | None = None
    for a in range(1, chips + 1):
        if chips % a:
            continue
        if n_dims == 2:
            shape: tuple[int, ...] = (a, chips // a)
        else:
            rest = chips // a
            b = next((b for b in range(math.isqrt(rest), 0, -1) if rest % b == 0), 1)
            shape = (a, b, rest // b)
        shape = tuple(sorted(shape))
        if best is None or shape[-1] / shape[0] < best[-1] / best[0]:
            best = shape
    assert best is not None  # chips >= 1 always has the factorisation 1 x ... x chips
    if n_dims == 3 and best[0] == 1:
        best = (best[1], best[2], 1)
    return best


def _host_bounds(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Chips per host for the compile: a TPU VM host holds 2x2x1 chips; a slice smaller than a host
    names its own shape (libtpu refuses a topology its host bounds do not divide)."""
    return min(shape[0], 2), min(shape[1], 2), 1


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 while libtpu starts: on a host with no TPU metadata it prints a page
    of warnings about the accelerator type and worker hostnames it cannot find, which concern a
    real TPU VM and not an ahead-of-time compile; failures still come back as exceptions."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def topology_devices(kind: str, chips: int) -> tuple[str, list]:
    """(topology name, the abstract devices XLA:TPU compiles for) of a ``chips``-chip ``kind`` slice."""
    if importlib.util.find_spec("libtpu") is None:
        raise RecipeError(
            f"--devices {kind}:{chips}: compiling for a TPU topology needs libtpu; install it with "
            "`uv sync --extra tpu` (the dev group has it)"
        )
    from jax.experimental import topologies

    # libtpu takes a host-wide lock file when it loads, so that one process owns the chips; a
    # compile-only process owns none, and a second dry run (or a test) must not fail on the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    shape = topology_shape(kind, chips)
    name = f"{kind}:{'x'.join(map(str, shape))}"
    try:
        with _quiet_stderr():
            topo = topologies.get_topology_desc(
                platform="tpu", topology_name=name, chips_per_host_bounds=_host_bounds(shape)
            )
    except Exception as err:  # libtpu's own refusal, e.g. a shape it does not build
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(
            f"--devices {kind}:{chips}: XLA:TPU has no topology {name} ({first}); use a chip count with "
            "a TPU slice shape, e.g. a power of two"
        ) from None
    return name, list(topo.devices)


# GPU kinds XLA:GPU compiles for here, each described by gpu_targets/KIND.txtpb, and the GPUs of one
# host: an HGX board's 8, the node of the Olmo 3 recipes (torchrun, 8 GPUs per node).
GPU_TARGETS = ("h100", "h200")
GPUS_PER_HOST = 8
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def gpu_topology_shape(kind: str, count: int) -> tuple[int, int]:
    """(hosts, GPUs per host) of ``count`` GPUs: up to ``GPUS_PER_HOST`` on one host, more in whole
    hosts of ``GPUS_PER_HOST``."""
    if count <= GPUS_PER_HOST:
        return 1, count
    if count % GPUS_PER_HOST:
        raise RecipeError(
            f"--devices {kind}:{count}: more than {GPUS_PER_HOST} GPUs come in whole hosts of {GPUS_PER_HOST}; "
            f"use a multiple of {GPUS_PER_HOST}"
        )
    return count // GPUS_PER_HOST, GPUS_PER_HOST


def gpu_topology_devices(kind: str, count: int) -> tuple[str, list]:
    """(topology name, the abstract devices XLA:GPU compiles for) of ``count`` GPUs of ``kind``."""
    if not any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS):
        raise RecipeError(
            f"--devices {kind}:{count}: compiling for a GPU target needs JAX's CUDA plugin; install it with "
            "`uv sync --extra gpu-aot` (the dev group has it)"
        )
    from jax.experimental import topologies

    hosts, per_host = gpu_topology_shape(kind, count)
    target = (importlib.resources.files("olmo_train_jax") / "gpu_targets" / f"{kind}.txtpb").read_text()
    shape = f"1x{hosts}x{per_host}"  # the plugin's <partitions>x<hosts>x<GPUs per host>
    # The plugin tries to start the CUDA driver first and logs its failure on a host without one.
    with _quiet_stderr():
        topo = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=target)
    hosts_text = f"{hosts} host{'s' if hosts > 1 else ''}"
    return f"{kind}:{count} ({hosts_text} x {per_host} GPU{'s' if per_host > 1 else ''})", list(topo.devices)


def target_devices(kind: str, count: int) -> tuple[str, list]:
    """(topology name, abstract devices) of ``count`` devices of a TPU or GPU ``kind``."""
    if kind in TPU_TOPOLOGY_DIMS:
        return topology_devices(kind, count)
    if kind in GPU_TARGETS:
        return gpu_topology_devices(kind, count)
    raise RecipeError(
        f"--devices {kind}:{count}: the JAX dry run compiles for {', '.join((*TPU_TOPOLOGY_DIMS, *GPU_TARGETS))} "
        f"(no target description of {kind} here); use olmo-train-torch --dry-run for other GPU layouts"
    )


def gpu_memory_fraction() -> float:
    """The share of a GPU that JAX's allocator holds: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise RecipeError(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION='{text}': write the share of the GPU JAX may hold, a number in (0, 1]"
        )
    return fraction


# ---- the compiler's cost with loop trip counts ---------------------------------------------------

_WHILE = re.compile(r"\bwhile\((%[\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUDNN_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_DEF = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = ")


@dataclass(frozen=True)
class ScaledCost:
    flops: float  # per device, every loop body times its trip count
    flops_once: float  # XLA's own program total (each loop body once)
    trip_counts: dict[str, int]  # loop body computation -> trip count


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its lines, from an HLO module's text."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.split("\n"):
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            current = out.setdefault(m.group(1), [])
        if current is not None:
            current.append(line)
        if line == "}":
            current = None
    return out


def _defs(lines: list[str]) -> dict[str, str]:
    """Instruction name (with its %) -> the rest of its line after ``= ``, for one computation."""
    return {m.group(1): line[m.end() :] for line in lines if (m := _DEF.match(line))}


def _operands(instruction: str, op: str) -> list[str]:
    """The operand names of ``op(...)`` in an instruction's text."""
    inside = instruction[instruction.index(f" {op}(") + len(op) + 2 :]
    inside = re.sub(r"/\*.*?\*/", "", inside[: inside.index(")")])
    return [a.strip() for a in inside.split(",")]


def _constant(defs: dict[str, str], name: str) -> int | None:
    """The integer scalar constant ``name`` holds, through copies (XLA moves loop counters between
    memory spaces with copy / copy-start / copy-done), or None."""
    instruction = defs.get(name, "")
    for _ in range(len(defs)):
        m = re.match(r"[su](?:32|64)\[\]\S* (constant|copy|copy-start|copy-done|bitcast)\((\S+?)\)", instruction)
        if m is None:
            return None
        if m.group(1) == "constant":
            return int(m.group(2))
        instruction = defs.get(m.group(2), "")
    return None


def _tuple_index(instruction: str) -> int | None:
    m = re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", instruction)
    return int(m.group(1)) if m else None


def _trip_count(caller: list[str], init: str, condition: list[str], body: list[str]) -> int:
    """A while loop's trip count from its text: the condition is ``counter < N``, the body adds a
    constant step to the counter, the caller starts it from a constant (JAX's scans and the SPMD
    partitioner's windowed-einsum loops are all of this form); any other loop is refused rather
    than guessed."""
    cond, step_defs, caller_defs = _defs(condition), _defs(body), _defs(caller)
    root = next(line for line in condition if line.lstrip().startswith("ROOT"))
    problem = f"cannot read the trip count of a while loop from its condition: {root.strip()[:200]}"
    m = re.search(r"compare\((%[\w.\-]+), (%[\w.\-]+)\), direction=LT", root)
    if not m:
        raise ValueError(problem)
    index, bound = _tuple_index(cond.get(m.group(1), "")), _constant(cond, m.group(2))
    body_root = next(line for line in body if line.lstrip().startswith("ROOT"))
    if index is None or bound is None or " tuple(" not in body_root:
        raise ValueError(problem)
    update = step_defs.get(_operands(body_root, "tuple")[index], "")
    if " add(" not in update:
        raise ValueError(problem)
    step = next((c for a in _operands(update, "add") if (c := _constant(step_defs, a)) is not None), None)
    start = (
        _constant(caller_defs, _operands(caller_defs[init], "tuple")[index])
        if " tuple(" in caller_defs.get(init, "")
        else None
    )
    if step is None or step <= 0 or start is None:
        raise ValueError(problem)
    return max(0, -(-(bound - start) // step))


def cudnn_attention_flops(line: str) -> float:
    """FLOPs of one cuDNN fused-attention call (XLA:GPU's ``__cudnn$fmha*`` custom calls), from its
    backend config: scores [B, N, Sq, Sk] (``intermediate_tensor_shape``), head width H (the
    output's last dimension), the keys each query sees (all Sk; causal: query i sees i + 1; a
    ``sliding_window_length`` W: at most W), and its matmul passes of 2 x H FLOPs per (query, key):
    2 forward (scores, values), 5 backward (scores recomputed, dV, dP, dQ, dK: FlashAttention's
    backward). The useful work, as olmo_model counts attention; the kernel's masked halves of
    diagonal tiles are not in it. 0 for a line that is no such call."""
    m = _CUDNN_FMHA.search(line)
    if m is None:
        return 0.0
    config = json.loads(line[line.index("backend_config=") + len("backend_config=") :])["cudnn_fmha_backend_config"]
    B, N, Sq, Sk = (int(x) for x in config["intermediate_tensor_shape"]["dimensions"])
    head = int(re.search(r"= \(?\w+\[([\d,]+)\]", line).group(1).split(",")[-1])  # type: ignore[union-attr]
    window = int(config.get("sliding_window_length", 0) or 0)
    if "CAUSAL" in config.get("mask_type", "NO_MASK"):
        # Query i sees min(i + 1, W) keys: a triangle of W rows, then W keys per row.
        w = window if 0 < window < Sq else Sq
        seen = w * (w + 1) // 2 + (Sq - w) * w
    else:
        seen = Sq * (min(Sk, window) if window else Sk)
    passes = 5 if m.group(1).endswith("Backward") else 2
    return float(passes * 2 * head * B * N * seen)


def scaled_cost(hlo_text: str) -> ScaledCost:
    """The compiled program's FLOPs per device with every while loop's body counted trip-count times
    (module docstring)."""
    import jaxlib._hlo as hlo
    from jax._src.lib import _jax

    client = jax.devices("cpu")[0].client
    header, _, rest = hlo_text.partition("\n")
    # The module's attributes (entry layout, schedule, aliasing) describe the real entry; a body
    # made the entry would contradict them, and the FLOP count needs none of them.
    header = header.split(",")[0]

    comps = _computations(rest)
    # The computations each one calls (fusions, reductions, loop bodies...): a sub-module holds only
    # what its entry reaches, so costing a loop body does not parse the whole program again.
    callees = {
        name: {c for c in re.findall(r"%([\w.\-]+)", "\n".join(lines[1:])) if c in comps and c != name}
        for name, lines in comps.items()
    }

    def flops_with_entry(name: str) -> float:
        reach, todo = {name}, [name]
        while todo:
            for c in callees[todo.pop()] - reach:
                reach.add(c)
                todo.append(c)
        lines = [header]
        for comp, body in comps.items():  # in the module's order: callees are defined before callers
            if comp in reach:
                first = body[0].removeprefix("ENTRY ")
                lines += ["ENTRY " + first if comp == name else first, *body[1:]]
        # Stack frame ids point into a table of the whole module's text that a sub-module lacks.
        module = hlo.hlo_module_from_text(re.sub(r" ?stack_frame_id=\d+", "", "\n".join(lines)))
        # XLA counts a custom call as no FLOPs: cuDNN's attention is counted from its shapes.
        opaque = sum(cudnn_attention_flops(line) for comp in reach for line in comps[comp])
        return float(_jax.hlo_module_cost_analysis(client, module).get("flops", 0.0)) + opaque

    def while_loop(line: str) -> tuple[str, str, str, int | None] | None:
        m = _WHILE.search(line)
        if m is None:
            return None
        known = _KNOWN_TRIPS.search(line)
        init, condition, body = m.groups()
        return init, condition, body, int(known.group(1)) if known else None

    loops = {name: [w for line in lines if (w := while_loop(line))] for name, lines in comps.items()}
    entry = next(name for name, lines in comps.items() if lines[0].startswith("ENTRY "))
    once: dict[str, float] = {}
    trips: dict[str, int] = {}

    def cost_once(name: str) -> float:
        if name not in once:
            once[name] = flops_with_entry(name)
        return once[name]

    def total(name: str) -> float:
        # Each loop directly in this computation is in its cost once; count it trip-count times.
        t = cost_once(name)
        for init, condition, body, known in loops.get(name, []):
            trips[body] = known if known is not None else _trip_count(comps[name], init, comps[condition], comps[body])
            t += trips[body] * total(body) - cost_once(body)
        return t

    flops = total(entry)
    nested = {body for found in loops.values() for _, _, body, _ in found}
    if nested - set(trips):
        # A loop inside something other than the entry or a loop body (a conditional, a call).
        raise ValueError(f"while loops outside the entry's loop nest are not counted: {sorted(nested - set(trips))}")
    return ScaledCost(flops=flops, flops_once=cost_once(entry), trip_counts=trips)


# ---- the dry run -------------------------------------------------------------------------------


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


def step_estimate(optimal_seconds: float | None, cost: ScaledCost) -> float | None:
    """The step time XLA's cost model implies: its ``optimal_seconds`` for the program with each loop
    once, scaled by the loops' trip counts (module docstring); None where the model gives no
    positive figure (XLA:GPU states none; XLA:TPU's is negative for some targets, e.g. tpu7x at
    512 devices, which is no time at all)."""
    if optimal_seconds is None or not optimal_seconds > 0 or not cost.flops_once > 0:
        return None
    return float(optimal_seconds) * cost.flops / cost.flops_once


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
    )


def dry_run(recipe: Recipe, device_kind: str, count: int) -> DryRunReport:
    """Compile the recipe's train step for ``count`` chips of ``device_kind`` and report it."""
    peak = resolve_device_kind(device_kind)
    gpu = peak.kind in GPU_TARGETS
    spec = recipe.model_spec()
    seq = recipe.train.sequence_length
    if seq is None:
        raise RecipeError("--dry-run needs train.sequence_length in the recipe (a dry run reads no data)")
    fraction = gpu_memory_fraction() if gpu else 1.0
    started = time.perf_counter()
    topology, devices = target_devices(peak.kind, count)
    mesh = sharding.make_mesh(recipe.jax.mesh, devices)
    sharding.check_layout(mesh, recipe, spec, seq)
    if gpu and recipe_gemm(recipe.jax.moe_gemm, spec, recipe.train.precision, devices[0]) == "mgpu":
        raise RecipeError(
            f"--devices {peak.kind}:{count}: this MoE step's grouped GEMM on {peak.kind} is JAX's Mosaic GPU kernels "
            "(jax.moe_gemm=auto's choice on Hopper, or set), which JAX traces only on the GPU itself "
            "(transposed_ragged_dot_mgpu reads jax.devices()[0].core_count); dry-run with --jax.moe_gemm=ragged, "
            "whose lax.ragged_dot XLA:GPU lowers densely over the experts (temporaries that grow with moe.n_experts)"
        )
    cp = sharding.context_size(mesh)
    layout = batch_layout(recipe.global_batch_sequences(seq), sharding.dp_size(mesh), recipe.train.micro_batch_size)

    make_model = partial(
        build_model,
        spec,
        seed=recipe.train.seed,
        dtype=jnp.bfloat16 if recipe.train.precision == "bf16" else jnp.float32,
        remat=recipe.jax.remat,
        attention=recipe.jax.attention,
    )
    m = train.for_mesh(nnx.eval_shape(make_model), spec, recipe, mesh)
    fns = train.step_functions(m, spec, recipe, mesh)

    def shaped(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    params, opt_state = shaped(m.params, m.params_sh), shaped(m.abstract_opt, m.opt_sh)
    rows = layout.global_batch // layout.accumulation_steps
    batch_sh = sharding.batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct((layout.accumulation_steps, rows, seq), jnp.int32, sharding=batch_sh)
        for k in train.BATCH_KEYS
    }
    replicated = NamedSharding(mesh, P())
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)

    n = len(devices)
    model_flops = flops_per_token(spec, seq) * recipe.train.global_batch_tokens
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
    if gpu:
        notes.append(
            f"memory budget: JAX's allocator holds XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g} of the "
            f"{peak.hbm_bytes / 2**30:.2f} GiB card ({fraction * peak.hbm_bytes / 2**30:.2f} GiB); XLA:GPU compiled "
            "without autotuning (no card to time kernels on)"
        )
    method = f"XLA:{'GPU' if gpu else 'TPU'} ahead-of-time compile for {topology}"
    report = partial(
        DryRunReport,
        framework="jax",
        device_kind=peak.kind,
        devices=n,
        mesh=dict(mesh.shape),
        per_device_batch=layout.per_device_batch,
        accumulation_steps=layout.accumulation_steps,
        model_flops_per_step=model_flops,
        method=method,
        notes=notes,
    )
    lowered = fns.fused.lower(params, opt_state, batch, lr, step)
    hbm = int(fraction * peak.hbm_bytes)
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA's runtime error type is private; only an out-of-memory is a result
        message = str(err)
        if "Couldn't find a suitable version of ptxas" in message:
            raise RecipeError(
                f"--devices {peak.kind}:{count}: XLA:GPU needs NVIDIA's ptxas and libdevice to compile; install "
                "them with `uv sync --extra gpu-aot` (nvidia-cuda-nvcc, nvidia-nvvm) or put a CUDA toolkit on PATH"
            ) from None
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        arguments = _bytes_per_device((params, opt_state, batch, lr, step))
        figures = _resource_exhausted(message)
        reason = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), message)
        notes.append(f"the compiler refused the step: {reason.strip()[:300]}")
        # The message's figures are what the step needs in all and the HBM: XLA:TPU limits arguments
        # + temporaries together (module docstring), so the figure it sets against the whole HBM
        # is their sum. Without figures the step needs more than the HBM beside its arguments, by
        # an amount the compiler did not state.
        needed, available = figures or (arguments + hbm, hbm)
        return report(
            peak_bytes_per_device=needed,
            hbm_bytes_per_device=available,
            memory_bytes={"arguments": arguments, "temporaries": needed - arguments},
            compile_seconds=time.perf_counter() - started,
        )
    compile_seconds = time.perf_counter() - started

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
    mfu = None if step_seconds is None else model_flops / (step_seconds * n * peak.bf16_flops_per_device)
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
        notes.append(
            f"no step time estimate: XLA:{'GPU' if gpu else 'TPU'}'s cost model gives "
            f"{'no optimal_seconds' if optimal is None else f'optimal_seconds={optimal}'} for this program"
        )
    return report(
        peak_bytes_per_device=sum(parts.values()),
        hbm_bytes_per_device=hbm,
        memory_bytes=parts,
        compile_seconds=compile_seconds,
        compiled_flops_per_step=cost.flops * n,
        estimated_step_seconds=step_seconds,
        estimated_mfu=mfu,
    )
