"""The Olmo 3 decoder in PyTorch, built from an ``olmo_model.ModelSpec``.

Architecture (docs/design.md; transformers' ``Olmo3ForCausalLM`` is the reference):

- untied token embedding ``embed`` and output head ``lm_head`` over the padded vocab;
- reordered-norm blocks, no input norms:
  ``h = x + RMSNorm(attn(x)); out = h + RMSNorm(mlp(h))``; a final RMSNorm
  (``spec.norm_placement="pre"``: ``h = x + attn(RMSNorm(x)); out = h + mlp(RMSNorm(h))``, OLMoE;
  ``"peri"``: the output norms plus an input norm on each sublayer, OLMo-core 3's peri-norm);
- the embedding optionally times ``spec.embedding_scale`` and then ``embed_norm`` (OLMo-core 3);
- RMSNorm computes in float32 and casts back to the input dtype;
- QK-norm over the full projected width before splitting heads and before RoPE
  (``qk_norm="full"``, Olmo 3), or per head (``"per_head"``), or none;
- RoPE in the rotate-half layout, inverse frequencies in float32; YaRN (with its
  cos/sin attention factor) on full-attention layers only when ``spec.yarn`` is set;
- grouped-query attention through ``scaled_dot_product_attention``: global layers
  use ``is_causal=True`` (the fused flash/cuDNN path on GPU); sliding layers pass a
  boolean band mask (key k is visible to query q when q - window < k <= q);
  optional ``doc_ids`` also hide keys of other documents (every layer then uses a mask);
- a split sequence (context parallelism): when something from outside sets ``OlmoModel.context``
  (a ``SequenceContext``), the model holds only some columns of each row; RoPE reads the
  full-length tables at the context's positions and each layer calls the context's attention
  in place of SDPA (``context_parallel.py``). Unset, nothing of this runs;
- SwiGLU MLP with separate gate/up/down projections; no biases anywhere;
- MoE layers (``spec.is_moe_layer(i)``): the MLP is ``moe.MoE`` (router, routed experts
  through grouped GEMMs, shared experts); such a block returns ``(x, RoutingSums)`` and the
  model's output carries the stats to the loss (``ModelOutput.moe``, ``routing_stats``).

``OlmoModel.forward(input_ids, doc_ids=None, labels=None)`` returns one type, the
``olmo_model.ModelOutput`` both trainers' models return: the logits without ``labels``, the
fused head + loss sums with them (``OutputHead``), and the MoE layers' stats (None when dense).

Module layout (names map 1:1 to the HF layout in ``hf_adapter``): ``embed``,
``blocks`` (one ``Block`` per layer, the unit a parallelize module shards or
checkpoints), ``final_norm``, ``lm_head``. RoPE tables and masks are not buffers: they are
computed from the spec on the input's device and cached, so a model built on the
meta device and materialised with ``to_empty`` needs no re-initialisation of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from olmo_model import ModelSpec
from olmo_model.output import ModelOutput
from olmo_model.rope import rope_inv_freq

from .head_loss import head_loss_sums
from .moe import MoE, RoutingSums


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics whatever the activation dtype, as transformers' Olmo3RMSNorm.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


# An attention in place of scaled_dot_product_attention: (q [B,H,s,hd], k, v [B,Hkv,s,hd]) -> [B,H,s,hd].
AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# What a layer's attention gets: a mask for SDPA (None: causal) or the attention to call.
AttentionArg = torch.Tensor | AttentionOp | None


class SequenceContext(Protocol):
    """What the model asks of a split sequence (installed from outside as ``OlmoModel.context``,
    e.g. ``context_parallel.ContextParallel``): the positions of this process's columns and,
    per attention kind, the attention across the split. The model decides nothing about it."""

    degree: int

    def positions(self, local_seq: int, device: torch.device) -> torch.Tensor: ...

    def attention(self, window: int | None, local_seq: int, doc_ids: torch.Tensor | None) -> AttentionOp: ...


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos/sin are float32, so the rotation runs in float32 and is cast back (as transformers).
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d = spec.d_model
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.kv_heads, spec.head_dim
        self.qk_norm = spec.qk_norm
        self.q_proj = nn.Linear(d, spec.q_width, bias=False)
        self.k_proj = nn.Linear(d, spec.kv_width, bias=False)
        self.v_proj = nn.Linear(d, spec.kv_width, bias=False)
        self.o_proj = nn.Linear(spec.q_width, d, bias=False)
        if spec.qk_norm == "full":
            self.q_norm = RMSNorm(spec.q_width, spec.norm_eps)
            self.k_norm = RMSNorm(spec.kv_width, spec.norm_eps)
        elif spec.qk_norm == "per_head":
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionArg) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if mask is not None and not isinstance(mask, torch.Tensor):
            return self.o_proj(mask(q, k, v).transpose(1, 2).reshape(b, s, -1))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(spec.d_model, spec.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(spec.mlp_hidden, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One decoder layer (``spec.norm_placement``: reordered, Olmo 3, pre-norm, or peri-norm: the
    reordered output norms plus an input norm on each sublayer, OLMo-core 3's use_peri_norm); its
    attention kind and RoPE come from the caller."""

    def __init__(self, spec: ModelSpec, mlp: nn.Module | None = None):
        super().__init__()
        self.pre_norm = spec.norm_placement == "pre"
        peri = spec.norm_placement == "peri"
        self.attn_in_norm = RMSNorm(spec.d_model, spec.norm_eps) if peri else None
        self.attn = Attention(spec)
        self.attn_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.mlp_in_norm = RMSNorm(spec.d_model, spec.norm_eps) if peri else None
        self.mlp = mlp if mlp is not None else MLP(spec)
        self.mlp_norm = RMSNorm(spec.d_model, spec.norm_eps)

    def _attend(self, x, cos, sin, mask) -> torch.Tensor:
        """h = x + norm(attn(x)) (reordered), x + attn(norm(x)) (pre) or x + norm(attn(in_norm(x)))
        (peri)."""
        if self.pre_norm:
            return x + self.attn(self.attn_norm(x), cos, sin, mask)
        a = x if self.attn_in_norm is None else self.attn_in_norm(x)
        return x + self.attn_norm(self.attn(a, cos, sin, mask))

    def _mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP's input: h, or h through the MLP's input norm (pre: mlp_norm; peri: mlp_in_norm)."""
        if self.pre_norm:
            return self.mlp_norm(h)
        return h if self.mlp_in_norm is None else self.mlp_in_norm(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionArg) -> torch.Tensor:
        h = self._attend(x, cos, sin, mask)
        m = self.mlp(self._mlp_input(h))
        return h + (m if self.pre_norm else self.mlp_norm(m))


class MoEBlock(Block):
    """A decoder layer whose MLP is a mixture of experts; returns (x, RoutingSums)."""

    def __init__(self, spec: ModelSpec, layer: int):
        assert spec.moe is not None
        super().__init__(spec, MoE(spec.moe, spec.d_model, layer))

    # Not a drop-in Block: it also returns its routing stats, which OlmoModel.forward tells
    # apart by the tuple.
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionArg
    ) -> tuple[torch.Tensor, RoutingSums]:
        h = self._attend(x, cos, sin, mask)
        m, stats = self.mlp(self._mlp_input(h))
        return h + (m if self.pre_norm else self.mlp_norm(m)), stats


class OutputHead(nn.Linear):
    """The untied output head (d_model -> padded vocab, no bias). ``forward(h, labels)`` returns
    the fused head + loss sums ``[ce + z_loss_weight * z, ce, z]`` (``head_loss.head_loss_sums``)
    instead of the logits: the head's weight is used inside its own forward, where a wrapper's
    hooks (FSDP2's gather) expect it."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec.d_model, spec.padded_vocab_size, bias=False)
        self.z_loss_weight = spec.z_loss_weight

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return torch.stack(head_loss_sums(h, self.weight, labels, self.z_loss_weight))


class OlmoModel(nn.Module):
    """Olmo 3 decoder: ``forward(input_ids [B,S], doc_ids=None, labels=None) -> ModelOutput``
    (logits [B,S,padded_vocab] or, with labels, the loss sums; a list of ``RoutingSums``, one
    per MoE layer, or None for a dense spec)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.padded_vocab_size, spec.d_model)
        self.embed_norm = RMSNorm(spec.d_model, spec.norm_eps) if spec.embedding_norm else None
        self.blocks = nn.ModuleList(
            MoEBlock(spec, i) if spec.is_moe_layer(i) else Block(spec) for i in range(spec.n_layers)
        )
        self.final_norm = RMSNorm(spec.d_model, spec.norm_eps)
        self.lm_head = OutputHead(spec)
        # Derived from the spec, never parameters or buffers: RoPE tables keyed by
        # (yarn?, seq, device), band masks by (seq, window, device).
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        # A split sequence (context parallelism), installed from outside; None: the whole
        # sequence is here and attention is this module's own.
        self.context: SequenceContext | None = None

    # ---- derived tables -------------------------------------------------------------
    def _rope(self, layer: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        yarn = self.spec.rope_yarn_of(layer)
        key = (yarn is not None, seq, device)
        if key not in self._rope_cache:
            # Cached tables outlive the call: made under inference_mode they could not
            # be saved for a later backward, so they are always made as normal tensors.
            with torch.inference_mode(False):
                inv_freq_np, scale = rope_inv_freq(self.spec, yarn)
                inv_freq = torch.from_numpy(inv_freq_np)
                freqs = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv_freq.to(device)
                emb = torch.cat((freqs, freqs), dim=-1)
                self._rope_cache[key] = (emb.cos() * scale, emb.sin() * scale)
        return self._rope_cache[key]

    def _band(self, seq: int, window: int | None, device: torch.device) -> torch.Tensor:
        """[S, S] boolean: key k visible to query q iff q - window < k <= q (window None: k <= q)."""
        key = (seq, window, device)
        if key not in self._mask_cache:
            with torch.inference_mode(False):  # as in _rope: the cache must serve training too
                q = torch.arange(seq, device=device)[:, None]
                k = torch.arange(seq, device=device)[None, :]
                allowed = k <= q
                if window is not None:
                    allowed &= k > q - window
                self._mask_cache[key] = allowed
        return self._mask_cache[key]

    def _mask(
        self, window: int | None, seq: int, device: torch.device, same_doc: torch.Tensor | None
    ) -> torch.Tensor | None:
        if same_doc is None:
            if window is None or window >= seq:
                return None  # plain causal: is_causal=True keeps the fused kernels
            return self._band(seq, window, device)
        return self._band(seq, window, device) & same_doc

    # ---- forward ----------------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows, times spec.embedding_scale, then embed_norm (OLMo-core 3's order)."""
        x = self.embed(input_ids)
        if self.spec.embedding_scale is not None:
            x = x * self.spec.embedding_scale
        return x if self.embed_norm is None else self.embed_norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Without ``labels``: ``ModelOutput.logits`` in the parameter dtype. ``doc_ids`` [B,S]
        (any integer labels, equal within a document) restricts attention to the query's own
        document; RoPE positions keep counting across documents (Olmo-core style).
        ``ModelOutput.moe``: the MoE layers' routing statistics in layer order (None if dense).

        With ``labels`` [B,S] the output head and the loss run fused, chunk by chunk
        (``head_loss.head_loss_sums``, the full logits never exist): ``ModelOutput.loss_sums``
        is the float32 tensor ``[ce + z_loss_weight * z, ce, z]`` of sums over labels != -100,
        differentiable in its first entry only (``OutputHead``), and ``logits`` is None.

        With a ``context`` installed (context parallelism), ``input_ids``, ``doc_ids`` and
        ``labels`` are this process's columns of the rows (``context.positions``) and the
        outputs are theirs."""
        _, seq = input_ids.shape
        device = input_ids.device
        same_doc = None
        if doc_ids is not None:
            if doc_ids.shape != input_ids.shape:
                raise ValueError(
                    f"doc_ids has shape {tuple(doc_ids.shape)} but input_ids has {tuple(input_ids.shape)}; "
                    "pass one document label per token"
                )
            if self.context is None:
                same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]  # [B,1,S,S]
        windows = [self.spec.window_of(i) for i in range(len(self.blocks))]
        masks: dict[int | None, AttentionArg]
        context = self.context
        if context is None:
            masks = {w: self._mask(w, seq, device, same_doc) for w in set(windows)}
        else:
            # This process holds ``seq`` of the sequence's columns, at ``positions``: RoPE reads
            # the full-length tables there, and attention across the split is the context's.
            # In layer order, not set order: making one may run a collective, the same on all ranks.
            positions = context.positions(seq, device)
            masks = {w: context.attention(w, seq, doc_ids) for w in dict.fromkeys(windows)}
        x = self._embed(input_ids)
        moe_stats: list[RoutingSums] = []
        for i, block in enumerate(self.blocks):
            if context is None:
                cos, sin = self._rope(i, seq, device)
            else:
                cos, sin = (t[positions] for t in self._rope(i, seq * context.degree, device))
            out = block(x, cos, sin, masks[windows[i]])
            if isinstance(out, tuple):
                x, stats = out
                moe_stats.append(stats)
            else:
                x = out
        head = self.lm_head(self.final_norm(x), labels)
        moe = moe_stats if self.spec.moe is not None else None
        return ModelOutput(logits=head, moe=moe) if labels is None else ModelOutput(loss_sums=head, moe=moe)
