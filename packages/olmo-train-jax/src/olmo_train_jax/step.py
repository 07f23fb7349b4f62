"""The JAX trainer's step: what one optimizer step s (1-based) does, identically to the Torch
trainer (``olmo_train_torch.step``), jitted for a mesh:

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
- nothing is read to the host: the stats stay device arrays (the driver reads them every
  ``log.every`` steps); with the spike guard enabled the step is two jitted calls (gradients,
  then ``guarded_update``), the second deciding on the device, from a history carried between
  steps (``GuardState``), whether to keep the update: a skipped step changes no parameter,
  moment or Adam count, and its batch counts as consumed.

Precision fp32 runs everything in float32 (matmuls at "highest" precision); bf16 keeps float32
master weights and AdamW state and runs the model's matmuls in bfloat16, loss and reductions
in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_data.order import IGNORE_INDEX  # the loader's label for "no next token"
from olmo_model import ModelSpec
from olmo_run.decay import decay_group, group_weight_decay
from olmo_run.recipe import Recipe

from . import parallelize
from .expert_parallel import apply_expert_parallel
from .model import OlmoModel
from .moe import RoutingStats, aux_loss

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing (kept for parity).
CLIP_EPS = 1e-6
BATCH_KEYS = ("input_ids", "labels", "doc_ids")


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
    order = parallelize.sequence_positions(mesh, seq_len)
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
        moe_zero = RoutingStats(jnp.float32(0), jnp.float32(0), counts, jnp.int32(0))
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


class GuardState(NamedTuple):
    """The spike guard's history on the device (``olmo_run.spike_guard.SpikeGuard``'s, carried
    between steps): the last ``window`` accepted steps' (loss, grad norm), oldest first, the
    newest in the last row, the rows before the last ``accepted`` zeros."""

    history: jax.Array  # [window, 2] float32
    accepted: jax.Array  # [] int32, the rows in use (at most window)


@dataclass(frozen=True)
class GuardRule:
    """``spike_guard``'s settings (``SpikeGuard.should_skip``), bound into the update's program."""

    enabled: bool
    window: int
    sigma: float
    min_history: int


def guard_decision(state: GuardState, loss: jax.Array, grad_norm: jax.Array, rule: GuardRule):
    """(skip, state after the step): ``SpikeGuard.should_skip``'s rule in float32 (x64 is off;
    a decision can differ from the float64 reference only within float32 roundings of the
    threshold); an accepted step enters the history."""
    if not rule.enabled:
        return jnp.bool_(False), state
    value = jnp.stack([loss, grad_norm]).astype(jnp.float32)
    valid = (jnp.arange(rule.window) >= rule.window - state.accepted)[:, None]
    n = jnp.maximum(state.accepted, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, state.history, 0.0), axis=0) / n
    std = jnp.sqrt(jnp.sum(jnp.where(valid, (state.history - mean) ** 2, 0.0), axis=0) / n)
    spike = (state.accepted >= rule.min_history) & jnp.any(value > mean + rule.sigma * std)
    skip = ~jnp.all(jnp.isfinite(value)) | spike
    shifted = jnp.concatenate([state.history[1:], value[None]])
    kept = GuardState(
        jnp.where(skip, state.history, shifted),
        jnp.where(skip, state.accepted, jnp.minimum(state.accepted + 1, rule.window)),
    )
    return skip, kept


def guarded_update(params, opt_state, grads, loss, grad_norm, lr, guard: GuardState, tx, clip, rule: GuardRule):
    """``apply_update`` kept or not as the spike guard decides on the device: (params, AdamW
    state, guard state, skipped); a skipped update leaves both states as they were."""
    skip, guard = guard_decision(guard, loss, grad_norm, rule)
    new_params, new_opt = apply_update(params, opt_state, grads, grad_norm, lr, tx, clip)
    params, opt_state = jax.tree.map(partial(jnp.where, skip), (params, opt_state), (new_params, new_opt))
    return params, opt_state, guard, skip


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
    opt_state, grads, loss, grad_norm, lr, guard)`` -> (params, opt_state, guard, skipped), the
    update kept where the spike guard accepts it (``guarded_update``; always, without the
    guard); ``fused(params, opt_state, batch, lr, step)`` -> (params, opt_state, stats), both in
    one program (no guard), the state donated; ``evaluate(params, input_ids,
    labels, doc_ids)`` -> (CE sum, valid tokens). ``step`` is the 1-based step as np.int32 (it
    seeds random MoE routing; unused otherwise), ``lr`` an np.float32."""

    grads: Any
    apply: Any
    fused: Any
    evaluate: Any


def step_functions(m: MeshModel, spec: ModelSpec, recipe: Recipe, mesh: jax.sharding.Mesh) -> StepFunctions:
    """The step's functions jitted for ``m`` (a model made ready for ``mesh`` by ``for_mesh``):
    the batch split as ``parallelize.batch_sharding``, parameters and AdamW state where ``for_mesh``
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
    batch_in = {k: parallelize.batch_sharding(mesh) for k in BATCH_KEYS}
    stats_out: dict[str, Any] = {k: replicated for k in ("loss", "ce_loss", "z_loss", "grad_norm")}
    if spec.moe is not None:
        # ignore: the NamedTuple as a pytree of shardings, mirroring the stats it places.
        stats_out["moe"] = RoutingStats(replicated, replicated, replicated, replicated)  # type: ignore[arg-type]
    params_sh, opt_sh, clip = m.params_sh, m.opt_sh, recipe.optim.grad_clip
    g = recipe.spike_guard
    rule = GuardRule(g.enabled, g.window, g.sigma, g.min_history)
    # ignore: the NamedTuple as a pytree of shardings, mirroring the state it places.
    guard_sh = GuardState(replicated, replicated)  # type: ignore[arg-type]
    return StepFunctions(
        grads=jax.jit(
            partial(loss_and_grads, cfg=cfg),
            in_shardings=(params_sh, batch_in, replicated),
            out_shardings=(params_sh, stats_out),
        ),
        apply=jax.jit(
            partial(guarded_update, tx=m.tx, clip=clip, rule=rule),
            in_shardings=(params_sh, opt_sh, params_sh, replicated, replicated, replicated, guard_sh),
            out_shardings=(params_sh, opt_sh, guard_sh, replicated),
            donate_argnums=(0, 1, 6),
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
    model.batch_shards = parallelize.dp_size(mesh)
    model.platform = mesh.devices.flat[0].platform
    model.hidden_sharding = NamedSharding(mesh, parallelize.hidden_spec(mesh))
    model.context = parallelize.build_context(mesh, spec)  # sequence split over the context axis
    if spec.moe is not None:
        apply_expert_parallel(
            model, mesh, mxfp8=recipe.moe.mxfp8, gemm=recipe.jax.moe_gemm, capacity_factor=recipe.moe.capacity_factor
        )
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx = make_optimizer(params, recipe)
    params_sh = parallelize.param_shardings(params, spec, mesh)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = parallelize.state_shardings(abstract_opt, params_sh, mesh, shard_over_data=recipe.optim.sharded)
    return MeshModel(graphdef, params, tx, params_sh, abstract_opt, opt_sh)


def placed_step(model: OlmoModel, spec: ModelSpec, recipe: Recipe, mesh_axes: dict[str, int] | None = None):
    """(StepFunctions, [params, opt_state]) for a freshly built ``model`` on a mesh (default:
    every device on ``data``), the parameters and AdamW state placed with the step's own
    shardings (so the first timed step does not recompile): the trainer's step without a run
    dir, for benchmarks and tools. ``fns.fused(*carry, batch, np.float32(lr), np.int32(step))``
    runs one step."""
    mesh = parallelize.build_mesh(mesh_axes or {"data": -1})
    m = for_mesh(model, spec, recipe, mesh)
    fns = step_functions(m, spec, recipe, mesh)
    params = jax.device_put(m.params, m.params_sh)
    return fns, [params, jax.jit(m.tx.init, out_shardings=m.opt_sh)(params)]
