"""Context parallelism: one sequence split over the ``C`` ranks of a context group.

The split is ``olmo_model.context.ContextLayout``'s zigzag one (2C chunks of ``S / 2C`` tokens;
rank r holds chunks r and 2C-1-r, so causal attention costs every rank the same). The parallelize
step installs a ``ContextParallel`` on the model (``OlmoModel.context``); the model asks it for
its shard's RoPE positions and, per attention kind, for the attention to call in place of
``scaled_dot_product_attention``. Everything else in a block (projections, norms, MLP) is
per-token and needs nothing. The model holds no parallelism decision (contract 6): with no
context installed (C = 1) its path is exactly the unsplit one.

Keys and values cross ranks in two ways:

- **global layers**: every rank all-gathers K and V of the whole group (one collective per layer;
  backward a reduce-scatter), restores sequence order and runs each of its two chunks against the
  keys up to the chunk's end, with the causal (and document) mask on true positions. All-gather
  rather than ring attention: with grouped-query attention K/V are ``kv_heads / n_heads`` of Q's
  size (1/5 for olmo3-32b), so the gathered K/V of a 65,536-token sequence stay small beside the
  activations; one all-gather per layer needs no online-softmax merge of partial results (whose
  backward SDPA cannot give, as its log-sum-exp output has no gradient) and overlaps with the
  previous layer's compute where collectives run on their own stream. Olmo 3 7B (full MHA, 32 KV
  heads) gathers 2 x 65,536 x 4096 bf16 = 1 GiB per global layer, transient unless saved for
  backward (activation checkpointing recomputes it).
- **sliding layers** (window W): a chunk starting at position p needs only keys p-W+1 .. p-1
  from before it. Each rank sends every other rank exactly the rows of K and V that rank's chunks'
  windows reach (one ``all_to_all_single`` with static split sizes per layer; rows a rank already
  holds stay local), then attends its chunks to (those rows, its own chunk) under the band mask.
  Any window is handled this way: rows are routed one by one, so a window longer than a chunk
  (``ContextLayout.halo(W) > 1``) pulls from several ranks; a window covering the whole sequence
  is a global layer (the model's own rule at C = 1). No case falls back to a full gather.

Document masking: document ids cross ranks the same way, once per forward per attention kind (no
gradient), and every mask is (causal or band) AND same document.

``bytes_sent`` counts, per attention kind, the bytes this rank's forward collectives send to
other ranks (an all-gather of n bytes sends n to each of C - 1 ranks), so tests and benches can
show that a sliding layer moves only its window's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from olmo_model.context import ContextLayout

AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- collectives with autograd ---------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: reduce-scatter of the
    gradient (sum), so each rank gets the gradient every rank's use of its rows produced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        with record_function("context_parallel.all_gather"):
            dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        with record_function("context_parallel.reduce_scatter"):
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


class _ExchangeRows(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with static split sizes; backward sends the gradients
    back the same way (splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with record_function("context_parallel.halo_all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        with record_function("context_parallel.halo_all_to_all_backward"):
            dist.all_to_all_single(
                out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
            )
        return out, None, None, None


# ---- the static plan of one layout -------------------------------------------------------------


@dataclass(frozen=True)
class HaloPlan:
    """Which rows a sliding layer of window ``window`` moves, for rank ``rank`` of ``layout``.

    ``send_index``: this rank's local rows to send, grouped by destination rank (in rank order;
    ``send_sizes`` per destination, zero to itself). ``recv_sizes``: rows from each source.
    ``halo_index[slot]``: for its chunk in ``slot``, the rows before the chunk (sequence order)
    as indices into ``cat(local rows, received rows)``; ``halo_positions[slot]`` their positions."""

    send_index: np.ndarray
    send_sizes: list[int]
    recv_sizes: list[int]
    halo_index: tuple[np.ndarray, np.ndarray]
    halo_positions: tuple[np.ndarray, np.ndarray]


def _needed(layout: ContextLayout, rank: int, window: int) -> list[np.ndarray]:
    """Per slot, the positions before rank ``rank``'s chunk that its window reaches (ascending)."""
    out = []
    for j in layout.chunks_of(rank):
        start = j * layout.chunk
        out.append(np.arange(max(0, start - (window - 1)), start, dtype=np.int64))
    return out


def _local_index(layout: ContextLayout, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner rank, row in the owner's shard) of each position."""
    chunk = position // layout.chunk
    owners = np.array([layout.owner(int(j)) for j in chunk], dtype=np.int64).reshape(-1, 2)
    return owners[:, 0], owners[:, 1] * layout.chunk + position % layout.chunk


@cache
def halo_plan(layout: ContextLayout, rank: int, window: int) -> HaloPlan:
    degree = layout.degree
    # rows[src][dst]: src's local rows dst needs (sorted, each once even if both of dst's chunks need it)
    rows: list[list[np.ndarray]] = [[np.zeros(0, np.int64)] * degree for _ in range(degree)]
    for dst in range(degree):
        pos = np.unique(np.concatenate(_needed(layout, dst, window)))
        owner, local = _local_index(layout, pos)
        for src in range(degree):
            if src != dst:
                rows[src][dst] = local[owner == src]
    send_sizes = [len(rows[rank][dst]) for dst in range(degree)]
    recv_sizes = [len(rows[src][rank]) for src in range(degree)]
    send_index = np.concatenate(rows[rank]) if any(send_sizes) else np.zeros(0, np.int64)
    # Where each received row lands in cat(local, received): its source's block, then its place.
    recv_at: dict[tuple[int, int], int] = {}
    offset = layout.shard_length
    for src in range(degree):
        for i, local in enumerate(rows[src][rank]):
            recv_at[(src, int(local))] = offset + i
        offset += recv_sizes[src]
    halo_index, halo_positions = [], []
    for pos in _needed(layout, rank, window):
        owner, local = _local_index(layout, pos)
        idx = [int(li) if o == rank else recv_at[(int(o), int(li))] for o, li in zip(owner, local)]
        halo_index.append(np.asarray(idx, dtype=np.int64))
        halo_positions.append(pos)
    return HaloPlan(
        send_index=send_index,
        send_sizes=send_sizes,
        recv_sizes=recv_sizes,
        halo_index=(halo_index[0], halo_index[1]),
        halo_positions=(halo_positions[0], halo_positions[1]),
    )


# ---- the context object ------------------------------------------------------------------------


def _rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V [B, Hkv, s, hd] as one [s, 2, B, Hkv, hd] tensor: the sequence leads, so
    collectives split and index along dim 0."""
    return torch.stack([k, v]).permute(3, 0, 1, 2, 4)


def _unrows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kv = rows.permute(1, 2, 3, 0, 4)  # [2, B, Hkv, n, hd]
    return kv[0], kv[1]


@dataclass
class ContextParallel:
    """This rank's place in its context group and the attention across it (the object
    ``parallelize`` installs as ``OlmoModel.context``).

    ``group``: the context group's process group (``degree`` ranks, consecutive global ranks);
    ``rank``: this rank's index in it. ``dp_rank`` / ``dp_size``: its data-parallel place (the
    loader's rank and size: all ranks of a group read the same rows)."""

    group: dist.ProcessGroup
    degree: int
    rank: int
    dp_rank: int
    dp_size: int
    compiled: bool = False  # the blocks are compiled (torch.compile): keep the attention out of the graph
    bytes_sent: dict[str, int] = field(default_factory=lambda: {"global": 0, "sliding": 0})
    # Index tensors and masks derived from the layout, per (what, sizes..., device): made once.
    _cache: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def cached(self, key: tuple, device: torch.device, make: Callable[[], np.ndarray | torch.Tensor]) -> torch.Tensor:
        """``make()`` as a tensor on ``device``, made on first use. Made outside inference mode, as
        the model's RoPE tables: indices are saved for backward, which inference tensors cannot be."""
        full = (*key, device)
        if full not in self._cache:
            with torch.inference_mode(False):
                self._cache[full] = torch.as_tensor(make(), device=device)
        return self._cache[full]

    def layout(self, local_seq: int) -> ContextLayout:
        return ContextLayout(local_seq * self.degree, self.degree)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of whole rows ``x`` [B, S] (token ids, labels, document ids)."""
        layout = ContextLayout(x.shape[-1], self.degree)  # refuses an S that 2 x degree does not divide
        return x[..., self.positions(layout.shard_length, x.device)]

    def positions(self, local_seq: int, device: torch.device) -> torch.Tensor:
        """The sequence positions of this rank's ``local_seq`` columns (RoPE's positions)."""
        return self.cached(("positions", local_seq), device, lambda: self.layout(local_seq).positions(self.rank))

    def attention(self, window: int | None, local_seq: int, doc_ids: torch.Tensor | None) -> AttentionOp:
        """The attention of one kind for this forward: ``op(q, k, v)`` with q [B, H, s, hd], k/v
        [B, Hkv, s, hd] of this rank's positions (RoPE applied) -> [B, H, s, hd]. ``doc_ids``
        [B, s] this rank's document ids (None: no document masking)."""
        layout = self.layout(local_seq)
        op: AttentionOp
        if window is None or window >= layout.sequence_length:
            op = _GlobalAttention(self, layout, doc_ids)
        else:
            op = _SlidingAttention(self, layout, window, doc_ids)
        # Under torch.compile (the blocks compiled) the collectives run eagerly, outside the graph.
        return torch.compiler.disable(op) if self.compiled else op

    def _count(self, kind: str, t: torch.Tensor, rows_sent: int) -> None:
        self.bytes_sent[kind] += rows_sent * (t.numel() // max(t.shape[0], 1)) * t.element_size()


class _GlobalAttention:
    """Every earlier key: all-gather K/V over the group, sequence order, chunk-wise causal SDPA."""

    def __init__(self, cp: ContextParallel, layout: ContextLayout, doc_ids: torch.Tensor | None):
        self.cp, self.layout = cp, layout
        self.chunks = layout.chunks_of(cp.rank)
        self.doc_seq: torch.Tensor | None = None
        self.doc_local = doc_ids
        if doc_ids is not None:
            gathered = _GatherRows.apply(doc_ids.t(), cp.group, cp.degree)  # [S, B], rank-major
            self.doc_seq = gathered[self._inverse(doc_ids.device)].t()  # [B, S] in sequence order

    def _inverse(self, device: torch.device) -> torch.Tensor:
        return self.cp.cached(("inverse", self.layout.sequence_length), device, lambda: self.layout.inverse)

    def _causal(self, slot: int, device: torch.device) -> torch.Tensor:
        """[chunk, (j + 1) * chunk]: key k visible to query q of chunk j iff k <= q."""
        c, j = self.layout.chunk, self.chunks[slot]

        def make() -> torch.Tensor:
            return torch.arange((j + 1) * c)[None, :] <= torch.arange(j * c, (j + 1) * c)[:, None]

        return self.cp.cached(("causal", self.layout.sequence_length, slot), device, make)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, c = self.cp, self.layout.chunk
        local = _rows(k, v)
        cp._count("global", local, local.shape[0] * (cp.degree - 1))
        gathered = _GatherRows.apply(local, cp.group, cp.degree)  # [S, 2, B, Hkv, hd] rank-major
        k_seq, v_seq = _unrows(gathered[self._inverse(q.device)])
        outs = []
        for slot, j in enumerate(self.chunks):
            n_keys = (j + 1) * c
            mask = self._causal(slot, q.device)  # [c, n_keys]
            if self.doc_seq is not None and self.doc_local is not None:
                same = self.doc_local[:, slot * c : (slot + 1) * c, None] == self.doc_seq[:, None, :n_keys]
                mask = (mask & same)[:, None]  # [B, 1, c, n_keys]
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, slot * c : (slot + 1) * c],
                    k_seq[:, :, :n_keys],
                    v_seq[:, :, :n_keys],
                    attn_mask=mask,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
            )
        return torch.cat(outs, dim=2)


class _SlidingAttention:
    """Keys within the window: each chunk attends to its own keys and the W - 1 before it,
    which come from the ranks holding them (``halo_plan``), nothing else."""

    def __init__(self, cp: ContextParallel, layout: ContextLayout, window: int, doc_ids: torch.Tensor | None):
        self.cp, self.layout, self.window = cp, layout, window
        self.plan = halo_plan(layout, cp.rank, window)
        self.doc_local = doc_ids
        self.doc_halo: list[torch.Tensor] | None = None
        if doc_ids is not None:
            pool = self._pool(doc_ids.t())  # [s + received, B]
            self.doc_halo = [pool[self._halo_index(slot, doc_ids.device)].t() for slot in (0, 1)]

    def _key(self, what: str, *more: int) -> tuple:
        return (what, self.layout.sequence_length, self.window, *more)

    def _halo_index(self, slot: int, device: torch.device) -> torch.Tensor:
        return self.cp.cached(self._key("halo", slot), device, lambda: self.plan.halo_index[slot])

    def _band(self, slot: int, device: torch.device) -> torch.Tensor:
        """[chunk, halo + chunk]: key k (the halo's, then the chunk's) visible to query q iff
        q - window < k <= q, on true positions."""
        c, j = self.layout.chunk, self.layout.chunks_of(self.cp.rank)[slot]

        def make() -> torch.Tensor:
            k_pos = torch.cat([torch.as_tensor(self.plan.halo_positions[slot]), torch.arange(j * c, (j + 1) * c)])
            q_pos = torch.arange(j * c, (j + 1) * c)[:, None]
            return (k_pos[None, :] <= q_pos) & (k_pos[None, :] > q_pos - self.window)

        return self.cp.cached(self._key("band", slot), device, make)

    def _pool(self, local: torch.Tensor) -> torch.Tensor:
        """cat(this rank's rows, the rows the others send it) along dim 0."""
        plan = self.plan
        send = local[self.cp.cached(self._key("send"), local.device, lambda: plan.send_index)]
        received = _ExchangeRows.apply(send, self.cp.group, plan.send_sizes, plan.recv_sizes)
        return torch.cat([local, received])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, c, plan = self.cp, self.layout.chunk, self.plan
        local = _rows(k, v)
        cp._count("sliding", local, sum(plan.send_sizes))
        pool = self._pool(local)
        outs = []
        for slot in (0, 1):
            own = slice(slot * c, (slot + 1) * c)
            halo = pool[self._halo_index(slot, q.device)]
            k_s, v_s = _unrows(torch.cat([halo, local[own]]))
            mask = self._band(slot, q.device)
            if self.doc_halo is not None and self.doc_local is not None:
                doc_own = self.doc_local[:, own]
                doc_k = torch.cat([self.doc_halo[slot], doc_own], dim=1)
                mask = (mask & (doc_own[:, :, None] == doc_k[:, None, :]))[:, None]
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, own], k_s, v_s, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
                )
            )
        return torch.cat(outs, dim=2)
