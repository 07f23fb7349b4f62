"""The JAX trainer: one recipe in, a run dir with metrics, checkpoints and a loss curve out.

Run it with ``uv run --frozen olmo-train-jax [RECIPE.yaml] [--key=value ...]`` (see cli.py);
with no recipe it trains the default toy job (model "small", the embedded sample mixture,
100 steps of 16 x 512 tokens).

What one optimizer step s (1-based) does, identically to the Torch trainer:

- global batch s-1 of the mixture order, split over (data, fsdp) and over ``accumulation``
  micro-steps (``olmo_run.recipe.batch_layout``) inside ONE jitted function (``lax.scan``);
  attention stays inside each document only with ``train.document_masking``;
- loss = (sum of token CE + z_loss_weight x sum of logsumexp^2) / (valid tokens in the GLOBAL
  batch), so the value and the gradient do not depend on the device count or accumulation;
- MoE specs add ``moe.aux_loss`` (load balancing + router z-loss) of each micro-step's
  global micro-batch, averaged over the micro-steps (zero weight unless ``moe.routing`` is
  learned); routing (``moe.routing``) runs in the global view, so uniform numbers the tokens
  of the global micro-batch and random draws its scores from (seed, step, micro-step,
  layer) whatever the layout; the routed experts run per device under
  ``expert_parallel.apply_expert_parallel`` (an all-to-all over ``jax.mesh.expert`` when it
  is > 1; MXFP8-emulated with ``moe.mxfp8``); the train line gains the moe_* keys;
- grad norm: global L2 over all gradients in float32, clipped by torch's clip_grad_norm_
  formula scale = min(1, clip / (norm + 1e-6)); the logged norm is the one before clipping;
- AdamW (optax's scale_by_adam + add_decayed_weights, decoupled; no decay on the input
  embedding unless optim.decay_embeddings, norms decayed iff optim.decay_norms) with the LR of
  ``recipe.schedule.lr(s, ...)`` computed on the host and passed in as an argument;
- with the spike guard enabled the step is split in two jitted calls (gradients, then the
  update) so that the host can decide to skip: a skipped step changes no parameter, moment or
  Adam count, and its batch counts as consumed.

Precision fp32 runs everything in float32 (matmuls at "highest" precision); bf16 keeps float32
master weights and AdamW state and runs the model's matmuls in bfloat16, loss and reductions
in float32.

Start-up order: recipe -> spec -> mixture and leakage check -> mesh and batch layout -> the
checkpoint to resume (checked against spec, framework and mixture fingerprint), or else the
``recipe.init`` source (``olmo_run.init_source``: hf:DIR, a checkpoint, RUN/checkpoints/latest
or a run dir; weights, plus AdamW state with init.load_optimizer) -> only then is anything
written to the run dir, so bad input leaves it untouched.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_data.order import IGNORE_INDEX  # the loader's label for "no next token"
from olmo_model import ModelSpec, resolve_device_kind
from olmo_run import RunPlan, StepResult, announce_finished, plan_run, run
from olmo_run.decay import decay_group, group_weight_decay
from olmo_run.driver import check_shared_run_dir
from olmo_run.errors import TrainingStateError
from olmo_run.metrics import perplexity
from olmo_run.recipe import Recipe
from olmo_run.run_dir import RunPath
from olmo_run.spike_guard import SpikeGuard

from . import sharding
from .checkpoint import Checkpointer, abstract_like, restore_state
from .expert_parallel import apply_expert_parallel
from .hf_adapter import initial_params, model_from_hf, validate_hf
from .model import OlmoModel, build_model
from .moe import MoEStats, aux_loss, moe_metrics

FRAMEWORK = "jax"
# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing (kept for parity).
CLIP_EPS = 1e-6
BATCH_KEYS = ("input_ids", "labels", "doc_ids")


# ---- the maths of one step -----------------------------------------------------------------


def token_loss_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of CE, sum of logsumexp^2, valid tokens) over labels != -100, in float32, from
    materialised logits: the plain loss that the trainer's fused ``head_loss.head_loss_sums``
    is tested and benchmarked against (the trainer itself never builds full logits)."""
    logits = logits.astype(jnp.float32)
    valid = labels != IGNORE_INDEX
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(valid, lse - target, 0.0))
    z = jnp.sum(jnp.where(valid, lse * lse, 0.0))
    return ce, z, jnp.sum(valid).astype(jnp.float32)


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def decay_mask(params: dict, recipe: Recipe) -> dict:
    """True where AdamW applies weight decay: ``olmo_run.decay``'s groups, by parameter name
    (Olmo 3: not on the input embedding)."""

    def decays(path, _) -> bool:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        return group_weight_decay(decay_group(name), recipe.optim) > 0

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(params: dict, recipe: Recipe) -> optax.GradientTransformation:
    """optax.adamw without its learning-rate stage: the trainer multiplies by the host LR itself,
    so the schedule stays a host function shared with the Torch trainer."""
    o = recipe.optim
    return optax.chain(
        optax.scale_by_adam(b1=o.betas[0], b2=o.betas[1], eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=decay_mask(params, recipe)),
    )


@dataclass(frozen=True, eq=False)
class StepConfig:
    """What the step's programs take besides their array arguments, fixed when they are built and
    bound before ``jax.jit`` (never traced): the model's graph (``nnx.merge`` with the parameters
    gives the model), the mesh (the context layout's column order), ``moe.routing`` (learned for
    a dense spec), ``train.document_masking`` (without it a query sees earlier documents of its
    window, as Olmo 3 trains), the key that random routing folds (step, micro-step) into, and the
    parameters' shardings (where the gradients are pinned)."""

    graphdef: Any
    spec: ModelSpec
    mesh: jax.sharding.Mesh
    routing: str
    document_masking: bool
    seed_key: jax.Array
    params_sharding: Any


def column_positions(mesh: jax.sharding.Mesh, seq_len: int) -> jax.Array | None:
    """Each column's true position under context parallelism (its columns are in the context
    layout's order); None without it (0 .. S-1)."""
    order = sharding.sequence_positions(mesh, seq_len)
    return None if order is None else jnp.asarray(order)


def micro_loss(params: dict, micro: dict, n_tokens: jax.Array, accumulation: int, routing_key: Any, cfg: StepConfig):
    """What ``jax.grad`` differentiates for one micro-batch: its loss sum over the valid tokens of
    the GLOBAL batch, plus its share (1 / accumulation) of the MoE aux loss; aux (ce sum, z sum,
    MoE stats). The model runs the head and the loss fused (``ModelOutput.loss_sums``)."""
    model = nnx.merge(cfg.graphdef, params)
    input_ids = micro["input_ids"]
    out = model(
        input_ids,
        micro["doc_ids"] if cfg.document_masking else None,
        micro["labels"],
        routing=cfg.routing,
        routing_key=routing_key,
        positions=column_positions(cfg.mesh, input_ids.shape[-1]),
    )
    loss = out.loss_sums[0] / n_tokens
    if out.moe is not None:
        # Each micro-step's aux losses cover its global micro-batch; the step's aux term is
        # their mean over micro-steps (as the Torch trainer does).
        assert cfg.spec.moe is not None  # only MoE layers return stats
        loss = loss + aux_loss(out.moe, cfg.spec.moe, cfg.routing) / accumulation
    return loss, (out.loss_sums[1], out.loss_sums[2], out.moe)


def micro_grads(
    params: dict, micro: dict, n_tokens: jax.Array, accumulation: int, step_key: jax.Array, cfg: StepConfig
):
    """(gradients, ce sum, z sum, MoE stats) of one micro-batch; random routing draws its scores
    from (seed, step, micro-step) here and the layer in the model."""
    routing_key = jax.random.fold_in(step_key, micro["index"]) if cfg.routing == "random" else None
    grads, (ce, z, moe_stats) = jax.grad(micro_loss, has_aux=True)(
        params, micro, n_tokens, accumulation, routing_key, cfg
    )
    return grads, ce, z, moe_stats


def _add_micro_step(params, n_tokens, accumulation, step_key, cfg, carry, micro):
    """``lax.scan`` body of ``accumulate``: one micro-step's gradients and sums added to the carry."""
    acc, ce_sum, z_sum, moe_sum = carry
    g, ce, z, moe_stats = micro_grads(params, micro, n_tokens, accumulation, step_key, cfg)
    if moe_stats is not None:
        moe_sum = jax.tree.map(jnp.add, moe_sum, moe_stats)
    return (jax.tree.map(jnp.add, acc, g), ce_sum + ce, z_sum + z, moe_sum), None


def accumulate(params: dict, batch: dict, n_tokens: jax.Array, step_key: jax.Array, cfg: StepConfig):
    """(gradients, ce sum, z sum, MoE stats summed) over the ``accumulation`` micro-batches of
    ``batch`` [accumulation, rows, seq], in order."""
    accumulation = batch["labels"].shape[0]
    micros = {**batch, "index": jnp.arange(accumulation, dtype=jnp.int32)}
    if accumulation == 1:
        # No accumulator: a zero-filled parameter-sized buffer plus an add of it are two passes
        # over every parameter's size for nothing (bitwise the same sums).
        return micro_grads(params, jax.tree.map(lambda a: a[0], micros), n_tokens, accumulation, step_key, cfg)
    # A scan from zeros traces the model once (peeling the first micro-step would compile it twice).
    zero = jax.tree.map(jnp.zeros_like, params)
    moe_zero = None
    if cfg.spec.moe is not None:
        counts = jnp.zeros(cfg.spec.moe.n_experts, jnp.int32)
        moe_zero = MoEStats(jnp.float32(0), jnp.float32(0), counts, jnp.int32(0))
    body = partial(_add_micro_step, params, n_tokens, accumulation, step_key, cfg)
    (grads, ce, z, moe_sum), _ = jax.lax.scan(body, (zero, jnp.float32(0), jnp.float32(0), moe_zero), micros)
    return grads, ce, z, moe_sum


def loss_and_grads(params: dict, batch: dict, step: jax.Array, cfg: StepConfig) -> tuple[dict, dict[str, Any]]:
    """(gradients, stats) of one optimizer step over the global ``batch`` [accumulation, rows,
    seq] (``BATCH_KEYS``); ``step``, the 1-based step, seeds random routing. Stats: loss, ce_loss,
    z_loss over the valid tokens of the whole global batch (all micro-steps, all devices), the
    global gradient norm, and for MoE the step's routing stats (``moe``)."""
    n_tokens = jnp.maximum(jnp.sum(batch["labels"] != IGNORE_INDEX).astype(jnp.float32), 1.0)
    accumulation = batch["labels"].shape[0]
    step_key = jax.random.fold_in(cfg.seed_key, step)
    grads, ce, z, moe_sum = accumulate(params, batch, n_tokens, step_key, cfg)
    grads = jax.lax.with_sharding_constraint(grads, cfg.params_sharding)
    z_weight = cfg.spec.z_loss_weight
    stats = {
        "loss": (ce + z_weight * z) / n_tokens,
        "ce_loss": ce / n_tokens,
        "z_loss": z / n_tokens,
        "grad_norm": global_norm(grads),
    }
    if moe_sum is not None:
        # Losses: mean over micro-steps; counts and drops: summed over the whole step.
        moe_step = moe_sum._replace(
            load_balancing=moe_sum.load_balancing / accumulation, router_z=moe_sum.router_z / accumulation
        )
        assert cfg.spec.moe is not None  # only MoE layers return stats
        stats["loss"] = stats["loss"] + aux_loss(moe_step, cfg.spec.moe, cfg.routing)
        stats["moe"] = moe_step
    return grads, stats


def apply_update(
    params: dict,
    opt_state: Any,
    grads: dict,
    grad_norm: jax.Array,
    lr: jax.Array,
    tx: optax.GradientTransformation,
    clip: float | None,
) -> tuple[dict, Any]:
    """(params, AdamW state) after one update: gradients clipped to ``clip`` by torch's
    clip_grad_norm_ formula (``grad_norm`` is the one before clipping), AdamW, then the host LR."""
    if clip is not None:
        scale = jnp.minimum(1.0, clip / (grad_norm + CLIP_EPS))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
    return params, opt_state


def fused_step(params, opt_state, batch, lr, step, cfg: StepConfig, tx: optax.GradientTransformation, clip):
    """``apply_update(loss_and_grads(...))`` in one program: (params, AdamW state, stats)."""
    grads, stats = loss_and_grads(params, batch, step, cfg)
    params, opt_state = apply_update(params, opt_state, grads, stats["grad_norm"], lr, tx, clip)
    return params, opt_state, stats


def eval_sums(params: dict, input_ids: jax.Array, labels: jax.Array, doc_ids: jax.Array, cfg: StepConfig):
    """(CE sum, valid tokens) of one evaluation batch [rows, seq], learned routing: a held-out
    loss is the ratio of their totals over the source's batches."""
    model = nnx.merge(cfg.graphdef, params)
    documents = doc_ids if cfg.document_masking else None
    out = model(input_ids, documents, labels, positions=column_positions(cfg.mesh, input_ids.shape[-1]))
    return out.loss_sums[1], jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)


@dataclass
class StepFunctions:
    """The jitted programs of a step (each has ``.lower`` for an ahead-of-time compile, as
    ``dry_run`` does): ``grads(params, batch, step)`` -> (gradients, stats); ``apply(params,
    opt_state, grads, grad_norm, lr)``; ``fused(params, opt_state, batch, lr, step)`` -> (params,
    opt_state, stats), both in one program, the state donated; ``evaluate(params, input_ids,
    labels, doc_ids)`` -> (CE sum, valid tokens). ``step`` is the 1-based step as np.int32 (it
    seeds random MoE routing; unused otherwise), ``lr`` an np.float32."""

    grads: Any
    apply: Any
    fused: Any
    evaluate: Any


def step_functions(m: MeshModel, spec: ModelSpec, recipe: Recipe, mesh: jax.sharding.Mesh) -> StepFunctions:
    """The step's functions jitted for ``m`` (a model made ready for ``mesh`` by ``for_mesh``):
    the batch split as ``sharding.batch_sharding``, parameters and AdamW state where ``for_mesh``
    put them, stats replicated, the state donated to the update."""
    cfg = StepConfig(
        graphdef=m.graphdef,
        spec=spec,
        mesh=mesh,
        routing=recipe.moe.routing if spec.moe is not None else "learned",
        document_masking=recipe.train.document_masking,
        seed_key=jax.random.key(recipe.train.seed),
        params_sharding=m.params_sh,
    )
    replicated = NamedSharding(mesh, P())
    batch_in = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
    stats_out: dict[str, Any] = {k: replicated for k in ("loss", "ce_loss", "z_loss", "grad_norm")}
    if spec.moe is not None:
        # ignore: the NamedTuple as a pytree of shardings, mirroring the stats it places.
        stats_out["moe"] = MoEStats(replicated, replicated, replicated, replicated)  # type: ignore[arg-type]
    params_sh, opt_sh, clip = m.params_sh, m.opt_sh, recipe.optim.grad_clip
    return StepFunctions(
        grads=jax.jit(
            partial(loss_and_grads, cfg=cfg),
            in_shardings=(params_sh, batch_in, replicated),
            out_shardings=(params_sh, stats_out),
        ),
        apply=jax.jit(
            partial(apply_update, tx=m.tx, clip=clip),
            in_shardings=(params_sh, opt_sh, params_sh, replicated, replicated),
            out_shardings=(params_sh, opt_sh),
            donate_argnums=(0, 1),
        ),
        fused=jax.jit(
            partial(fused_step, cfg=cfg, tx=m.tx, clip=clip),
            in_shardings=(params_sh, opt_sh, batch_in, replicated, replicated),
            out_shardings=(params_sh, opt_sh, stats_out),
            donate_argnums=(0, 1),
        ),
        evaluate=jax.jit(partial(eval_sums, cfg=cfg), out_shardings=(replicated, replicated)),
    )


@jax.jit
def all_finite(*trees: Any) -> jax.Array:
    """Whether every floating-point leaf of the trees is finite (integer leaves, such as
    AdamW's step count, always are): checked before a state is checkpointed."""
    leaves = [x for t in trees for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


@dataclass
class MeshModel:
    """A model made ready for a mesh and split: its graphdef, its parameters (a pure dict,
    concrete or abstract, as the model was), the optimizer and the shardings of both states."""

    graphdef: Any
    params: dict
    tx: optax.GradientTransformation
    params_sh: dict
    abstract_opt: Any
    opt_sh: Any


def for_mesh(model: OlmoModel, spec: ModelSpec, recipe: Recipe, mesh: jax.sharding.Mesh) -> MeshModel:
    """What the trainer, ``placed_step`` and ``dry_run`` do to a freshly built model before its
    step: tell it how many devices share the batch (XLA:CPU attention loops over each device's
    own rows), the platform of the mesh's devices (the kernels are chosen for it, not for the
    host) and where its residual stream lives (batch split over the data-parallel axes), route
    MoE experts per device (an all-to-all over the expert axis), split it, and derive the
    optimizer and the parameter / AdamW-state shardings."""
    model.batch_shards = sharding.dp_size(mesh)
    model.platform = mesh.devices.flat[0].platform
    model.hidden_sharding = NamedSharding(mesh, sharding.hidden_spec(mesh))
    model.context = sharding.context_setup(mesh, spec)  # sequence split over the context axis
    if spec.moe is not None:
        apply_expert_parallel(model, mesh, mxfp8=recipe.moe.mxfp8, gemm=recipe.jax.moe_gemm)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx = make_optimizer(params, recipe)
    params_sh = sharding.param_shardings(params, spec, mesh)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = sharding.state_shardings(abstract_opt, params_sh, mesh)
    return MeshModel(graphdef, params, tx, params_sh, abstract_opt, opt_sh)


def placed_step(model: OlmoModel, spec: ModelSpec, recipe: Recipe, mesh_axes: dict[str, int] | None = None):
    """(StepFunctions, [params, opt_state]) for a freshly built ``model`` on a mesh (default:
    every device on ``data``), the parameters and AdamW state placed with the step's own
    shardings (so the first timed step does not recompile): the trainer's step without a run
    dir, for benchmarks and tools. ``fns.fused(*carry, batch, np.float32(lr), np.int32(step))``
    runs one step."""
    mesh = sharding.make_mesh(mesh_axes or {"data": -1})
    m = for_mesh(model, spec, recipe, mesh)
    fns = step_functions(m, spec, recipe, mesh)
    params = jax.device_put(m.params, m.params_sh)
    return fns, [params, jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)]


# ---- throughput reference --------------------------------------------------------------------


def measure_cpu_matmul_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of a size x size matmul on one CPU device of this process, in JAX: the
    honest CPU peak (1024 is large enough to reach the 2048 figure on a 2-core CI machine, at
    an eighth of the work)."""
    dev = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def device_peak() -> tuple[float, str]:
    """(peak FLOP/s per device, label) for MFU: bf16 table peak on accelerators, measured on CPU."""
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        peak = measure_cpu_matmul_peak()
        return peak, f"measured cpu fp32 matmul {peak / 1e9:.1f} GFLOP/s"
    entry = resolve_device_kind(dev.device_kind)
    return entry.bf16_flops_per_device, f"{entry.kind} bf16 {entry.bf16_flops_per_device / 1e12:.0f} TFLOP/s"


# ---- the run: the JAX side of olmo_run's driver ---------------------------------------------


def train(recipe: Recipe) -> RunPath:
    """Run (or resume) the recipe's training job on this process; returns the run dir. Every
    process checks the same inputs and reads the run dir before any process writes it, so bad
    input (a layout that cannot work included) stops every process with the same line."""
    sharding.initialize_distributed(recipe)
    is_main = jax.process_index() == 0
    if is_main:
        print("# resolved recipe\n" + recipe.to_yaml(), flush=True)
    mesh = sharding.make_mesh(recipe.jax.mesh)
    print(sharding.describe_process(mesh), flush=True)
    # Before the run dir is read: processes that see different run dirs would plan different runs.
    check_shared_run_dir(recipe.resolved_run_dir(), jax.process_index(), jax.process_count(), sharding.all_gather_text)
    with sharding.stop_together():
        plan = plan_run(
            recipe,
            FRAMEWORK,
            dp_size=sharding.dp_size(mesh),
            loader_rank=sharding.process_batch_shards(mesh),
            loader_size=sharding.dp_size(mesh),
        )
        sharding.check_layout(mesh, recipe, plan.spec, plan.sequence_length)
        init_tensors = None
        if plan.init is not None and plan.init.is_hf:  # read and checked before anything is written
            from safetensors.numpy import load_file

            init_tensors = {k: v for f in plan.init.safetensors_files() for k, v in load_file(f).items()}
            validate_hf(plan.spec, init_tensors, source=f"init.checkpoint={recipe.init.checkpoint}")
    if announce_finished(plan, is_main):
        return plan.run_dir
    return run(
        plan,
        partial(JaxTrainModule, plan, mesh, init_tensors),
        is_main=is_main,
        describe=[],  # the process line above holds the mesh
        title=f"olmo-train-jax: {plan.run_dir}",
    )


def _put_eval_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """Every process holds the whole evaluation batch; split it over data-parallel devices when
    its rows divide, else replicate it (a short last batch); columns in the context layout's
    order and split over the context axis under CP."""
    sh = sharding.eval_sharding(mesh, batch["input_ids"].shape[0])
    cols = {k: sharding.to_context_order(batch[k], mesh) for k in BATCH_KEYS}
    # ignore: mypy cannot infer a lambda whose default binds the array (one per key).
    return {k: jax.make_array_from_callback(cols[k].shape, sh, lambda idx, a=cols[k]: a[idx]) for k in BATCH_KEYS}  # type: ignore[misc]


class JaxTrainModule:
    """The JAX trainer's state (parameters and AdamW state placed on the mesh) and its jitted
    step, eval and Orbax checkpoints, as ``olmo_run.TrainModule``."""

    framework = FRAMEWORK

    def __init__(self, plan: RunPlan, mesh: jax.sharding.Mesh, init_tensors: dict[str, np.ndarray] | None):
        recipe, spec = plan.recipe, plan.spec
        self.plan, self.mesh = plan, mesh
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
        if plan.resume is not None:
            step, ckpt, _ = plan.resume
            self.params, self.opt_state, saved_step = restore_state(ckpt, abstract_params, abstract_opt)
            if saved_step != step:
                raise TrainingStateError(f"{ckpt}: state holds step {saved_step} but meta.json says {step}; damaged")
        else:
            self.params, self.opt_state = _initial_state(plan, init_tensors, abstract_params, abstract_opt)
            if self.opt_state is None:
                self.opt_state = jax.jit(prepared.tx.init, out_shardings=prepared.opt_sh)(self.params)
        self.fns = step_functions(prepared, spec, recipe, mesh)
        self.n_devices = jax.device_count()
        # Only process 0 writes the train line, whose MFU the peak divides (see the torch trainer).
        self.peak = device_peak() if jax.process_index() == 0 else (math.nan, "measured by process 0")
        self.checkpointer = Checkpointer(plan.run_dir, recipe.checkpoint.keep, recipe.checkpoint.async_save)

    def train_step(self, local: dict[str, np.ndarray], step: int, lr: float, guard: SpikeGuard) -> StepResult:
        layout = self.plan.layout
        batch = {
            k: sharding.global_batch_array(local[k], self.mesh, layout.accumulation_steps, layout.global_batch)
            for k in BATCH_KEYS
        }
        lr_arg, step_arg = np.float32(lr), np.int32(step)
        if guard.enabled:
            grads, stats = self.fns.grads(self.params, batch, step_arg)
            skipped = guard.decide(step, float(stats["loss"]), float(stats["grad_norm"]))
            if not skipped:
                self.params, self.opt_state = self.fns.apply(
                    self.params, self.opt_state, grads, stats["grad_norm"], lr_arg
                )
            del grads
        else:
            # The update is applied in the same program; a non-finite loss stops the run here,
            # before anything of that state is saved.
            self.params, self.opt_state, stats = self.fns.fused(self.params, self.opt_state, batch, lr_arg, step_arg)
            skipped = guard.decide(step, float(stats["loss"]), float(stats["grad_norm"]))
        moe_step = stats.pop("moe", None)
        values = {k: float(v) for k, v in stats.items()}
        # The MoE contract's moe_* keys.
        extra = {} if moe_step is None else moe_metrics(moe_step, ep_size=sharding.expert_size(self.mesh))
        return StepResult(values["loss"], values["ce_loss"], values["z_loss"], values["grad_norm"], skipped, extra)

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Token-weighted CE over each held-out source's fixed evaluation set."""
        out = {}
        for name in self.plan.mixture.held_out_sources:
            ce_total, n_total = 0.0, 0.0
            for batch in self.plan.loader.eval_batches(name, self.plan.recipe.eval.batch_size):
                b = _put_eval_batch(batch, self.mesh)
                ce, n = self.fns.evaluate(self.params, b["input_ids"], b["labels"], b["doc_ids"])
                ce_total += float(ce)
                n_total += float(n)
            loss = ce_total / max(n_total, 1.0)
            out[name] = {"loss": loss, "perplexity": perplexity(loss), "tokens": int(n_total)}
        return out

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

    def memory(self) -> tuple[float, float, str] | None:
        """The fullest local device's bytes in use and peak (TPU and GPU report them; CPU does not)."""
        stats = [d.memory_stats() for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        if not stats or any(s is None for s in stats):
            return None
        return (
            float(max(s.get("bytes_in_use", 0) for s in stats)),
            float(max(s.get("peak_bytes_in_use", 0) for s in stats)),
            "device",
        )

    def start_trace(self, folder: Path) -> None:
        jax.profiler.start_trace(str(folder))  # TensorBoard's profile plugin layout (xplane.pb)

    def stop_trace(self) -> None:
        jax.profiler.stop_trace()

    def all_gather_text(self, text: str) -> list[str]:
        return sharding.all_gather_text(text)

    def close(self) -> None:
        self.checkpointer.close()


def _initial_state(
    plan: RunPlan, init_tensors: dict[str, np.ndarray] | None, abstract_params: Any, abstract_opt: Any
) -> tuple[Any, Any | None]:
    """(params, AdamW state or None) to start from: fresh weights from recipe.train.seed
    (``olmo_model.init``, the torch trainer's), or init.checkpoint's weights (and moments when
    init.load_optimizer), on the current mesh."""
    init = plan.init
    params_sh = jax.tree.map(lambda a: a.sharding, abstract_params)
    if init is None:
        return initial_params(plan.spec, plan.recipe.train.seed, abstract_params), None
    if init_tensors is not None:
        pure = nnx.to_pure_dict(nnx.split(model_from_hf(plan.spec, init_tensors))[1])
        return jax.tree.map(jax.device_put, pure, params_sh), None
    params, opt_state, _ = restore_state(init.path, abstract_params, abstract_opt if init.load_optimizer else None)
    return params, opt_state
