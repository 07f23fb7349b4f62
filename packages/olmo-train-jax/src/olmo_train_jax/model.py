"""The Olmo 3 decoder in Flax NNX, built from an ``olmo_model.ModelSpec``.

Architecture (docs/design.md; transformers' ``Olmo3ForCausalLM`` is the reference):

- reordered-norm blocks: h = x + RMSNorm(attn(x)); out = h + RMSNorm(mlp(h)); no input
  norms (``spec.norm_placement="pre"``, OLMoE's pre-norm: h = x + attn(RMSNorm(x)); out =
  h + mlp(RMSNorm(h)); ``"peri"``, OLMo-core 3's peri-norm: the output norms plus an input norm
  on each sublayer); the embedding optionally scaled and RMS-normalised (``embedding_scale``,
  ``embedding_norm``); a final RMSNorm, then an untied output head over the padded vocabulary;
- QK-norm over the full projected width, before the head split and before RoPE
  (``qk_norm="per_head"`` normalises each head instead, ``"none"`` skips it);
- RoPE in the rotate-half layout, inverse frequencies in float32 as transformers computes
  them; YaRN (with its attention factor on cos/sin) on full_attention layers only;
- GQA; causal attention (``causal_attention.attention``: ``blocked_causal_attention`` for
  global and short sliding layers, the O(S W) blocked local path for long sliding ones),
  with the sliding window of that layer (static per layer, see below) and, optionally,
  document boundaries;
- SwiGLU MLP, or a mixture-of-experts block (``moe.py``: router, top-k, routed SwiGLU
  experts as grouped matmuls (``ragged_dot``; one-expert tiles on CPU), shared experts)
  when the spec has ``moe``;
  no biases anywhere.

Parameter layout: the per-layer weights are STACKED along a leading layer axis
(``model.layers.q_proj`` is [n_layers, d_model, q_width]); the forward views each as
[n_layers / P, P, ...] (a free reshape) and runs ``jax.lax.scan`` over the n_layers / P
repeats of the layer pattern, P the pattern's period (``layer_stacks.scan_period``: 4 for
Olmo 3's 3 sliding : 1 global; n_layers, i.e. fully unrolled, for a non-periodic explicit
pattern). Inside the scanned body the P layers are unrolled, so each layer's attention kind
(window length, RoPE or YaRN table) is STATIC: attention picks its kernel at trace time (causal
without a mask array, a blocked local window, or a dense static mask) instead of masking
S x S scores with data. Compile time stays flat in depth (one period is traced), and the
layer axis is a plain array axis that the parallelize module can leave replicated or split
without touching this file. A stack that mixes dense and MoE layers (``moe.layers``, OLMo-core
3's dense leading blocks) keeps each MLP kind in its own stack over its own layers and runs one
scan per run of repeats with the same kinds (``layer_stacks``, which says why): P layers
traced per run, two runs for dense leading blocks at any depth.

Attention (``causal_attention.attention``): global layers, and sliding layers whose window
covers most of the sequence, run ``causal_attention.blocked_causal_attention`` (query blocks that skip the keys
above the diagonal or outside the window, a flash-style backward; never an S x S array); a
sliding window W much shorter than S runs the blocked local path: query blocks of W positions
attend to the keys of their own and the previous block under one static band mask, O(S W)
memory and FLOPs instead of O(S^2). Document masking (``doc_ids``) restricts each query block
to its document on either path. On GPU with bf16 activations and no document mask,
``jax.attention=auto`` (the default) runs cuDNN's fused flash attention instead (``cudnn``
forces it, ``xla`` forbids it); every other case runs the XLA paths above. Under context
parallelism (``OlmoModel.context`` set by the trainer) every layer runs
``context_parallel.context_attention`` instead, over a sequence whose columns are in the zigzag
layout's order; the caller passes each column's true position, which RoPE/YaRN and the masks use.

Linear weights are (in, out) kernels, the JAX convention; ``hf_adapter`` transposes to and
from transformers' (out, in). Parameters live in ``param_dtype`` (float32 master weights);
the forward casts each layer's weights to the compute ``dtype`` as the scan reaches it.
RMSNorm and RoPE compute in float32; logits come back in float32. Given labels, the model
returns the loss sums instead of the logits (``OlmoModel.__call__``): the output head and the
loss run fused over chunks of positions (``head_loss``), so a training step never holds the
full [tokens, vocab] logits. This module holds no sharding: a trainer's parallelize module places
the parameters from outside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_model import FULL, SLIDING, ModelSpec
from olmo_model.moe import check_routing
from olmo_model.output import ModelOutput
from olmo_model.rope import rope_inv_freq

from .causal_attention import ATTENTION_IMPLS, attention
from .context_parallel import ContextParallel, context_attention
from .grouped_gemm import ExpertWeights
from .head_loss import head_loss_sums
from .layer_stacks import LayerRun, layer_runs
from .layers import linear, rms_norm, swiglu_down
from .moe import ExpertsFn, RoutingStats, local_experts, moe_block
from .precision import matmul_precision

# "none": keep every activation; "block": keep only each layer's input and recompute the
# block in the backward pass; "save_dots": also keep the weight-matmul outputs, recomputing
# only cheap elementwise work and attention (its [S, S] scores are what is worth dropping).
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _truncated_normal(rngs: nnx.Rngs, shape: tuple[int, ...], spec: ModelSpec, dtype) -> nnx.Param:
    cut = spec.init_cutoff
    return nnx.Param(jax.random.truncated_normal(rngs.params(), -cut, cut, shape, dtype) * spec.init_std)


def _ones(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def _cos_sin(inv_freq: np.ndarray, scale: float, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [S, head_dim] (times ``scale``) at ``positions`` [S], each column's position."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # rotate-half layout: [S, head_dim]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, head_dim]; cos/sin [S, head_dim] float32."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (xf * cos + rotated * sin).astype(x.dtype)


class _LayerInputs(NamedTuple):
    """What every layer of one forward reads besides its weights and the hidden states."""

    rope: dict[str, tuple[jax.Array, jax.Array]]  # cos, sin [S, head_dim] per attention kind
    doc_ids: jax.Array | None
    routing: str
    routing_key: jax.Array | None
    positions: jax.Array


class StackedLayers(nnx.Module):
    """All decoder layers' weights, stacked as ``layer_stacks`` says
    (attention and norms over every layer, each MLP kind over its own layers)."""

    def __init__(self, spec: ModelSpec, rngs: nnx.Rngs, param_dtype):
        L, d, h = spec.n_layers, spec.d_model, spec.mlp_hidden
        n_moe = sum(spec.is_moe_layer(i) for i in range(L))
        self.q_proj = _truncated_normal(rngs, (L, d, spec.q_width), spec, param_dtype)
        self.k_proj = _truncated_normal(rngs, (L, d, spec.kv_width), spec, param_dtype)
        self.v_proj = _truncated_normal(rngs, (L, d, spec.kv_width), spec, param_dtype)
        self.o_proj = _truncated_normal(rngs, (L, spec.q_width, d), spec, param_dtype)
        if spec.qk_norm == "full":
            self.q_norm = _ones((L, spec.q_width), param_dtype)
            self.k_norm = _ones((L, spec.kv_width), param_dtype)
        elif spec.qk_norm == "per_head":
            self.q_norm = _ones((L, spec.head_dim), param_dtype)
            self.k_norm = _ones((L, spec.head_dim), param_dtype)
        if spec.norm_placement == "peri":  # OLMo-core 3's input norms, besides the output norms
            self.attn_in_norm = _ones((L, d), param_dtype)
            self.mlp_in_norm = _ones((L, d), param_dtype)
        self.attn_norm = _ones((L, d), param_dtype)
        if n_moe < L:
            self.gate_proj = _truncated_normal(rngs, (L - n_moe, d, h), spec, param_dtype)
            self.up_proj = _truncated_normal(rngs, (L - n_moe, d, h), spec, param_dtype)
            self.down_proj = _truncated_normal(rngs, (L - n_moe, h, d), spec, param_dtype)
        if spec.moe is not None and n_moe:
            moe = spec.moe
            E, eh = moe.n_experts, moe.expert_hidden
            self.router = _truncated_normal(rngs, (n_moe, d, E), spec, param_dtype)
            self.expert_gate_proj = _truncated_normal(rngs, (n_moe, E, d, eh), spec, param_dtype)
            self.expert_up_proj = _truncated_normal(rngs, (n_moe, E, d, eh), spec, param_dtype)
            self.expert_down_proj = _truncated_normal(rngs, (n_moe, E, eh, d), spec, param_dtype)
            if moe.n_shared_experts:
                # All shared experts as one SwiGLU of hidden S*shared_hidden: the same sum.
                sh = moe.n_shared_experts * moe.shared_hidden
                self.shared_gate_proj = _truncated_normal(rngs, (n_moe, d, sh), spec, param_dtype)
                self.shared_up_proj = _truncated_normal(rngs, (n_moe, d, sh), spec, param_dtype)
                self.shared_down_proj = _truncated_normal(rngs, (n_moe, sh, d), spec, param_dtype)
        self.mlp_norm = _ones((L, d), param_dtype)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked weights as a plain dict, the pytree that the scans slice per layer."""
        return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}


class OlmoModel(nnx.Module):
    """Olmo 3 decoder: ``model(input_ids [B, S] int32, doc_ids=None, labels=None) -> ModelOutput``
    (``olmo_model.output``): the logits, or with labels the fused head's loss sums, and the MoE
    routing statistics.

    ``experts_fn`` computes the routed experts of MoE layers (``moe.ExpertsFn``); the
    default keeps all experts local, ``expert_parallel.apply_expert_parallel`` swaps in the
    all-to-all version from outside. The trainer also sets, from the mesh and before
    ``nnx.split``: ``batch_shards``, how many devices the batch axis is split over (XLA:CPU
    attention loops over the batch that many rows at a time, ``causal_attention.attention``, and the fused head's
    chunks are sized for one device's rows); ``platform``, the
    platform of the devices the step is compiled for (None: ``jax.default_backend()``), which
    picks the attention path, since a step compiled ahead of time for a TPU topology on a CPU
    host must take the TPU path; ``hidden_sharding``, where the residual stream [B, S, d_model]
    lives between layers (None: wherever XLA's propagation puts it); ``context``, the
    ``context_parallel.ContextParallel`` of a context-parallel mesh (None: no CP), with which every
    layer's attention runs ``context_parallel.context_attention`` over the split sequence (the
    caller then passes each column's true position) and the fused head walks each device's share
    of it."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        remat: str = "none",
        attention: str = "auto",
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat='{remat}' is unknown; use one of: {', '.join(REMAT_POLICIES)}")
        self.spec = spec
        self.param_dtype = jnp.dtype(param_dtype)
        self.dtype = jnp.dtype(dtype)
        self.remat = remat
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention='{attention}' is unknown; use one of: {', '.join(ATTENTION_IMPLS)}")
        self.attention = attention
        self.experts_fn: ExpertsFn = local_experts
        self.batch_shards = 1
        self.platform: str | None = None
        self.hidden_sharding: jax.sharding.Sharding | None = None
        self.context: ContextParallel | None = None
        V, d = spec.padded_vocab_size, spec.d_model
        self.embed = _truncated_normal(rngs, (V, d), spec, param_dtype)
        if spec.embedding_norm:
            self.embed_norm = _ones((d,), param_dtype)
        self.layers = StackedLayers(spec, rngs, param_dtype)
        self.final_norm = _ones((d,), param_dtype)
        self.lm_head = _truncated_normal(rngs, (d, V), spec, param_dtype)

    def __call__(
        self,
        input_ids: jax.Array,
        doc_ids: jax.Array | None = None,
        labels: jax.Array | None = None,
        *,
        routing: str = "learned",
        routing_key: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> ModelOutput:
        """``ModelOutput``: float32 ``logits`` [B, S, padded_vocab] without ``labels``; with
        ``labels`` [B, S], ``loss_sums`` [ce + z_loss_weight * z, ce, z] instead, the output head
        and the loss run fused chunk by chunk (``head_loss.head_loss_sums``: the full logits never
        exist, and only the first sum carries a gradient); ``moe``: the ``RoutingStats`` over the MoE
        layers (losses averaged, counts summed), None for a dense spec.

        ``doc_ids`` [B, S]: a query attends only to keys of its own document; positions are not
        reset, as RoPE scores depend only on distance. ``routing`` is learned/random/uniform
        (``moe.route``); random routing needs ``routing_key``, e.g.
        ``jax.random.fold_in(jax.random.key(seed), step)``; each layer folds in its index.
        ``positions`` [S]: the sequence position of each column (the same for every row; None:
        0 .. S-1), given under context parallelism, whose columns are in the layout's order."""
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {labels.shape} differs from input_ids shape {input_ids.shape}")
        x, stats = self.hidden_states(input_ids, doc_ids, routing=routing, routing_key=routing_key, positions=positions)
        if labels is None:
            return ModelOutput(logits=self._logits(x), moe=stats)
        return ModelOutput(loss_sums=self._loss_sums(x, labels), moe=stats)

    def hidden_states(
        self,
        input_ids: jax.Array,
        doc_ids: jax.Array | None = None,
        *,
        routing: str = "learned",
        routing_key: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats | None]:
        """The decoder without its output head: the final-normed hidden states [B, S, d_model] in
        the compute dtype, and the MoE stats (None for a dense spec); arguments as for
        ``__call__``. What a caller that needs the residual stream itself takes (e.g. a memory
        count of the layers' backward); the forward's outputs come from ``__call__``."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids shape {doc_ids.shape} differs from input_ids shape {input_ids.shape}")
        if positions is not None and positions.shape != input_ids.shape[1:]:
            raise ValueError(f"positions shape {positions.shape} must be [seq] = {input_ids.shape[1:]}")
        if self.context is not None and positions is None:
            raise ValueError("a context-parallel model needs positions (parallelize.sequence_positions)")
        check_routing(routing)
        if routing == "random" and routing_key is None:
            raise ValueError("routing='random' needs routing_key, e.g. jax.random.fold_in(jax.random.key(seed), step)")
        # float32 compute means float32 maths on every backend (TPU/GPU would otherwise run
        # float32 matmuls with bf16/tf32 passes); this is the parity mode. The head sets its
        # precision itself (``matmul_precision``).
        if self.dtype != jnp.float32:
            return self._forward(input_ids, doc_ids, routing, routing_key, positions)
        with jax.default_matmul_precision("highest"):
            return self._forward(input_ids, doc_ids, routing, routing_key, positions)

    def _logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits [B, S, padded_vocab] of the hidden states ``x``."""
        return jnp.einsum(
            "bsd,dv->bsv",
            x,
            self._head_weight(),
            preferred_element_type=jnp.float32,
            precision=matmul_precision(self.dtype),
        )

    def _loss_sums(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        """float32 [3]: [ce + z_loss_weight * z, ce, z] summed over the labels != IGNORE_INDEX,
        the head and the loss fused (``head_loss_sums``). Its chunks are sized for the rows one
        device holds (``batch_shards``) and, under context parallelism, walk each device's own
        share of the sequence (the context degree)."""
        seq_shards = 1 if self.context is None else self.context.degree
        objective, ce, z, _ = head_loss_sums(
            x,
            self._head_weight(),
            labels,
            self.spec.z_loss_weight,
            batch_shards=self.batch_shards,
            seq_shards=seq_shards,
        )
        return jnp.stack([objective, ce, z])

    def _head_weight(self) -> jax.Array:
        """The output head [d_model, padded_vocab] in the compute dtype."""
        return self.lm_head[...].astype(self.dtype)

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        """The embedding rows in the compute dtype, times spec.embedding_scale, then embed_norm
        (OLMo-core 3's order: scale first)."""
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(self.dtype)
        if self.spec.embedding_scale is not None:
            x = x * self.spec.embedding_scale
        if self.spec.embedding_norm:
            x = rms_norm(x, self.embed_norm[...], self.spec.norm_eps, self.context is None)
        return x

    def _forward(self, input_ids, doc_ids, routing, routing_key, positions):
        spec = self.spec
        seq_len = input_ids.shape[1]
        x = self._place(self._embed(input_ids))
        if positions is None:
            positions = jnp.arange(seq_len, dtype=jnp.int32)
        rope: dict[str, tuple[jax.Array, jax.Array]] = {
            SLIDING: _cos_sin(*rope_inv_freq(spec, None), positions),
            FULL: _cos_sin(*rope_inv_freq(spec, spec.yarn), positions),
        }
        inputs = _LayerInputs(rope, doc_ids, routing, routing_key, positions)
        arrays = self.layers.arrays()
        per_run = []
        for run in layer_runs(spec):
            x, run_stats = self._scan_run(run, x, arrays, inputs)
            if run_stats is not None:
                per_run.append(run_stats)

        x = self._place(rms_norm(x, self.final_norm[...], spec.norm_eps, self.context is None))
        if not per_run:
            return x, None
        # [MoE layers, ...] in depth order, as one scan over every layer would give them.
        per_layer = jax.tree.map(lambda *a: jnp.concatenate(a), *per_run)
        stats = RoutingStats(
            load_balancing=jnp.mean(per_layer.load_balancing),
            router_z=jnp.mean(per_layer.router_z),
            tokens_per_expert=jnp.sum(per_layer.tokens_per_expert, axis=0),
            dropped=jnp.sum(per_layer.dropped),
        )
        return x, stats

    def _scan_run(
        self, run: LayerRun, x: jax.Array, arrays: dict[str, jax.Array], inputs: _LayerInputs
    ) -> tuple[jax.Array, RoutingStats | None]:
        """One ``jax.lax.scan`` over ``run``'s repeats (``layer_stacks``), its ``period`` layers
        unrolled in the body: the hidden states after it and its MoE layers' stats, stacked
        [MoE layers of the run, ...] in depth order (None if it has none)."""
        spec = self.spec
        layer_types = spec.layer_types
        assert layer_types is not None  # filled by ModelSpec._fill_layer_types
        policy = REMAT_POLICIES[self.remat]

        def layer(h, weights, repeat, p):
            # Layer run.start + repeat * period + p: its attention kind is that of layer
            # run.start + p (the run starts a repeat of the pattern), known at trace time.
            index = run.start + repeat * run.period + p
            cos, sin = inputs.rope[layer_types[run.start + p]]
            key = None if inputs.routing_key is None else jax.random.fold_in(inputs.routing_key, index)
            window = spec.window_of(run.start + p)
            return self._block(h, weights, cos, sin, window, inputs, key, moe=run.moe[p])

        def body(h, xs):
            weights, repeat = xs
            stats = []
            for p in range(run.period):
                fn: Callable[..., Any] = functools.partial(layer, p=p)
                if policy is not None:
                    fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)
                h, layer_stats = fn(h, run.layer_weights(weights, p), repeat)
                h = self._place(h)
                if layer_stats is not None:
                    stats.append(layer_stats)
            return h, (jax.tree.map(lambda *s: jnp.stack(s), *stats) if stats else None)

        repeats = jnp.arange(run.repeats, dtype=jnp.int32)
        x, per_layer = jax.lax.scan(body, x, (run.grouped(arrays), repeats))
        # [repeats, MoE layers per repeat, ...] -> [MoE layers of the run, ...] in depth order.
        return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), per_layer)

    def _place(self, x: jax.Array) -> jax.Array:
        """``x`` [B, S, d_model] pinned to ``hidden_sharding`` (at every layer boundary, after the
        embedding and the final norm): without the pin, XLA's propagation could keep an FSDP
        weight split and all-gather the activations of the whole global batch onto every device
        for the matmul instead (issue 17), which grows with the device count."""
        return x if self.hidden_sharding is None else jax.lax.with_sharding_constraint(x, self.hidden_sharding)

    def _block(self, x, w, cos, sin, window, inputs: _LayerInputs, key, *, moe: bool):
        spec, dtype = self.spec, self.dtype
        B, S, _ = x.shape
        eps = spec.norm_eps

        # Under context parallelism the backward contracts over (batch, seq) as they are
        # (layers.py ``flat``): flattening a sequence-split batch would gather it.
        flat = self.context is None

        def proj(a, name):
            return linear(a, w[name].astype(dtype), flat)

        def norm(a, weight):
            return rms_norm(a, weight, eps, flat)

        # norm_placement: reordered (Olmo 3) normalises each sublayer's output, pre its input, peri both.
        pre_norm = spec.norm_placement == "pre"
        a = _sublayer_input(x, w, "attn", pre_norm, norm)
        q, k, v = proj(a, "q_proj"), proj(a, "k_proj"), proj(a, "v_proj")
        if spec.qk_norm == "full":
            q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
        q = q.reshape(B, S, spec.n_heads, spec.head_dim)
        k = k.reshape(B, S, spec.kv_heads, spec.head_dim)
        v = v.reshape(B, S, spec.kv_heads, spec.head_dim)
        if spec.qk_norm == "per_head":
            q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.context is not None:
            attn = context_attention(q, k, v, window, inputs.doc_ids, inputs.positions, self.context)
        else:
            attn = attention(q, k, v, window, inputs.doc_ids, self.attention, self.batch_shards, self.platform)
        o = proj(attn.reshape(B, S, spec.q_width), "o_proj")
        h = x + (o if pre_norm else norm(o, w["attn_norm"]))
        m_in = _sublayer_input(h, w, "mlp", pre_norm, norm)

        def finish(mlp):
            return h + (mlp if pre_norm else norm(mlp, w["mlp_norm"]))

        if not moe:
            return finish(
                swiglu_down(proj(m_in, "gate_proj"), proj(m_in, "up_proj"), w["down_proj"].astype(dtype), flat)
            ), None
        assert spec.moe is not None  # only an MoE spec has MoE layers
        routed = ExpertWeights(w["expert_gate_proj"], w["expert_up_proj"], w["expert_down_proj"])
        shared = None
        if spec.moe.n_shared_experts:
            shared = ExpertWeights(w["shared_gate_proj"], w["shared_up_proj"], w["shared_down_proj"])
        tokens = m_in.reshape(B * S, spec.d_model)
        mlp, stats = moe_block(
            tokens,
            w["router"],
            routed,
            shared,
            spec.moe,
            routing=inputs.routing,
            key=key,
            experts_fn=self.experts_fn,
            sequence_length=S,
        )
        return finish(mlp.reshape(B, S, spec.d_model)), stats


def _sublayer_input(a, w: dict[str, jax.Array], sublayer: str, pre_norm: bool, norm):
    """A sublayer's ("attn" / "mlp") input: through its norm under pre-norm, through its input norm
    under peri-norm (``attn_in_norm`` / ``mlp_in_norm``), as is under the reordered placement."""
    name = f"{sublayer}_norm" if pre_norm else f"{sublayer}_in_norm"
    return norm(a, w[name]) if name in w else a


def build_model(
    spec: ModelSpec,
    *,
    seed: int = 0,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    remat: str = "none",
    attention: str = "auto",
) -> OlmoModel:
    """A freshly initialised model: truncated normal (std ``init_std``, cut at
    +-``init_cutoff`` std) for every linear and the embedding, ones for the norms, drawn by JAX's
    PRNG (free under ``nnx.eval_shape``). The trainer starts from ``olmo_model.init`` instead
    (``hf_adapter.initial_params``: the torch trainer's weights for the same seed, per shard)."""
    return OlmoModel(spec, rngs=nnx.Rngs(seed), param_dtype=param_dtype, dtype=dtype, remat=remat, attention=attention)
