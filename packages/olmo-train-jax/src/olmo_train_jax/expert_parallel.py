"""Expert parallelism for the JAX model: the routed experts split over an ``expert`` mesh axis.

Layout. Each MoE layer's E experts are split into contiguous blocks of E/ep over the
``expert`` axis (expert e lives on expert rank e // (E/ep)); the stacked expert weights
``layers.expert_{gate,up,down}_proj`` [L, E, ...] are sharded on their expert axis
(``expert_partition_spec``). The ``expert`` axis is also a data-parallel axis: tokens are
split over (data, fsdp, expert) and the dense parts (attention, router, shared experts)
stay data parallel; routing and the aux losses run in the jitted global view, so they see
the whole global micro-batch and do not depend on the device count.

One routed-expert call (``expert_parallel_experts``, under ``jax.shard_map``), per device:

1. sort its T*k (token, slot) assignments by expert; those for expert rank r are then a
   contiguous run;
2. dispatch: one ``jax.lax.all_to_all`` over ``expert`` sends each run to its rank, with the
   local expert id of every row;
3. the receiver sorts what it got by local expert and runs the grouped SwiGLU
   (``grouped_gemm.grouped_swiglu``: ``jax.lax.ragged_dot``, or one-expert tiles on CPU) over its
   E/ep experts;
4. combine: the reverse ``all_to_all`` returns the outputs to the token's device, which
   unsorts them and adds the k weighted outputs per token.

Dropless with static shapes: each device's send buffer holds, for every destination rank,
room for ALL of its T*k assignments (the worst case: every token of the device routed to
one rank), so no routing pattern can overflow it and no token is ever dropped. The price is
ep x the minimal all-to-all volume and receive memory (padding rows are zeros that the
grouped matmul skips: rows past the group sizes). ``jax.lax.ragged_all_to_all`` would send
only the real rows, but XLA:CPU does not implement it in jax 0.10 ("HLO opcode
ragged-all-to-all is not supported by XLA:CPU"); on GPU/TPU it is the next step.

With a capacity factor (the recipe's ``moe.capacity_factor``; ``capacity``) the worst case is
gone: each device's send buffer holds C rows per (expert, sequence), E x B x C rows in all
(expert-major, so device r's experts are one contiguous run of E/ep x B x C rows), and two
equal ``all_to_all``s move it there and back (``_ep_capacity``): about ``capacity_factor``
times the minimal volume (the B x S x k rows themselves), where the dropless buffer is ep
times it, and no ids travel (a row's place says its expert; empty rows are zeros). Measured
in the compiled HLO by ``tests/test_moe_capacity.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .capacity import routed_with_capacity
from .grouped_gemm import ExpertWeights, batched_swiglu, grouped_swiglu
from .model import OlmoModel
from .moe import ExpertsFn, combine, local_experts, sort_by_expert

EXPERT_AXIS = "expert"
# Mesh axes that split tokens; the expert axis is one of them (its ranks hold different
# tokens as well as different experts).
TOKEN_AXES = ("data", "fsdp", EXPERT_AXIS)
EXPERT_PARAMS = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")


def expert_partition_spec(path: tuple[str, ...], shape: tuple[int, ...]) -> P | None:
    """The placement of a stacked routed-expert weight [L, E, ...] (expert axis split over
    ``expert``), or None for every other parameter (the caller places it)."""
    if path[-1] not in EXPERT_PARAMS:
        return None
    return P(None, EXPERT_AXIS, *([None] * (len(shape) - 2)))


def _ep_local(
    x,
    experts,
    weights,
    w: ExpertWeights,
    *,
    ep: int,
    token_axes: tuple[str, ...],
    mxfp8: bool,
    device: jax.Device,
    gemm: str,
):
    """The per-device body of the expert-parallel routed experts (module docstring, 1-4)."""
    n_tokens, k = experts.shape
    d = x.shape[-1]
    local_experts_n = w.gate.shape[0]
    n_assign = n_tokens * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = sorted_experts // local_experts_n
    per_rank = jnp.bincount(dest, length=ep)
    position = jnp.arange(n_assign) - (jnp.cumsum(per_rank) - per_rank)[dest]
    # Row r*n_assign + i of the send buffer is the i-th assignment for expert rank r; the
    # id column carries its local expert, padding gets the id local_experts_n (sorted last).
    send = jnp.zeros((ep, n_assign, d), x.dtype).at[dest, position].set(x[order // k])
    send_ids = (
        jnp.full((ep, n_assign), local_experts_n, jnp.int32).at[dest, position].set(sorted_experts % local_experts_n)
    )
    recv = jax.lax.all_to_all(send.reshape(ep * n_assign, d), EXPERT_AXIS, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids.reshape(ep * n_assign), EXPERT_AXIS, 0, 0, tiled=True)

    recv_order, sizes = sort_by_expert(recv_ids, local_experts_n)
    computed = grouped_swiglu(recv[recv_order], w, sizes, mxfp8=mxfp8, gemm=gemm, device=device)
    outputs = jnp.zeros_like(computed).at[recv_order].set(computed)
    back = jax.lax.all_to_all(outputs, EXPERT_AXIS, 0, 0, tiled=True).reshape(ep, n_assign, d)

    ys = jnp.zeros((n_assign, d), x.dtype).at[order].set(back[dest, position])
    return combine(ys, weights), jax.lax.psum(jnp.sum(sizes), token_axes)


def _ep_capacity(
    x,
    experts,
    weights,
    w: ExpertWeights,
    *,
    ep: int,
    token_axes: tuple[str, ...],
    mxfp8: bool,
    sequence_length: int,
    capacity: float,
):
    """The per-device body with a capacity factor (module docstring): the static buffer out and
    back with equal all-to-alls, the local experts as one batched SwiGLU in between."""
    local = w.gate.shape[0]

    def run(buffer):
        d = buffer.shape[-1]
        received = jax.lax.all_to_all(buffer, EXPERT_AXIS, 0, 0, tiled=True)  # [source, local expert, B x C]
        by_expert = received.reshape(ep, local, -1, d).transpose(1, 0, 2, 3).reshape(local, -1, d)
        out = batched_swiglu(by_expert, w, mxfp8=mxfp8)
        by_source = out.reshape(local, ep, -1, d).transpose(1, 0, 2, 3).reshape(-1, d)
        return jax.lax.all_to_all(by_source, EXPERT_AXIS, 0, 0, tiled=True)

    ys, kept = routed_with_capacity(x, experts, local * ep, sequence_length, capacity, run)
    return combine(ys, weights), jax.lax.psum(kept, token_axes)


def expert_parallel_experts(
    mesh: Mesh, *, mxfp8: bool = False, gemm: str = "auto", capacity_factor: float | None = None
) -> ExpertsFn:
    """An ``ExpertsFn`` that runs the routed experts split over ``mesh``'s ``expert`` axis
    (``mxfp8``: the MXFP8 emulation of ``grouped_gemm.grouped_swiglu``; ``gemm``: its grouped GEMM;
    ``capacity_factor``: ``olmo_model.moe``'s capacity rule, None: dropless).
    Without one (or with size 1) there is no all-to-all: each device computes its own
    tokens with all experts, which is still what a data-parallel mesh wants, since the
    global-view ``local_experts`` would sort the tokens of every device together."""
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    # The grouped GEMM is chosen for the mesh's devices, which for an ahead-of-time compile
    # (dry_run) are a TPU or GPU target's, not this host's.
    device = mesh.devices.flat[0]
    token_axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
    token_shards = 1
    for a in token_axes:
        token_shards *= mesh.shape[a]
    tokens = P(token_axes)
    expert_split = P(EXPERT_AXIS) if EXPERT_AXIS in mesh.axis_names else P()

    def experts_fn(x, experts, weights, w: ExpertWeights, *, sequence_length: int | None = None):
        n_experts = w.gate.shape[0]
        if n_experts % ep:
            raise ValueError(
                f"moe.n_experts={n_experts} is not divisible by the expert mesh axis ({ep}); "
                "choose jax.mesh.expert among the divisors of n_experts"
            )
        if x.shape[0] % token_shards:
            raise ValueError(
                f"{x.shape[0]} tokens per micro-batch cannot be split over the {token_shards} devices of "
                f"mesh axes {token_axes}; make batch x sequence a multiple of {token_shards}"
            )
        seq = x.shape[0] if sequence_length is None else sequence_length
        body: Callable[..., Any]
        if ep == 1:
            body = functools.partial(
                _local_with_count,
                token_axes=token_axes,
                mxfp8=mxfp8,
                device=device,
                gemm=gemm,
                sequence_length=seq,
                capacity=capacity_factor,
            )
        elif capacity_factor is None:
            body = functools.partial(_ep_local, ep=ep, token_axes=token_axes, mxfp8=mxfp8, device=device, gemm=gemm)
        else:
            body = functools.partial(
                _ep_capacity, ep=ep, token_axes=token_axes, mxfp8=mxfp8, sequence_length=seq, capacity=capacity_factor
            )
        # ignore: the NamedTuple as a pytree of PartitionSpecs, mirroring the weights it shards.
        expert_w = ExpertWeights(expert_split, expert_split, expert_split)  # type: ignore[arg-type]
        return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, expert_w), out_specs=(tokens, P()))(
            x, experts, weights, w
        )

    return experts_fn


def _local_with_count(
    x,
    experts,
    weights,
    w: ExpertWeights,
    *,
    token_axes: tuple[str, ...],
    mxfp8: bool,
    device: jax.Device,
    gemm: str,
    sequence_length: int,
    capacity: float | None,
):
    out, computed = local_experts(
        x,
        experts,
        weights,
        w,
        sequence_length=sequence_length,
        capacity_factor=capacity,
        mxfp8=mxfp8,
        gemm=gemm,
        device=device,
    )
    return out, jax.lax.psum(computed, token_axes)


def apply_expert_parallel(
    model: OlmoModel, mesh: Mesh, *, mxfp8: bool = False, gemm: str = "auto", capacity_factor: float | None = None
) -> None:
    """Make ``model``'s MoE layers run their routed experts under ``mesh`` (over its expert
    axis when it has one; ``mxfp8``: emulated MXFP8 expert matmuls; ``gemm``: the grouped
    GEMM, ``grouped_gemm.grouped_swiglu``'s, the recipe's ``jax.moe_gemm``; ``capacity_factor``:
    the recipe's ``moe.capacity_factor``, None: dropless); call before ``nnx.split`` so the
    graphdef carries it."""
    if model.spec.moe is None:
        raise ValueError(f"spec '{model.spec.name}' has no moe section; expert parallelism needs an MoE spec")
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    if model.spec.moe.n_experts % ep:
        raise ValueError(
            f"moe.n_experts={model.spec.moe.n_experts} is not divisible by the expert mesh axis ({ep}); "
            "choose jax.mesh.expert among the divisors of n_experts"
        )
    if capacity_factor is not None and mesh.shape.get("context", 1) > 1:
        # A context-split sequence is stored in zigzag column order: its tail drop would
        # depend on the context degree, and its counts on other devices.
        raise ValueError(
            f"moe.capacity_factor={capacity_factor} with jax.mesh.context={mesh.shape['context']} is not supported; "
            "set moe.capacity_factor to null (dropless) or jax.mesh.context to 1"
        )
    model.experts_fn = expert_parallel_experts(mesh, mxfp8=mxfp8, gemm=gemm, capacity_factor=capacity_factor)
