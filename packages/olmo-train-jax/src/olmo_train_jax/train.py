"""The JAX trainer: one recipe in, a run dir with metrics, checkpoints and a loss curve out.

Run it with ``uv run --frozen olmo-train-jax [RECIPE.yaml] [--key=value ...]`` (see cli.py);
with no recipe it trains the default toy job (model "small", the embedded sample mixture,
100 steps of 16 x 512 tokens).

What one optimizer step s (1-based) does, identically to the Torch trainer:

- global batch s-1 of the mixture order, split over (data, fsdp) and over ``accumulation``
  micro-steps (``olmo_model.recipe.batch_layout``) inside ONE jitted function (``lax.scan``);
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
``recipe.init`` source (``olmo_model.init_source``: hf:DIR, a checkpoint, RUN/checkpoints/latest
or a run dir; weights, plus AdamW state with init.load_optimizer) -> only then is anything
written to the run dir, so bad input leaves it untouched.

Test hook: the environment variable ``OLMO_TEST_KILL_AFTER_CHECKPOINT=N`` makes the process
SIGKILL itself right after the step-N checkpoint is committed (used by the exact-resume tests).
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
from olmo_data import Mixture, MixtureLoader, open_training_mixture
from olmo_model import ModelSpec, flops_per_token, mfu, resolve_device_kind
from olmo_model.init_source import InitSource, resolve_init
from olmo_model.recipe import BatchLayout, Recipe, batch_layout
from olmo_model.runlog import (
    MetricsLog,
    ProgressConsole,
    SpikeGuard,
    TrainingStateError,
    find_resume,
    plot_loss,
    prepare_run_dir,
    print_summary,
    training_meta,
)

from . import sharding
from .checkpoint import Checkpointer, abstract_like, restore_state
from .expert_parallel import apply_expert_parallel
from .hf_adapter import model_from_hf, validate_hf
from .head_loss import head_loss_sums
from .model import build_model
from .moe import MoEStats, aux_loss, moe_metrics

FRAMEWORK = "jax"
IGNORE_INDEX = -100
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
    """True where AdamW applies weight decay (Olmo 3: not on the input embedding)."""

    def decays(path, _):
        name = path[-1].key
        if name == "embed":
            return recipe.optim.decay_embeddings
        if name.endswith("norm"):
            return recipe.optim.decay_norms
        return True

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(params: dict, recipe: Recipe) -> optax.GradientTransformation:
    """optax.adamw without its learning-rate stage: the trainer multiplies by the host LR itself,
    so the schedule stays a host function shared with the Torch trainer."""
    o = recipe.optim
    return optax.chain(
        optax.scale_by_adam(b1=o.betas[0], b2=o.betas[1], eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=decay_mask(params, recipe)),
    )


@dataclass
class StepFunctions:
    """Jitted pieces of a step; ``fused`` = ``apply(grads(...))`` in one program.

    ``grads(params, batch, step=0)`` and ``fused(params, opt_state, batch, lr, step=0)``
    take the 1-based step, which seeds random MoE routing (unused otherwise)."""

    grads: Any
    apply: Any
    fused: Any
    evaluate: Any


def make_step_functions(
    graphdef: Any,
    spec: ModelSpec,
    recipe: Recipe,
    tx: optax.GradientTransformation,
    params_sharding: Any,
    opt_sharding: Any,
    mesh: jax.sharding.Mesh,
) -> StepFunctions:
    z_weight = spec.z_loss_weight
    clip = recipe.optim.grad_clip
    # Without train.document_masking a query sees earlier documents of its window (Olmo 3).
    masking = recipe.train.document_masking
    replicated = NamedSharding(mesh, P())
    batch_sh = sharding.batch_sharding(mesh)
    routing = recipe.moe.routing if spec.moe is not None else "learned"
    seed_key = jax.random.key(recipe.train.seed)
    dp = sharding.dp_size(mesh)  # batch rows split over this many devices (head_loss chunking)

    def micro_loss(params, input_ids, labels, doc_ids, n_tokens, accumulation, routing_key):
        model = nnx.merge(graphdef, params)
        hidden, moe_stats = model.forward_with_aux(
            input_ids, doc_ids if masking else None, routing=routing, routing_key=routing_key, head=False
        )
        # Head + CE + z-loss chunk by chunk, gradient included (head_loss.py): the full
        # [tokens, vocab] logits never exist.
        objective, ce, z, _ = head_loss_sums(hidden, model.head_weight(), labels, z_weight, batch_shards=dp)
        loss = objective / n_tokens
        if moe_stats is not None:
            # Each micro-step's aux losses cover its global micro-batch; the step's aux term
            # is their mean over micro-steps (as the Torch trainer does).
            loss = loss + aux_loss(moe_stats, spec.moe, routing) / accumulation
        return loss, (ce, z, moe_stats)

    def grads_and_stats(params, batch, step):
        # Normalise by the valid tokens of the whole global batch (all micro-steps, all devices).
        n_tokens = jnp.maximum(jnp.sum(batch["labels"] != IGNORE_INDEX).astype(jnp.float32), 1.0)
        accumulation = batch["labels"].shape[0]
        grad_fn = jax.grad(micro_loss, has_aux=True)
        step_key = jax.random.fold_in(seed_key, step)

        def micro_grads(micro):
            # Random routing's scores: (seed, step, micro-step) here, the layer in the model.
            routing_key = jax.random.fold_in(step_key, micro["index"]) if routing == "random" else None
            g, (ce, z, moe_stats) = grad_fn(
                params, micro["input_ids"], micro["labels"], micro["doc_ids"], n_tokens, accumulation, routing_key
            )
            return g, ce, z, moe_stats

        def micro_step(carry, micro):
            acc, ce_sum, z_sum, moe_sum = carry
            g, ce, z, moe_stats = micro_grads(micro)
            if moe_stats is not None:
                moe_sum = jax.tree.map(jnp.add, moe_sum, moe_stats)
            return (jax.tree.map(jnp.add, acc, g), ce_sum + ce, z_sum + z, moe_sum), None

        micros = {**batch, "index": jnp.arange(accumulation, dtype=jnp.int32)}
        if accumulation == 1:
            # No accumulator: a zero-filled parameter-sized buffer plus an add of it are two
            # passes over every parameter's size for nothing (bitwise the same sums).
            grads, ce, z, moe_sum = micro_grads(jax.tree.map(lambda a: a[0], micros))
        else:
            # A scan from zeros traces the model once (peeling the first micro-step would
            # compile it twice).
            zero = jax.tree.map(jnp.zeros_like, params)
            moe_zero = None
            if spec.moe is not None:
                counts = jnp.zeros(spec.moe.n_experts, jnp.int32)
                moe_zero = MoEStats(jnp.float32(0), jnp.float32(0), counts, jnp.int32(0))
            (grads, ce, z, moe_sum), _ = jax.lax.scan(
                micro_step, (zero, jnp.float32(0), jnp.float32(0), moe_zero), micros
            )
        grads = jax.lax.with_sharding_constraint(grads, params_sharding)
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
            stats["loss"] = stats["loss"] + aux_loss(moe_step, spec.moe, routing)
            stats["moe"] = moe_step
        return grads, stats

    def apply_update(params, opt_state, grads, grad_norm, lr):
        if clip is not None:
            scale = jnp.minimum(1.0, clip / (grad_norm + CLIP_EPS))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        return params, opt_state

    def fused(params, opt_state, batch, lr, step):
        grads, stats = grads_and_stats(params, batch, step)
        params, opt_state = apply_update(params, opt_state, grads, stats["grad_norm"], lr)
        return params, opt_state, stats

    def evaluate(params, input_ids, labels, doc_ids):
        model = nnx.merge(graphdef, params)
        hidden, _ = model.forward_with_aux(input_ids, doc_ids if masking else None, head=False)
        _, ce, _, n = head_loss_sums(hidden, model.head_weight(), labels, z_weight, batch_shards=dp)
        return ce, n

    batch_in = {k: batch_sh for k in BATCH_KEYS}
    stats_out = {k: replicated for k in ("loss", "ce_loss", "z_loss", "grad_norm")}
    if spec.moe is not None:
        stats_out["moe"] = MoEStats(replicated, replicated, replicated, replicated)
    grads_jit = jax.jit(
        grads_and_stats,
        in_shardings=(params_sharding, batch_in, replicated),
        out_shardings=(params_sharding, stats_out),
    )
    fused_jit = jax.jit(
        fused,
        in_shardings=(params_sharding, opt_sharding, batch_in, replicated, replicated),
        out_shardings=(params_sharding, opt_sharding, stats_out),
        donate_argnums=(0, 1),
    )
    return StepFunctions(
        grads=lambda params, batch, step=0: grads_jit(params, batch, np.int32(step)),
        apply=jax.jit(
            apply_update,
            in_shardings=(params_sharding, opt_sharding, params_sharding, replicated, replicated),
            out_shardings=(params_sharding, opt_sharding),
            donate_argnums=(0, 1),
        ),
        fused=lambda params, opt_state, batch, lr, step=0: fused_jit(params, opt_state, batch, lr, np.int32(step)),
        evaluate=jax.jit(evaluate, out_shardings=(replicated, replicated)),
    )


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


def for_mesh(model: nnx.Module, spec: ModelSpec, recipe: Recipe, mesh: jax.sharding.Mesh) -> MeshModel:
    """What the trainer and ``placed_step`` both do to a freshly built model before its step:
    tell it how many devices share the batch (XLA:CPU attention loops over each device's own
    rows), route MoE experts per device (an all-to-all over the expert axis), split it, and
    derive the optimizer and the parameter / AdamW-state shardings."""
    model.batch_shards = sharding.dp_size(mesh)
    if spec.moe is not None:
        apply_expert_parallel(model, mesh, mxfp8=recipe.moe.mxfp8)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx = make_optimizer(params, recipe)
    params_sh = sharding.param_shardings(params, spec, mesh)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = sharding.state_shardings(abstract_opt, params_sh, mesh)
    return MeshModel(graphdef, params, tx, params_sh, abstract_opt, opt_sh)


def placed_step(model: nnx.Module, spec: ModelSpec, recipe: Recipe, mesh_axes: dict[str, int] | None = None):
    """(StepFunctions, [params, opt_state]) for a freshly built ``model`` on a mesh (default:
    every device on ``data``), the parameters and AdamW state placed with the step's own
    shardings (so the first timed step does not recompile): the trainer's step without a run
    dir, for benchmarks and tools. ``fns.fused(*carry, batch, lr)`` runs one step."""
    mesh = sharding.make_mesh(mesh_axes or {"data": -1})
    m = for_mesh(model, spec, recipe, mesh)
    fns = make_step_functions(m.graphdef, spec, recipe, m.tx, m.params_sh, m.opt_sh, mesh)
    params = jax.device_put(m.params, m.params_sh)
    return fns, [params, jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)]


# ---- throughput reference --------------------------------------------------------------------

def measure_cpu_matmul_peak(size: int = 2048, repeats: int = 3) -> float:
    """Best fp32 FLOP/s of a size x size matmul on one CPU device, in JAX: the honest CPU peak."""
    dev = jax.devices("cpu")[0]
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
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        peak = measure_cpu_matmul_peak()
        return peak, f"measured cpu fp32 matmul {peak / 1e9:.1f} GFLOP/s"
    entry = resolve_device_kind(dev.device_kind)
    return entry.bf16_flops_per_device, f"{entry.kind} bf16 {entry.bf16_flops_per_device / 1e12:.0f} TFLOP/s"


# ---- start-up: everything that can fail before the run dir is touched ------------------------

@dataclass
class Plan:
    recipe: Recipe
    spec: ModelSpec
    mixture: Mixture
    sequence_length: int
    layout: BatchLayout
    mesh: jax.sharding.Mesh
    total_steps: int
    loader: MixtureLoader
    resume: tuple[int, Path, dict] | None  # (step, checkpoint dir, meta)
    init: InitSource | None  # recipe.init, resolved and checked (None when resuming)
    init_tensors: dict[str, np.ndarray] | None  # HF weights of init.checkpoint=hf:DIR, validated


def plan_run(recipe: Recipe) -> Plan:
    """Check everything that can be checked without writing: raises RecipeError, SpecError,
    DataError or TrainingStateError with a one-line message."""
    spec = recipe.model_spec()
    mixture = open_training_mixture(
        recipe.data.mixture,
        sequence_length=recipe.train.sequence_length,
        model_vocab_size=spec.vocab_size,
        max_positions=spec.max_position_embeddings,
        allow_leakage=recipe.data.allow_leakage,
    )
    seq = mixture.sequence_length
    global_batch = recipe.global_batch_sequences(seq)
    mesh = sharding.make_mesh(recipe.jax.mesh)
    sharding.check_mesh_for_spec(mesh, spec)
    layout = batch_layout(global_batch, sharding.dp_size(mesh), recipe.train.micro_batch_size)
    total = recipe.total_steps()
    loader = MixtureLoader(
        mixture, global_batch, dp_rank=jax.process_index(), dp_size=jax.process_count(), prefetch=recipe.data.prefetch
    )
    resume = find_resume(recipe.resolved_run_dir(), recipe, spec, FRAMEWORK, loader, total)
    init, init_tensors = None, None
    if resume is None:
        init = resolve_init(recipe, spec, FRAMEWORK)
        if init is not None and init.is_hf:
            init_tensors = _read_safetensors(init.path)
            validate_hf(spec, init_tensors, source=f"init.checkpoint={recipe.init.checkpoint}")
    return Plan(recipe, spec, mixture, seq, layout, mesh, total, loader, resume, init, init_tensors)


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


# ---- the run -------------------------------------------------------------------------------

def _put_eval_batch(batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """Every process holds the whole evaluation batch; split it over data-parallel devices when
    its rows divide, else replicate it (a short last batch)."""
    rows = batch["input_ids"].shape[0]
    spec = P(sharding.batch_axes(mesh), None) if rows % sharding.dp_size(mesh) == 0 else P()
    sh = NamedSharding(mesh, spec)
    return {
        k: jax.make_array_from_callback(batch[k].shape, sh, lambda idx, a=batch[k]: a[idx]) for k in BATCH_KEYS
    }


def run_eval(fns: StepFunctions, params: Any, plan: Plan) -> dict[str, dict[str, float]]:
    """Token-weighted CE over each held-out source's fixed evaluation set."""
    out = {}
    for name in plan.mixture.held_out_sources:
        ce_total, n_total = 0.0, 0.0
        for batch in plan.loader.eval_batches(name, plan.recipe.eval.batch_size):
            b = _put_eval_batch(batch, plan.mesh)
            ce, n = fns.evaluate(params, b["input_ids"], b["labels"], b["doc_ids"])
            ce_total += float(ce)
            n_total += float(n)
        loss = ce_total / max(n_total, 1.0)
        out[name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": int(n_total)}
    return out


def train(recipe: Recipe) -> Path:
    """Run (or resume) the recipe's training job; returns the run dir."""
    sharding.initialize_distributed(recipe)
    is_main = jax.process_index() == 0
    if is_main:
        print("# resolved recipe\n" + recipe.to_yaml(), flush=True)
    plan = plan_run(recipe)
    spec, layout, mesh, total = plan.spec, plan.layout, plan.mesh, plan.total_steps
    run_dir = recipe.resolved_run_dir()
    start = plan.resume[0] if plan.resume else 0
    if start == total:
        print(f"{run_dir}: already complete (checkpoint at step {total} of {total}); nothing to do", flush=True)
        return run_dir

    print(sharding.describe_mesh(mesh), flush=True)
    print(f"batch layout: {layout.describe()} (sequence length {plan.sequence_length})", flush=True)
    prepare_run_dir(recipe, spec, is_main)

    compute_dtype = jnp.bfloat16 if recipe.train.precision == "bf16" else jnp.float32
    make_model = partial(build_model, spec, seed=recipe.train.seed, dtype=compute_dtype, remat=recipe.jax.remat,
                         attention=recipe.jax.attention)
    prepared = for_mesh(nnx.eval_shape(make_model), spec, recipe, mesh)
    graphdef, abstract_params, tx = prepared.graphdef, prepared.params, prepared.tx
    params_sh, abstract_opt, opt_sh = prepared.params_sh, prepared.abstract_opt, prepared.opt_sh
    init_opt = jax.jit(tx.init, out_shardings=opt_sh)

    guard = SpikeGuard.from_recipe(recipe)
    if plan.resume:
        step0, ckpt, meta = plan.resume
        params, opt_state, saved_step = restore_state(
            ckpt, abstract_like(abstract_params, params_sh), abstract_like(abstract_opt, opt_sh)
        )
        if saved_step != step0:
            raise TrainingStateError(f"{ckpt}: state holds step {saved_step} but meta.json says {step0}; damaged")
        guard.load_state_dict(meta.get("spike_guard", {}))
        before = meta.get("layout")
        print(
            f"resumed from {ckpt} at step {step0}"
            + (f" (it was written with {BatchLayout(**before).describe()})" if before else ""),
            flush=True,
        )
    else:
        params, opt_state = _initial_state(
            plan, make_model, abstract_like(abstract_params, params_sh), abstract_like(abstract_opt, opt_sh)
        )
        opt_state = init_opt(params) if opt_state is None else opt_state

    fns = make_step_functions(graphdef, spec, recipe, tx, params_sh, opt_sh, mesh)
    peak, peak_label = device_peak()
    n_devices = jax.device_count()
    seq = plan.sequence_length
    tokens_per_step = layout.global_batch * seq
    fpt = flops_per_token(spec, seq)
    metrics = MetricsLog(run_dir, resume_step=start, enabled=is_main)
    checkpointer = Checkpointer(run_dir, recipe.checkpoint.keep, recipe.checkpoint.async_save)
    console = ProgressConsole(recipe.log.progress, is_main, total, start)
    started = time.time()

    def save(step: int) -> None:
        extra = {"spike_guard": guard.state_dict(), "layout": layout.model_dump(), "mesh": dict(mesh.shape)}
        meta = training_meta(FRAMEWORK, step, spec, recipe, plan.loader.state_dict(), extra)
        checkpointer.save(step, params, opt_state, meta)

    def evaluate(step: int) -> None:
        if not plan.mixture.held_out_sources:
            return
        result = run_eval(fns, params, plan)
        metrics.write({"kind": "eval", "step": step, "eval": result})
        console.line(f"eval step {step}: " + ", ".join(
            f"{k} loss {v['loss']:.4f} ppl {v['perplexity']:.2f}" for k, v in result.items()
        ))

    batches = iter(plan.loader)
    try:
        for step in range(start + 1, total + 1):
            # The step time includes waiting for the batch, not checkpointing or evaluation.
            t0 = time.perf_counter()
            local = next(batches)
            batch = {
                k: sharding.global_batch_array(local[k], mesh, layout.accumulation_steps, layout.global_batch)
                for k in BATCH_KEYS
            }
            lr = recipe.schedule.lr(step, recipe.optim.lr, total)
            lr_arg = np.float32(lr)
            if guard.enabled:
                grads, stats = fns.grads(params, batch, step)
                loss, grad_norm = float(stats["loss"]), float(stats["grad_norm"])
                skipped = guard.should_skip(loss, grad_norm)
                if skipped:
                    del grads
                else:
                    guard.record(loss, grad_norm)
                    params, opt_state = fns.apply(params, opt_state, grads, stats["grad_norm"], lr_arg)
            else:
                params, opt_state, stats = fns.fused(params, opt_state, batch, lr_arg, step)
                skipped = False
            moe_step = stats.pop("moe", None)
            values = {k: float(v) for k, v in stats.items()}
            step_time = time.perf_counter() - t0
            tps = tokens_per_step / step_time
            if step % recipe.log.every == 0 or step == total:
                record = {
                    "kind": "train",
                    "step": step,
                    "loss": values["loss"],
                    "ce_loss": values["ce_loss"],
                    "z_loss": values["z_loss"],
                    "lr": lr,
                    "grad_norm": values["grad_norm"],
                    "skipped": skipped,
                    "tokens_seen": step * tokens_per_step,
                    "tokens_per_second": tps,
                    "tokens_per_second_per_device": tps / n_devices,
                    "tflops_per_device": fpt * tps / n_devices / 1e12,
                    "mfu": mfu(spec, seq, tps / n_devices, peak_flops_per_device=peak),
                    "mfu_peak": peak_label,
                    "step_time": step_time,
                    "time": time.time() - started,
                }
                if moe_step is not None:  # the MoE contract's moe_* keys
                    record.update(moe_metrics(moe_step, ep_size=sharding.expert_size(mesh)))
                metrics.write(record)
                console.line(
                    f"step {step}/{total} loss {values['loss']:.4f} lr {lr:.3e} grad_norm {values['grad_norm']:.3f}"
                    f" {tps:,.0f} tok/s mfu {record['mfu']:.1%}" + (" SKIPPED" if skipped else "")
                )
            console.advance(f"loss {values['loss']:.4f}")
            if step % recipe.checkpoint.every == 0 or step == total:
                save(step)
            if step % recipe.eval.every == 0 or step == total:
                evaluate(step)
    finally:
        batches.close()  # stops the loader's prefetch threads
        console.close()
        checkpointer.close()

    if is_main:
        print_summary(run_dir, f"olmo-train-jax: {run_dir}")
        png = plot_loss(run_dir)
        if png is not None:
            print(f"loss curve: {png}", flush=True)
    return run_dir


def _initial_state(plan: Plan, make_model, abstract_params: Any, abstract_opt: Any) -> tuple[Any, Any | None]:
    """(params, AdamW state or None) to start from: fresh weights from recipe.train.seed, or
    init.checkpoint's weights (and moments when init.load_optimizer), on the current mesh."""
    init = plan.init
    params_sh = jax.tree.map(lambda a: a.sharding, abstract_params)
    if init is None:
        return jax.jit(lambda: nnx.to_pure_dict(nnx.split(make_model())[1]), out_shardings=params_sh)(), None
    print(init.describe(), flush=True)
    if plan.init_tensors is not None:
        pure = nnx.to_pure_dict(nnx.split(model_from_hf(plan.spec, plan.init_tensors))[1])
        return jax.tree.map(jax.device_put, pure, params_sh), None
    params, opt_state, _ = restore_state(
        init.path, abstract_params, abstract_opt if init.load_optimizer else None
    )
    return params, opt_state
