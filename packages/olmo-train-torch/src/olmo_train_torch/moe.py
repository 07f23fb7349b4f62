"""The mixture-of-experts feed-forward block of the torch model.

Maths (the contract shared with the JAX trainer and ``olmo_model.reference``):

- router logits ``r = x @ W_router^T`` in float32; probabilities ``p = softmax(r)`` (or
  ``sigmoid(r)``); each token takes the top-k of ``p`` (ties to the lower expert index,
  as the reference's stable sort; slots in ascending expert index); weights ``w = p[top-k]``, renormalised to sum 1 if ``normalize_top_k``,
  then times k (summing to k) if ``restore_weight_scale``;
- ``out = sum_k w_k SwiGLU_{e_k}(x) + sum_s SwiGLU_shared_s(x)``;
- dropless: every (token, slot) assignment is computed. The assignments are sorted by
  expert (a stable argsort, so the order inside a group is the token order), the group
  sizes are counted with ``scatter_add`` (no host sync, unlike ``bincount`` on CUDA) and
  each of the three SwiGLU matmuls is ONE grouped GEMM over the variable-size groups;
  the outputs go back to (token, slot) order and are summed over the k slots.

Host syncs on GPU: none on the local path with ``grouped_mm`` (shapes are static: T*k
rows; group ends stay on the device). They remain in the ``loop`` backend (group sizes),
in expert parallelism (all-to-all split sizes, ``expert_parallel``) and where metrics are
read (``moe_metrics``, once per logged step).

Routing modes (a runtime knob, never in the spec; ``configure_moe``):
``learned`` (above); ``random``: the scores are i.i.d. uniform numbers, weights are the
softmax of the chosen k scores, no gradient reaches the router (``configure_moe`` freezes
it); ``uniform``: token t goes to experts ``(t*k + j) mod E`` with weight 1/k (perfect
balance). The router still runs (detached) in these modes so that its aux losses are
reported. Both modes are independent of the data/expert-parallel layout, as in the JAX
trainer: tokens are numbered by their index in the GLOBAL micro-batch (the data-parallel
ranks' micro-batches concatenated in rank order; this rank's first token is number
``dp_rank * T``), and random scores are drawn for the whole global micro-batch from a
generator seeded by (seed, step, micro-step, layer) only, each rank keeping its own rows
(every rank draws ``dp_size * T * E`` numbers: cheap next to the expert GEMMs).

Grouped GEMM backends (``gemm``):

- ``grouped_mm``: ``torch._grouped_mm(x [N,in], w [E,in,out], offs)``, group ends as an
  int32 device tensor, so the expert computation needs no host sync. In torch 2.15 it
  runs on CPU (float32/bfloat16) and on CUDA (the fast CUTLASS kernel on sm90+);
  it needs 16-byte aligned rows (in/out widths a multiple of 4 in fp32, 8 in bf16) and
  no float64;
- ``loop``: the correct fallback everywhere else: one ``matmul`` per expert over its
  contiguous slice of the sorted tokens (the group sizes come to the host once per
  layer, which is a sync on GPU);
- ``auto``: ``grouped_mm`` when dtype and alignment allow, else ``loop``.

MXFP8 (``mxfp8=True``): an emulation of OCP MX FP8 for the expert GEMMs. Both operands
of each routed-expert matmul are quantised to e4m3 with one power-of-two (e8m0) scale
per 32 contiguous elements along the reduction axis, dequantised, and multiplied in
the working dtype. Gradients pass straight through to the unquantised tensors (the
backward GEMMs are not quantised here). The fast path (not available on this machine)
is the block-scaled tcgen05 MMA of B200/B300: ``torch._scaled_mm`` /
``torch._scaled_grouped_mm`` with ``float8_e4m3fn`` operands and ``float8_e8m0fnu``
scales in the swizzled block layout (torchao's ``MXLinear`` / MoE training prototype
builds those); Hopper (H100/H200) has FP8 tensor cores but no MX block scaling.

Aux losses need the whole global micro-batch (every data-parallel rank), so the block
only returns this rank's ``RoutingSums``; ``routing_stats`` reduces them (one
all-reduce of 2E+3 numbers per layer) outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from olmo_model import MoESpec
from olmo_model.moe import E4M3_MAX, MX_BLOCK, RoutingMode, check_routing, moe_train_metrics
from olmo_model.moe import aux_loss as weighted_aux_loss

GemmBackend = Literal["auto", "grouped_mm", "loop"]
GEMM_BACKENDS: tuple[str, ...] = ("auto", "grouped_mm", "loop")


# ---- MXFP8 emulation ------------------------------------------------------------------


def mxfp8_quantize(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``t`` rounded through MXFP8 and back: blocks of 32 along ``dim`` share a scale
    2^ceil(log2(amax / 448)), values are cast to e4m3 and multiplied back by the scale.

    Rounding the scale exponent up (torchao's "ceil" mode) keeps every scaled value within
    e4m3's range, so nothing saturates: each element's error is at most 2^-4 of itself
    (3 mantissa bits, round to nearest) or, in e4m3's subnormal range, 2^-10 of the scale.
    Returns the working dtype; a trailing partial block is padded with zeros."""
    dim = dim % t.dim()
    moved = t.movedim(dim, -1)
    n = moved.shape[-1]
    pad = (-n) % MX_BLOCK
    x = F.pad(moved.float(), (0, pad)) if pad else moved.float()
    blocks = x.reshape(*x.shape[:-1], -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX))
    # e8m0 encodes exponents in [-127, 127]; the float8 cast keeps the scale honest.
    scale = torch.exp2(exponent.clamp(-127, 127)).to(torch.float8_e8m0fnu).float()
    q = (blocks / scale).to(torch.float8_e4m3fn)
    out = (q.float() * scale).reshape(x.shape)[..., :n]
    return out.movedim(-1, dim).to(t.dtype)


def _straight_through(t: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    # Forward value: the quantised tensor; gradient: identity to the original.
    return t + (quantized - t).detach()


# ---- grouped GEMM ---------------------------------------------------------------------


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if x.dtype not in (torch.float32, torch.bfloat16) or w.dtype != x.dtype:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    item = x.element_size()
    return (x.shape[-1] * item) % 16 == 0 and (w.shape[-1] * item) % 16 == 0


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, backend: GemmBackend = "auto"
) -> torch.Tensor:
    """Rows of ``x`` [N, in], sorted into consecutive groups of ``group_sizes`` [G] rows,
    each times its own ``w[g]`` [in, out] -> [N, out]."""
    if backend == "grouped_mm" or (backend == "auto" and _grouped_mm_ok(x, w)):
        ends = torch.cumsum(group_sizes, 0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=ends)
    outs = []
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        outs.append(x[start : start + size] @ w[g])
        start += size
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts stored as stacked weights, the layout a grouped GEMM reads:
    ``gate_proj``/``up_proj`` [n, hidden, d] and ``down_proj`` [n, d, hidden], each
    expert's slice laid out as an ``nn.Linear`` weight (out, in), as the HF names are.
    Expert parallelism keeps a contiguous slice of experts on each rank."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        # Under expert parallelism on a DeviceMesh these become DTensors sharded on dim 0
        # (so that checkpoints hold every shard); the GEMMs read the local shard.
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.gemm: GemmBackend = "auto"
        self.mxfp8 = False

    @property
    def n_experts(self) -> int:
        """Experts held here (this rank's shard under expert parallelism)."""
        return _local(self.gate_proj).shape[0]

    def forward(self, xs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """``xs`` [N, d] sorted by expert, ``group_sizes`` [n] -> SwiGLU outputs [N, d]."""
        gate, up, down = (_local(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        device = xs.device.type
        if torch.is_autocast_enabled(device):
            # torch._grouped_mm is not on autocast's list: cast as F.linear would be cast.
            dtype = torch.get_autocast_dtype(device)
            xs, gate, up, down = (t.to(dtype) for t in (xs, gate, up, down))
        elif gate.dtype != xs.dtype:
            # Expert weights left out of FSDP2's mixed precision (expert parallel) stay in
            # fp32 while the activations arrive in its param dtype: compute in the latter.
            gate, up, down = (t.to(xs.dtype) for t in (gate, up, down))
        if self.mxfp8:
            # Each matmul reduces over the last axis of both operands: d for gate/up, hidden for down.
            gate = _straight_through(gate, mxfp8_quantize(gate, -1))
            up = _straight_through(up, mxfp8_quantize(up, -1))
            down = _straight_through(down, mxfp8_quantize(down, -1))
            xs = _straight_through(xs, mxfp8_quantize(xs, -1))
        g = grouped_matmul(xs, gate.transpose(1, 2), group_sizes, self.gemm)
        u = grouped_matmul(xs, up.transpose(1, 2), group_sizes, self.gemm)
        h = F.silu(g) * u
        if self.mxfp8:
            h = _straight_through(h, mxfp8_quantize(h, -1))
        return grouped_matmul(h, down.transpose(1, 2), group_sizes, self.gemm)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class SwiGLU(nn.Module):
    """A dense SwiGLU expert (the shared expert), ``nn.Linear`` weights as in the HF layout."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---- routing --------------------------------------------------------------------------


class RoutingSums(NamedTuple):
    """One MoE layer's routing over this rank's tokens of one micro-batch (a NamedTuple, so
    that FSDP2 and activation checkpointing see its tensors as block outputs)."""

    tokens_per_expert: torch.Tensor  # [E] int64: (token, slot) assignments per expert
    prob_sum: torch.Tensor  # [E] float32: sum over tokens of the router probability (has grad)
    z_sum: torch.Tensor  # [] float32: sum over tokens of logsumexp(logits)^2 (has grad)
    n_tokens: int  # tokens of this rank
    top_k: int
    dropped: int  # assignments without an expert output (rows in minus rows back): 0 when dropless


@dataclass
class Routing:
    """Which experts each token uses (``experts`` [T, k]) with which weights ([T, k], fp32)."""

    experts: torch.Tensor
    weights: torch.Tensor


def top_k_lowest_index_on_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best experts of each row [T, E] -> [T, k], in ascending expert index; among
    equal scores the lower index wins (the reference's stable sort), in O(E) per row.

    torch.topk alone promises nothing about ties, and a stable sort is O(E log E) (10x the
    cost at 64 experts on CPU). So: the k-th largest score v; every expert above v, plus
    the lowest-index ones equal to v until k are taken; then one topk over the distinct
    keys E - index picks them out in index order."""
    e = scores.shape[-1]
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    still_needed = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (torch.cumsum(tied, -1) <= still_needed))
    key = chosen * (e - torch.arange(e, device=scores.device))
    return torch.topk(key, k, dim=-1).indices


def route(
    logits: torch.Tensor,
    moe: MoESpec,
    mode: RoutingMode = "learned",
    generator: torch.Generator | None = None,
    *,
    first_token: int = 0,
    global_tokens: int | None = None,
) -> tuple[Routing, torch.Tensor]:
    """Routing of T tokens from float32 router ``logits`` [T, E] -> (Routing, router
    probabilities [T, E]). The T tokens are numbers ``first_token .. first_token+T-1`` of a
    global micro-batch of ``global_tokens`` (default T): uniform mode numbers them so, and
    random mode draws scores for all ``global_tokens`` from ``generator`` and keeps their rows."""
    probs = torch.softmax(logits, dim=-1) if moe.gating == "softmax" else torch.sigmoid(logits)
    t, e, k = logits.shape[0], moe.n_experts, moe.top_k
    if mode == "learned":
        experts = top_k_lowest_index_on_ties(probs, k)
        weights = probs.gather(1, experts)
        if moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif mode == "random":
        n = t if global_tokens is None else global_tokens
        scores = torch.rand(n, e, generator=generator, device=logits.device)[first_token : first_token + t]
        experts = top_k_lowest_index_on_ties(scores, k)
        weights = torch.softmax(scores.gather(1, experts), dim=-1)
    elif mode == "uniform":
        slots = torch.arange(first_token * k, (first_token + t) * k, device=logits.device).reshape(t, k)
        experts = slots % e
        weights = torch.full((t, k), 1.0 / k, device=logits.device)
    else:
        check_routing(mode)
        raise AssertionError(mode)  # a mode check_routing accepts but this function does not handle
    if moe.restore_weight_scale:  # every mode's k weights sum to 1 here; OLMo-core 3 scales them to sum to k
        weights = weights * k
    return Routing(experts, weights), probs


def sort_by_expert(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, group_sizes): ``order`` [T*k] lists flat (token, slot) indices grouped by
    expert, token order kept inside a group; ``group_sizes`` [E] int64."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.zeros(n_experts, dtype=torch.long, device=flat.device)
    sizes.scatter_add_(0, flat, torch.ones_like(flat))
    return order, sizes


class Dispatcher(Protocol):
    """What runs the routed experts on rows held elsewhere (``expert_parallel``'s dispatcher):
    ``xs`` [N, d] sorted by global expert and ``sizes`` [E] -> expert outputs [N, d], same order."""

    def __call__(self, xs: torch.Tensor, sizes: torch.Tensor, experts: GroupedExperts) -> torch.Tensor: ...


class MoE(nn.Module):
    """``router`` (an ``nn.Linear`` d -> E; HF's ``mlp.gate``), routed ``experts`` and optional
    ``shared_experts``; ``forward(x [..., d]) -> (out [..., d], RoutingSums)``.

    ``dispatcher`` is None for local experts; ``expert_parallel.apply_expert_parallel``
    sets one that moves tokens to the ranks owning their experts and back."""

    def __init__(self, moe: MoESpec, d_model: int, layer: int):
        super().__init__()
        self.spec = moe
        self.layer = layer
        self.router = nn.Linear(d_model, moe.n_experts, bias=False)
        self.experts = GroupedExperts(moe.n_experts, d_model, moe.expert_hidden)
        self.shared_experts = nn.ModuleList(SwiGLU(d_model, moe.shared_hidden) for _ in range(moe.n_shared_experts))
        self.routing: RoutingMode = "learned"
        self.routing_seed = 0
        # Advanced by the trainer (set_routing_step); part of the random-routing seed.
        self.routing_step = 0
        self.routing_micro_step = 0
        # This rank's place among the data-parallel ranks: where its tokens sit in the
        # global micro-batch (all ranks hold micro-batches of the same size).
        self.dp_rank = 0
        self.dp_size = 1
        self.dispatcher: Dispatcher | None = None

    def _generator(self, device: torch.device) -> torch.Generator:
        # One stream per (seed, step, micro-step, layer), the same on every rank:
        # reproducible, independent of the rank layout and of the order in which layers run
        # (activation checkpointing replays them).
        # A polynomial in a large prime (not Python's hash(), which may change between
        # versions): distinct tuples give distinct seeds for any realistic step count.
        seed = 0
        for part in (self.routing_seed, self.routing_step, self.routing_micro_step, self.layer):
            seed = (seed * 1_000_003 + part) % (2**63)
        return torch.Generator(device=device).manual_seed(seed)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingSums]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        learned = self.routing == "learned"
        router_in = tokens if learned else tokens.detach()
        # The router runs in float32 even under bf16 autocast (the contract's fp32 logits).
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(router_in.float(), self.router.weight.float())
        if not learned:
            logits = logits.detach()
        generator = self._generator(x.device) if self.routing == "random" else None
        n = tokens.shape[0]
        routing, probs = route(
            logits, self.spec, self.routing, generator, first_token=self.dp_rank * n, global_tokens=self.dp_size * n
        )
        order, sizes = sort_by_expert(routing.experts, self.spec.n_experts)
        # Gather through a permutation of the k copies of each token (not tokens[order // k]):
        # the backward then scatters to distinct rows and sums the k copies, no atomics.
        per_slot_in = tokens.unsqueeze(1).expand(-1, self.spec.top_k, -1).reshape(-1, shape[-1])
        xs = per_slot_in[order]
        if self.dispatcher is None:
            ys = self.experts(xs, sizes)
        else:
            ys = self.dispatcher(xs, sizes, self.experts)
        # Back to (token, slot) order, then a sum over the k slots: deterministic, unlike an
        # index_add of the sorted rows (atomics on GPU), so resumed runs repeat bitwise.
        per_slot = torch.empty_like(ys).index_copy(0, order, ys).reshape(*routing.experts.shape, -1)
        out = (per_slot * routing.weights.to(ys.dtype).unsqueeze(-1)).sum(1)
        for shared in self.shared_experts:
            out = out + shared(tokens)
        lse = torch.logsumexp(logits, dim=-1)
        stats = RoutingSums(
            tokens_per_expert=sizes,
            prob_sum=probs.sum(0),
            z_sum=(lse * lse).sum(),
            n_tokens=tokens.shape[0],
            top_k=self.spec.top_k,
            dropped=routing.experts.numel() - ys.shape[0],
        )
        return out.reshape(shape), stats


# ---- aux losses and metrics -------------------------------------------------------------


@dataclass
class RoutingStats:
    """Routing of the MoE layers over the global micro-batch (the JAX trainer's type of the same
    name): aux losses averaged over layers, counts summed. The losses' values are global, their
    gradients flow through this rank's tokens only, so summing the ranks' gradients (or
    averaging rank-count-scaled losses, as DDP/FSDP do) gives the gradient of the global loss."""

    load_balancing: torch.Tensor  # [] E * sum_e f_e P_e, mean over layers
    router_z: torch.Tensor  # [] mean over tokens of logsumexp(logits)^2, mean over layers
    tokens_per_expert: torch.Tensor  # [E] int64, global, summed over layers
    dropped: torch.Tensor  # [] int64, global, summed over layers


def aux_loss(stats: RoutingStats, moe: MoESpec, routing: RoutingMode = "learned") -> torch.Tensor:
    """The aux term of the training loss: lb_weight * lb + router_z_weight * router_z,
    zero for random/uniform routing (whose router is not trained)."""
    return weighted_aux_loss(stats.load_balancing, stats.router_z, moe, routing)


def _global(local: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of ``local``, differentiable only through ``local``."""
    if group is None:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def routing_stats(stats: list[RoutingSums], group=None) -> RoutingStats:
    """Load-balancing and router z-loss over the global micro-batch (the ranks of
    ``group``, the data-parallel group; None: this process only). One all-reduce of
    2E+3 numbers per layer (counts, probability sums, z sum, tokens, dropped); counts
    carry no gradient, P_e and the z sums do."""
    if not stats:
        raise ValueError("routing_stats: no RoutingSums; the model has no MoE layer (spec.moe is null)")
    lbs, zs, counts, dropped = [], [], [], []
    for s in stats:
        n_experts = s.tokens_per_expert.shape[0]
        packed = torch.cat(
            [
                s.tokens_per_expert.float(),
                s.prob_sum.float(),
                torch.stack(
                    [s.z_sum.float(), s.z_sum.new_tensor(float(s.n_tokens)), s.z_sum.new_tensor(float(s.dropped))]
                ),
            ]
        )
        total = _global(packed, group)
        count, prob_sum, z_sum, n = (
            total[:n_experts].detach(),
            total[n_experts : 2 * n_experts],
            total[-3],
            total[-2].detach(),
        )
        dropped.append(total[-1].detach())
        f = count / (n * s.top_k)
        lbs.append(n_experts * (f * prob_sum / n).sum())
        zs.append(z_sum / n)
        counts.append(count.round().long())
    return RoutingStats(
        torch.stack(lbs).mean(),
        torch.stack(zs).mean(),
        torch.stack(counts).sum(0),
        torch.stack(dropped).sum().round().long(),
    )


def merge_micro_steps(terms: list[RoutingStats]) -> RoutingStats:
    """One step's aux over its accumulation micro-steps: losses averaged, counts summed."""
    return RoutingStats(
        torch.stack([t.load_balancing.detach() for t in terms]).mean(),
        torch.stack([t.router_z.detach() for t in terms]).mean(),
        torch.stack([t.tokens_per_expert for t in terms]).sum(0),
        torch.stack([t.dropped for t in terms]).sum(),
    )


def moe_metrics(stats: RoutingStats, ep_size: int) -> dict[str, float | int | list[int]]:
    """The MoE keys of a train line: tokens per expert summed over MoE layers,
    per expert-parallel rank load max/mean, dropped assignments (measured: rows sent to
    the experts minus rows returned; 0 for this dropless block), the unweighted aux losses."""
    return moe_train_metrics(
        stats.tokens_per_expert.cpu().numpy(),
        int(stats.dropped),
        float(stats.load_balancing.detach()),
        float(stats.router_z.detach()),
        ep_size,
    )


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def configure_moe(
    model: nn.Module,
    *,
    routing: RoutingMode = "learned",
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    gemm: GemmBackend = "auto",
    mxfp8: bool = False,
) -> None:
    """Set the runtime knobs (not part of the spec) on every MoE block of ``model``: the
    routing mode and its seed, this rank's place among ``dp_size`` data-parallel ranks, the
    GEMM backend and MXFP8. Call it before wrapping the model (DDP/FSDP2): random and
    uniform routing freeze the router (``requires_grad=False``; it gets no gradient), which
    DDP must know when it is built."""
    check_routing(routing)
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm='{gemm}' is unknown; use one of {', '.join(GEMM_BACKENDS)}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside the {dp_size} data-parallel ranks; pass 0 <= dp_rank < dp_size")
    for m in moe_modules(model):
        m.routing, m.routing_seed, m.dp_rank, m.dp_size = routing, seed, dp_rank, dp_size
        m.router.weight.requires_grad_(routing == "learned")
        m.experts.gemm, m.experts.mxfp8 = gemm, mxfp8


def set_routing_step(model: nn.Module, step: int, micro_step: int = 0) -> None:
    """The optimizer step and accumulation micro-step whose micro-batch comes next (random
    routing's seed includes both)."""
    for m in moe_modules(model):
        m.routing_step, m.routing_micro_step = step, micro_step
