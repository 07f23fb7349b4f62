"""OLMo-core 3's MoE model (``OLMoDDPModel``, the ``moe_fused_v2`` block the OLMoE3-dev scripts build)
against our interchange names, both ways; ``olmo_tools.formats`` reads and writes ``olmo-core:``
checkpoints through it whenever the spec has a ``moe`` section.

OLMo-core 3.0.0's names and shapes (``nn/ddp/block.py``, ``nn/moe/v2/{routed_experts,router,
shared_experts}.py``, ``nn/attention`` ``FusedAttentionV2``), d = d_model, E experts of hidden H,
a shared expert of hidden H_s:

- ``attention.w_qkv.weight`` [q + 2 kv, d]: q, k and v projections stacked in that order (the
  scripts' ``fused_v2`` attention); ``attention.w_q/w_k/w_v.weight`` (the ``default`` attention)
  are read too; ``attention.q_norm/k_norm.weight`` [head_dim] with ``use_head_qk_norm``, else
  the full width; ``attention.w_out.weight``, ``attention_norm.weight``, ``feed_forward_norm.weight``;
- ``routed_experts_router.weight`` [E * d]: the router's [E, d] matrix stored flat;
- ``routed_experts.w_up_gate`` [E, 2H, d]: per expert the up rows, then the gate rows;
  ``routed_experts.w_down`` [E, H, d] (used as ``h @ w_down[e]``: our down_proj transposed);
- ``shared_experts.w_up_gate`` [d, 2 H_s] (used as ``x @ W``): up columns, then gate columns;
  ``shared_experts.w_down`` [1, H_s, d];
- a dense layer (not in ``moe.layers``) is a shared-expert-only block: its ``shared_experts``
  tensors hold our dense MLP (``mlp_hidden`` = top_k x H + H_s in the OLMoE3 scripts);
- ``embeddings.weight``, ``lm_head.norm.weight``, ``lm_head.w_out.weight``.

OLMo-core's older MoE model (``moe_reordered_norm`` blocks, ``nn/moe/{moe,mlp,router}.py``) is read
too: ``feed_forward_moe.router.weight`` [E * d], ``feed_forward_moe.experts.mlp.w1`` (gate), ``w3``
(up) and ``w2`` (down, used as ``h @ w2[e]``), each [E * H, d]; dense blocks' ``feed_forward.w1/w2/w3``.

Each of our tensors is a slice, a transpose or a reshape of one OLMo-core tensor, and each
OLMo-core tensor a concatenation of ours, so a round trip is bitwise. Only one shared expert
without a shared router, no biases and no latent projections are mapped: the forms the OLMoE3
scripts use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from olmo_model import ModelSpec

from .checkpoint import CheckpointError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Where one of our tensors comes from: the OLMo-core key and how to cut it out of that tensor."""

    key: str
    take: Callable[[torch.Tensor], torch.Tensor]


def _rows(begin: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[begin:end]


def _expert(e: int, begin: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[e, begin:end]


def _expert_t(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[e].T


def _columns_t(begin: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[:, begin:end].T


def check_expressible(spec: ModelSpec, origin: str) -> None:
    moe = spec.moe
    assert moe is not None
    if moe.n_shared_experts > 1:
        raise CheckpointError(
            f"{origin}: moe.n_shared_experts={moe.n_shared_experts}; the OLMo-core MoE mapping holds one shared "
            "expert (more need OLMo-core's shared-expert router, which the spec has no field for)"
        )


def _ffn_pieces(spec: ModelSpec, i: int, p: str, sizes: dict[str, Shape]) -> dict[str, Piece]:
    """Layer i's feed-forward: our names (under ``p``) -> pieces; fills ``sizes`` with OLMo-core's shapes."""
    d, moe, out = spec.d_model, spec.moe, {}
    assert moe is not None
    b = f"blocks.{i}."
    if spec.is_moe_layer(i):
        n_exp, hid = moe.n_experts, moe.expert_hidden
        sizes[b + "routed_experts_router.weight"] = (n_exp * d,)
        sizes[b + "routed_experts.w_up_gate"] = (n_exp, 2 * hid, d)
        sizes[b + "routed_experts.w_down"] = (n_exp, hid, d)
        out[p + "mlp.gate.weight"] = Piece(b + "routed_experts_router.weight", lambda t: t.view(n_exp, d))
        for e in range(n_exp):
            out[p + f"mlp.experts.{e}.up_proj.weight"] = Piece(b + "routed_experts.w_up_gate", _expert(e, 0, hid))
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = Piece(
                b + "routed_experts.w_up_gate", _expert(e, hid, 2 * hid)
            )
            out[p + f"mlp.experts.{e}.down_proj.weight"] = Piece(b + "routed_experts.w_down", _expert_t(e))
        if not moe.n_shared_experts:
            return out
        shared, hid = p + "mlp.shared_experts.0.", moe.shared_hidden
    else:
        shared, hid = p + "mlp.", spec.mlp_hidden
    sizes[b + "shared_experts.w_up_gate"] = (d, 2 * hid)
    sizes[b + "shared_experts.w_down"] = (1, hid, d)
    out[shared + "up_proj.weight"] = Piece(b + "shared_experts.w_up_gate", _columns_t(0, hid))
    out[shared + "gate_proj.weight"] = Piece(b + "shared_experts.w_up_gate", _columns_t(hid, 2 * hid))
    out[shared + "down_proj.weight"] = Piece(b + "shared_experts.w_down", _expert_t(0))
    return out


def _older_ffn_pieces(spec: ModelSpec, i: int, p: str, sizes: dict[str, Shape]) -> dict[str, Piece]:
    """Layer i's feed-forward in OLMo-core's older ``moe_reordered_norm`` model: a ``DroplessMoE``
    (router [E * d], experts' w1 gate / w3 up / w2 down each [E * H, d]) or a dense ``FeedForward``."""
    d, moe, b, out = spec.d_model, spec.moe, f"blocks.{i}.", {}
    assert moe is not None
    if not spec.is_moe_layer(i):
        dense = {"w1": ("gate_proj", (spec.mlp_hidden, d)), "w2": ("down_proj", (d, spec.mlp_hidden))}
        dense["w3"] = ("up_proj", (spec.mlp_hidden, d))
        for theirs, (ours, shape) in dense.items():
            sizes[b + f"feed_forward.{theirs}.weight"] = shape
            out[p + f"mlp.{ours}.weight"] = Piece(b + f"feed_forward.{theirs}.weight", lambda t: t)
        return out
    n_exp, hid, m = moe.n_experts, moe.expert_hidden, b + "feed_forward_moe."
    sizes[m + "router.weight"] = (n_exp * d,)
    out[p + "mlp.gate.weight"] = Piece(m + "router.weight", lambda t: t.view(n_exp, d))
    for theirs in ("w1", "w2", "w3"):
        sizes[m + f"experts.mlp.{theirs}"] = (n_exp * hid, d)
    for e in range(n_exp):
        rows = (e * hid, (e + 1) * hid)
        out[p + f"mlp.experts.{e}.gate_proj.weight"] = Piece(m + "experts.mlp.w1", _rows(*rows))
        out[p + f"mlp.experts.{e}.up_proj.weight"] = Piece(m + "experts.mlp.w3", _rows(*rows))
        out[p + f"mlp.experts.{e}.down_proj.weight"] = Piece(m + "experts.mlp.w2", _columns_t_of_rows(*rows))
    return out


def _columns_t_of_rows(begin: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[begin:end].T


def olmoddp_layout(
    spec: ModelSpec, fused_qkv: bool = True, older: bool = False
) -> tuple[dict[str, Shape], dict[str, Piece]]:
    """(OLMo-core key -> shape, our interchange name -> Piece) of an OLMoDDP model of ``spec``;
    ``fused_qkv`` False: the ``default`` attention's separate w_q / w_k / w_v; ``older``: the
    feed-forwards of OLMo-core's older ``moe_reordered_norm`` model (read only)."""
    d, q, kv = spec.d_model, spec.q_width, spec.kv_width
    norm = (spec.head_dim,) if spec.qk_norm == "per_head" else None
    sizes: dict[str, Shape] = {"embeddings.weight": (spec.padded_vocab_size, d)}
    pieces = {"model.embed_tokens.weight": Piece("embeddings.weight", lambda t: t)}
    if spec.embedding_norm:
        sizes["embedding_norm.weight"] = (d,)
        pieces["model.embed_norm.weight"] = Piece("embedding_norm.weight", lambda t: t)
    for i in range(spec.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        if fused_qkv:
            sizes[b + "attention.w_qkv.weight"] = (q + 2 * kv, d)
            for name, (begin, end) in {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.items():
                pieces[p + f"self_attn.{name}_proj.weight"] = Piece(b + "attention.w_qkv.weight", _rows(begin, end))
        else:
            for name, rows in {"q": q, "k": kv, "v": kv}.items():
                sizes[b + f"attention.w_{name}.weight"] = (rows, d)
                pieces[p + f"self_attn.{name}_proj.weight"] = Piece(b + f"attention.w_{name}.weight", lambda t: t)
        own: dict[str, tuple[str, Shape]] = {"self_attn.o_proj": ("attention.w_out", (d, q))}
        if spec.qk_norm != "none":
            own["self_attn.q_norm"] = ("attention.q_norm", norm or (q,))
            own["self_attn.k_norm"] = ("attention.k_norm", norm or (kv,))
        own["post_attention_layernorm"] = ("attention_norm", (d,))
        own["post_feedforward_layernorm"] = ("feed_forward_norm", (d,))
        if spec.norm_placement == "peri":  # use_peri_norm's input norms
            own["input_layernorm"] = ("attention_input_norm", (d,))
            own["pre_feedforward_layernorm"] = ("feed_forward_input_norm", (d,))
        for ours, (theirs, shape) in own.items():
            sizes[b + theirs + ".weight"] = shape
            pieces[p + ours + ".weight"] = Piece(b + theirs + ".weight", lambda t: t)
        pieces.update((_older_ffn_pieces if older else _ffn_pieces)(spec, i, p, sizes))
    sizes["lm_head.norm.weight"] = (d,)
    sizes["lm_head.w_out.weight"] = (spec.padded_vocab_size, d)
    pieces["model.norm.weight"] = Piece("lm_head.norm.weight", lambda t: t)
    pieces["lm_head.weight"] = Piece("lm_head.w_out.weight", lambda t: t)
    return sizes, pieces


def stores_fused_qkv(keys) -> bool:
    """Whether OLMo-core keys hold the ``fused_v2`` attention's w_qkv (else w_q / w_k / w_v)."""
    return not any(k.endswith("attention.w_q.weight") for k in keys)


def stores_older_moe(keys) -> bool:
    """Whether OLMo-core keys hold the older ``moe_reordered_norm`` model (``feed_forward_moe.*``)."""
    return any(".feed_forward_moe." in k for k in keys)


def check_stored(spec: ModelSpec, stored: Mapping[str, Shape], origin: str) -> tuple[dict[str, Shape], dict]:
    """The layout of ``spec`` that ``stored`` (OLMo-core key -> shape) holds, after checking every
    key and shape: the first missing, misshapen or unexpected tensor is a one-line error."""
    check_expressible(spec, origin)
    older = stores_older_moe(stored)
    if older and spec.moe is not None and (spec.moe.n_shared_experts or spec.moe.restore_weight_scale):
        raise CheckpointError(
            f"{origin}: an OLMo-core moe_reordered_norm checkpoint, which has no restored weight scale and mixes "
            "a shared MLP as shared / (k + 1) + routed x k / (k + 1); the spec cannot express either: use a spec "
            "with moe.n_shared_experts 0 and restore_weight_scale false"
        )
    sizes, pieces = olmoddp_layout(spec, fused_qkv=stores_fused_qkv(stored), older=older)
    for key, shape in sizes.items():
        if key not in stored:
            raise CheckpointError(
                f"{origin}: missing tensor '{key}' (shape {shape}) of an OLMo-core MoE model of spec '{spec.name}'; "
                "the checkpoint is incomplete or was written for another spec (check n_layers and moe.layers)"
            )
        if tuple(stored[key]) != shape:
            raise CheckpointError(
                f"{origin}: tensor '{key}' has shape {tuple(stored[key])}, spec '{spec.name}' needs {shape}; "
                "pass the spec the checkpoint was trained with (check d_model, heads, head_dim, qk_norm, moe sizes)"
            )
    unexpected = sorted(set(stored) - set(sizes))
    if unexpected:
        raise CheckpointError(
            f"{origin}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all) is not a parameter of an "
            f"OLMo-core MoE model of spec '{spec.name}'; check n_layers, moe.layers and moe.n_shared_experts "
            "(shared-expert routers, biases and latent projections are not mapped)"
        )
    return sizes, pieces


def olmoddp_state(spec: ModelSpec, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OLMoDDP model state dict (OLMo-core keys, ``fused_v2`` attention) from our tensors
    ``fetch(name)``: each OLMo-core tensor the concatenation of the slices ``olmoddp_layout`` cuts."""
    check_expressible(spec, f"spec '{spec.name}'")
    sizes, pieces = olmoddp_layout(spec)
    parts: dict[str, list[str]] = {key: [] for key in sizes}
    for name, piece in pieces.items():
        parts[piece.key].append(name)
    state = {}
    for key, names in parts.items():
        tensors = [fetch(n) for n in names]
        if key.endswith("routed_experts_router.weight"):
            t = tensors[0].reshape(-1)
        elif key.endswith("routed_experts.w_up_gate"):  # names: up, gate, down of each expert in turn
            t = torch.stack([torch.cat([tensors[2 * e], tensors[2 * e + 1]]) for e in range(len(tensors) // 2)])
        elif key.endswith("routed_experts.w_down"):
            t = torch.stack([w.T for w in tensors])
        elif key.endswith("shared_experts.w_up_gate"):
            t = torch.cat(tensors).T
        elif key.endswith("shared_experts.w_down"):
            t = tensors[0].T.unsqueeze(0)
        else:
            t = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        assert tuple(t.shape) == sizes[key], (key, t.shape)
        state[key] = t.contiguous()
    return state
