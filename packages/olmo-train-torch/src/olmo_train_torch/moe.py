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
  the outputs go back to (token, slot) order and are summed over the k slots;
- with a capacity factor (``configure_moe``; ``olmo_model.moe``'s rule, per (sequence,
  expert)): the kept assignments fill a static buffer of E x B x C rows, run as batched
  matmuls (or through the dispatcher's equal all-to-alls), and a dropped one adds nothing
  (``capacity``); ``RoutingSums.dropped`` counts them.

Host syncs on GPU: none on the local path with ``grouped_mm`` (shapes are static: T*k
rows; group ends stay on the device), none with a capacity factor, local or expert
parallel. They remain in the ``loop`` backend (group sizes), in dropless expert
parallelism (all-to-all split sizes, ``expert_parallel``) and where metrics are read
(``moe_metrics``, once per logged step).

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

The routed experts' grouped GEMMs (backends, MXFP8 emulation): ``grouped_gemm``.

Aux losses need the whole global micro-batch (every data-parallel rank), so the block
only returns this rank's ``RoutingSums``; ``routing_stats`` reduces them (one
all-reduce of 2E+3 numbers per layer) outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from olmo_model import MoESpec
from olmo_model.moe import RoutingMode, check_routing, expert_capacity, moe_train_metrics
from olmo_model.moe import aux_loss as weighted_aux_loss

from .capacity import capacity_slots, routed_with_capacity
from .grouped_gemm import GEMM_BACKENDS, GemmBackend, GroupedExperts


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
    dropped: torch.Tensor  # [] int64: assignments the capacity rule dropped (0 when dropless)


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
    """What runs the routed experts on rows held elsewhere (``expert_parallel``'s dispatcher).
    Dropless: ``xs`` [N, d] sorted by global expert and ``sizes`` [E] -> expert outputs [N, d],
    same order. With a capacity factor, ``exchange``: the dispatch buffer [E x B x C, d]
    (``capacity``'s expert-major layout) -> its expert outputs, same layout."""

    def __call__(self, xs: torch.Tensor, sizes: torch.Tensor, experts: GroupedExperts) -> torch.Tensor: ...

    def exchange(self, buffer: torch.Tensor, experts: GroupedExperts) -> torch.Tensor: ...


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
        # The recipe's moe.capacity_factor (configure_moe); None: dropless.
        self.capacity_factor: float | None = None

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
        # Gather through a permutation of the k copies of each token (not tokens[order // k]):
        # the backward then scatters to distinct rows and sums the k copies, no atomics.
        per_slot_in = tokens.unsqueeze(1).expand(-1, self.spec.top_k, -1).reshape(-1, shape[-1])
        sequence = shape[-2] if len(shape) > 2 else n  # [T, d]: one sequence
        if self.capacity_factor is None:
            ys, sizes, dropped = self._dropless(per_slot_in, routing.experts)
        else:
            experts = routing.experts.reshape(-1, sequence, self.spec.top_k)
            ys, sizes, dropped = self._with_capacity(per_slot_in, experts, self.capacity_factor)
        # Back to (token, slot) order, then a sum over the k slots: deterministic, unlike an
        # index_add of the sorted rows (atomics on GPU), so resumed runs repeat bitwise.
        per_slot = ys.reshape(*routing.experts.shape, -1)
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
            dropped=dropped,
        )
        return out.reshape(shape), stats

    def _dropless(self, per_slot_in: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(expert output per assignment [T*k, d], tokens per expert, dropped: 0): every
        assignment sorted by expert through one grouped GEMM (or the dispatcher)."""
        order, sizes = sort_by_expert(experts, self.spec.n_experts)
        xs = per_slot_in[order]
        ys = self.experts(xs, sizes) if self.dispatcher is None else self.dispatcher(xs, sizes, self.experts)
        dropped = torch.zeros((), dtype=torch.long, device=ys.device)
        return torch.empty_like(ys).index_copy(0, order, ys), sizes, dropped

    def _with_capacity(
        self, per_slot_in: torch.Tensor, experts: torch.Tensor, factor: float
    ) -> tuple[torch.Tensor, ...]:
        """(expert output per assignment [T*k, d], zero where dropped; tokens per expert;
        dropped count) under capacity ``factor`` for ``experts`` [B, S, k] (``capacity``)."""
        spec, dispatcher = self.spec, self.dispatcher
        c = expert_capacity(factor, experts.shape[1], spec.top_k, spec.n_experts)
        slots = capacity_slots(experts, spec.n_experts, c)
        if dispatcher is None:
            n, d = spec.n_experts, per_slot_in.shape[-1]

            def run(buffer: torch.Tensor) -> torch.Tensor:
                return self.experts.forward_batched(buffer.view(n, -1, d)).reshape(-1, d)

        else:

            def run(buffer: torch.Tensor) -> torch.Tensor:
                return dispatcher.exchange(buffer, self.experts)

        ys = routed_with_capacity(per_slot_in, slots, run)
        return ys, slots.tokens_per_expert, (~slots.keep).sum()


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
                    [
                        s.z_sum.float(),
                        # A fill on the device: new_tensor would copy a host scalar, which on
                        # CUDA waits for the stream (a synchronisation every MoE layer).
                        torch.full_like(s.z_sum, s.n_tokens, dtype=torch.float32),
                        s.dropped.to(s.z_sum.device, torch.float32),
                    ]
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
    capacity_factor: float | None = None,
) -> None:
    """Set the runtime knobs (not part of the spec) on every MoE block of ``model``: the
    routing mode and its seed, this rank's place among ``dp_size`` data-parallel ranks, the
    GEMM backend, MXFP8 and the capacity factor (``olmo_model.moe``'s rule; None: dropless). Call it before wrapping the model (DDP/FSDP2): random and
    uniform routing freeze the router (``requires_grad=False``; it gets no gradient), which
    DDP must know when it is built."""
    check_routing(routing)
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm='{gemm}' is unknown; use one of {', '.join(GEMM_BACKENDS)}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside the {dp_size} data-parallel ranks; pass 0 <= dp_rank < dp_size")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"moe.capacity_factor={capacity_factor} must be > 0; use null for dropless")
    for m in moe_modules(model):
        m.capacity_factor = capacity_factor
        m.routing, m.routing_seed, m.dp_rank, m.dp_size = routing, seed, dp_rank, dp_size
        m.router.weight.requires_grad_(routing == "learned")
        m.experts.gemm, m.experts.mxfp8 = gemm, mxfp8


def set_routing_step(model: nn.Module, step: int, micro_step: int = 0) -> None:
    """The optimizer step and accumulation micro-step whose micro-batch comes next (random
    routing's seed includes both)."""
    for m in moe_modules(model):
        m.routing_step, m.routing_micro_step = step, micro_step
