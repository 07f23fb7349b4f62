"""`olmo-plan`: a dry run of a recipe on a device layout, before any compute is booked.

    olmo-plan recipes/olmo3-7b/stage1.yaml --devices tpu7x:512 --devices tpu7x:128
    olmo-plan recipes/olmo3-7b/stage1.yaml --devices h100:512 --mfu 0.40 --json

COUNT is the number of devices as the framework sees them (JAX shows one tpu7x chip as 2
devices). For each layout: the derived per-device batch and accumulation (the global batch
never changes), memory per device, step time at a stated MFU, steps, tokens and device-hours.
A layout that cannot fit is refused with the knob to turn. With several layouts it also says
what changed from the first to each other one.

Memory model (per device, bytes):
- state: fp32 master weights (4) + fp32 gradients (4) + AdamW moments (8) per parameter,
  divided over the sharding group (JAX: fsdp x tensor axes, with data = -1 meaning pure FSDP
  when fsdp is -1; Torch: FSDP over the world, HSDP over world / replicate, DDP: none); with
  expert parallelism the routed experts' state is divided as the trainers place it instead
  (``_framework_layout``: JAX over expert x fsdp, the expert axis carrying data like ``data``;
  torch over ``torch.expert_parallel`` only, its experts never FSDP-sharded nor gathered);
- gathered weights: bf16 copies of two blocks (the one computing and the one prefetched; the
  experts of a block as ``plan_moe.gathered_block_params`` places them);
- activations per micro-batch, bf16, counted per tensor a block keeps for backward: torch layer
  by layer as autograd saves them (``plan_moe``: 10d + 6q + 6kv for attention and norms, 8d more
  with peri-norm, 4ff for a dense MLP, k (3d + 4h) + 4 h_shared + 2d + 4E for an MoE one, on the
  capacity buffer rho k (d + 4h) + kd for its routed part), with activation checkpointing the
  block inputs (d) plus the largest block recomputed; JAX (XLA's choice, fitted): no remat
  6d + 3q + 4kv + 4ff values per token per layer; "save_dots": only the matmul outputs
  (q + 2kv + 2d + 2ff); "block": only the block input (d), plus one block recomputed;
- head + loss (``memory_logits_gib``): both trainers run the output head and the loss fused over
  token chunks (``HEAD_CHUNK_BYTES`` of fp32 logits at a time), keeping until backward the input
  gradient (tokens x d_model, bf16) and the head's fp32 gradient (d_model x padded vocab x 4 bytes).
Torch with FSDP2/HSDP and activation checkpointing: the larger of the above and the state inside
the fused output head (``_torch_head_phase``), where ``olmo-train-torch --dry-run`` finds the peak
of the Olmo 3 recipes (within 5% of it on olmo3-7b h100:512, olmo3-32b h100:512 and h100:64).
JAX (TPU kinds, or ``--framework jax``): the fused step as XLA:TPU compiles it (``_jax_step``): the
sharded fp32 gradients (and accumulator) with the state, the output head's whole fp32 gradient with
its copies, and the blocked attention's fp32 scores (``JAX_ATTENTION_SCORES``); within 11% of the
compiler's peak (``olmo-train-jax --dry-run``) on olmo3-7b v5p:512 and v5p:128 and olmo3-32b
v5p:512 (on tpu7x:256 the compiler assigns olmo3-7b 1.5x this and olmo3-32b 1.2x, its heap
simulation within 10% of it: not refitted). On a GPU the step runs cuDNN's flash attention where it can (``jax_flash_attention``),
which keeps no scores: the same model without that term, within 9% of XLA:GPU's compile of the
olmo3-7b and olmo3-32b stage-1 recipes on h100:512 and h100:64.
Context parallelism (``jax.mesh.context`` / ``torch.context_parallel`` = C): one sequence is split
over C devices, so the data-parallel size is devices / C (x the other model axes), each device holds
S / C tokens of its rows (activations, head + loss), and the state is sharded as without it (the
JAX trainer keeps the context axis out of the parameter placement; torch's FSDP spans the world).
The attention is the JAX trainer's context kernel (``olmo_train_jax.context_parallel``): one query
block's fp32 scores at a time (``CONTEXT_SCORE_BYTES``, a few copies in the backward) instead of the
blocked kernel's S x S, plus the K/V exchange of one global layer (``KV_EXCHANGE_BYTES``: the
gathered bf16 K and V and their fp32 gradient accumulators over the whole sequence); sliding layers
move only the window's keys, a few MB. Those two terms are not yet fitted to a compile at 65,536
tokens (``olmo-train-jax --dry-run`` reports the compiler's figure beside this one).
It is an estimate (no allocator fragmentation, no compiler temporaries): keep 10% headroom.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from olmo_model.maths import (
    HEAD_CHUNK_BYTES,
    PEAKS,
    UnknownDeviceError,
    flops_per_token,
    param_counts,
    resolve_device_kind,
)
from olmo_model.spec import ModelSpec

from .plan_moe import gathered_block_params, jax_activation_bytes, routed_expert_params, torch_activation_bytes
from .recipe import BatchLayout, Recipe, RecipeError, batch_layout, load_recipe

GIB = 2**30
HEADROOM = 0.9  # plan to use at most 90% of HBM


@dataclass
class Plan:
    device_kind: str
    devices: int
    framework: str
    sequence_length: int
    global_batch: int
    global_batch_tokens: int
    dp_size: int
    context_degree: int  # devices one sequence is split over (1: no context parallelism)
    tokens_per_device: int  # tokens of one micro-batch per device: per-device batch x S / C
    shard_group: int
    per_device_batch: int
    accumulation_steps: int
    memory_state_gib: float
    memory_gathered_weights_gib: float
    memory_activations_gib: float
    memory_logits_gib: float
    memory_kv_exchange_gib: float  # context parallelism's gathered K/V (and gradients), one layer
    memory_total_gib: float
    hbm_gib: float
    fits: bool
    flops_per_token: float
    mfu: float
    step_time_s: float
    steps: int
    total_tokens: int
    device_hours: float
    days: float
    advice: str


# The TPU kinds of the peak table: olmo-plan plans them for the JAX trainer by default.
TPU_KINDS = ("v5p", "v6e", "tpu7x")


def _framework_layout(
    recipe: Recipe, kind: str, devices: int, framework: str | None = None
) -> tuple[str, int, int, int, str, int]:
    """(framework, data-parallel size, state sharding group, the routed experts' sharding group,
    remat, context degree) for a device layout; ``framework`` None: JAX on TPU kinds, torch on GPUs."""
    framework = framework or ("jax" if kind in TPU_KINDS else "torch")
    if framework not in ("jax", "torch"):
        raise RecipeError(f"framework '{framework}' is unknown; use jax or torch")
    if framework == "jax":
        mesh = dict(recipe.jax.mesh)
        tensor = mesh.get("tensor", 1)
        fixed = 1
        for axis, size in mesh.items():
            if size != -1:
                fixed *= size
        if devices % fixed:
            raise RecipeError(f"jax.mesh {mesh} needs a multiple of {fixed} devices, not {devices}; adjust jax.mesh")
        rest = devices // fixed
        sizes = {a: (rest if s == -1 else s) for a, s in mesh.items()}
        ep = sizes.get("expert", 1)
        dp = sizes.get("data", 1) * sizes.get("fsdp", 1) * ep  # the expert axis carries data too
        shard = sizes.get("fsdp", 1) * tensor
        if sizes.get("fsdp", 1) == 1 and sizes.get("data", 1) == devices:
            shard = 1  # pure data parallel: every device holds the whole state
        # Routed experts: split over expert and fsdp (no tensor split), the rest over fsdp x tensor.
        experts = ep * sizes.get("fsdp", 1) if ep > 1 else shard
        return "jax", dp, shard, experts, recipe.jax.remat, sizes.get("context", 1)
    t = recipe.torch
    remat = "block" if t.activation_checkpointing else "none"
    cp = t.context_parallel
    if devices % cp:
        raise RecipeError(f"torch.context_parallel={cp} does not divide {devices} devices; choose a divisor")
    if t.parallel == "fsdp":
        shard = devices
    elif t.parallel == "hsdp":
        if devices % t.replicate:
            raise RecipeError(f"torch.replicate={t.replicate} does not divide {devices} devices")
        shard = devices // t.replicate
    else:
        shard = 1
    # Expert parallelism: each rank keeps E / EP experts, outside the FSDP / HSDP / DDP wrapper.
    experts = t.expert_parallel if t.expert_parallel > 1 else shard
    return "torch", devices // cp, shard, experts, remat, cp


def _torch_head_phase(spec: ModelSpec, n_local: float, accumulation: int, tokens: int) -> tuple[float, int, int, int]:
    """(state, gathered weights, activations, head + loss) bytes per device inside the torch
    trainer's fused output head, where its dry run (``olmo-train-torch --dry-run``: FSDP2 with
    activation checkpointing) finds the peak: fp32 master weights and AdamW moments, plus the
    sharded gradients of earlier accumulation micro-steps; the head's FSDP2 unit gathered in bf16
    twice (the parameter and the all-gather buffer FSDP2 holds until its next all-gather); every
    block's checkpointed input; the head's fp32 gradient with a chunk's bf16 g^T x and its fp32
    copy (d_model x padded vocab each), a chunk of fp32 logits and its two bf16 copies, the
    head's input and its gradient (bf16). ``n_local``: the parameters this device holds."""
    d, v = spec.d_model, spec.padded_vocab_size
    state = n_local * (12 + (4 if accumulation > 1 else 0))
    gathered = 2 * d * v * 2
    acts = tokens * d * 2 * spec.n_layers
    head = d * v * (4 + 2 + 4) + 2 * min(tokens * v * 4, HEAD_CHUNK_BYTES) + 2 * tokens * d * 2
    return state, gathered, acts, head


# The blocked attention (olmo_train_jax.causal_attention) unrolls its query blocks, and XLA:TPU
# keeps the fp32 scores of all of a layer's blocks live together, with their probabilities and
# gradients in the backward: this many times one row's S x S fp32 scores per head, fitted to the
# compiler's temporaries (olmo-train-jax --dry-run: olmo3-190m/1b-width/7b/32b at 8192 tokens).
JAX_ATTENTION_SCORES = 1.5


# The JAX context kernel's fp32 scores of one query block (olmo_train_jax.context_parallel
# CONTEXT_BLOCK_BYTES), of which the backward holds the scores, the probabilities and their gradient.
CONTEXT_SCORE_BYTES = 3 * 256 * 2**20
# Bytes per key and kv_width element of one global layer's K/V exchange under context parallelism:
# the gathered K and V in bf16 (2 x 2), their fp32 gradient accumulators over the early half and
# the whole sequence (1.5 x 2 x 4) and the early half's copies (0.5 x 2 x 2).
KV_EXCHANGE_BYTES = 18


def _context_terms(spec: ModelSpec, rows: int, seq: int, cp: int) -> tuple[float, float]:
    """(attention scores, K/V exchange) bytes per device of the JAX context kernel."""
    if cp == 1:
        return 0.0, 0.0
    return float(CONTEXT_SCORE_BYTES), float(KV_EXCHANGE_BYTES * rows * seq * spec.kv_width)


def jax_flash_attention(recipe: Recipe, spec: ModelSpec) -> bool:
    """Whether the JAX step on a GPU runs cuDNN's fused (flash) attention, which keeps no S x S
    scores: the conditions of ``olmo_train_jax.causal_attention.attention`` (``jax.attention`` auto or
    cudnn, bf16, no document mask, head_dim a multiple of 8 up to 256)."""
    return (
        recipe.jax.attention != "xla"
        and recipe.train.precision == "bf16"
        and not recipe.train.document_masking
        and spec.head_dim % 8 == 0
        and spec.head_dim <= 256
    )


def _jax_step(
    spec: ModelSpec,
    n_local: float,
    accumulation: int,
    rows: int,
    seq: int,
    cp: int = 1,
    flash: bool = False,
) -> tuple[float, int, float]:
    """(state, head + loss, attention) bytes per device of the JAX trainer's fused step as XLA:TPU
    compiles it (``olmo-train-jax --dry-run``): fp32 weights, AdamW moments and fp32 gradients
    (and their accumulator with accumulation), sharded; the output head's whole fp32 gradient
    (reduced over the batch only after its last chunk), its bf16 copy and fp32 cast and the
    gathered bf16 head (12 bytes per d_model x padded vocab), a chunk of fp32 logits and the
    head's input gradient (bf16); the attention scores of ``rows`` rows of ``seq`` tokens (under
    context parallelism, ``cp`` > 1: S / cp tokens per row, the context kernel's block scores;
    ``flash``: none, cuDNN's fused attention on a GPU). ``n_local``: the parameters this device holds."""
    d, v = spec.d_model, spec.padded_vocab_size
    tokens = rows * seq // cp
    state = n_local * (16 + (4 if accumulation > 1 else 0))
    head = 12 * d * v + min(tokens * v * 4, HEAD_CHUNK_BYTES) + tokens * d * 2
    if cp > 1:
        attention = _context_terms(spec, rows, seq, cp)[0]
    elif flash:
        attention = 0.0
    else:
        attention = JAX_ATTENTION_SCORES * rows * spec.n_heads * seq * seq * 4
    return state, head, attention


def _memory_terms(
    recipe: Recipe,
    spec: ModelSpec,
    device_kind: str,
    framework: str,
    shard: int,
    expert_shard: int,
    remat: str,
    cp: int,
    layout: BatchLayout,
    seq: int,
    tokens_micro: int,
) -> tuple[float, float, float, float, float]:
    """(state, gathered weights, activations, head + loss, K/V exchange) bytes per device at the
    step's peak, for the trainer ``framework`` with ``tokens_micro`` tokens per device and
    micro-batch (module docstring)."""
    counts, routed = param_counts(spec), routed_expert_params(spec)
    n_local = (counts.total - routed) / shard + routed / expert_shard
    state = n_local * 16
    gathered = 2 * gathered_block_params(recipe, spec, framework) * 2 if shard > 1 else 0.0
    if framework == "torch":
        acts = torch_activation_bytes(recipe, spec, remat, tokens_micro, seq)
    else:
        acts = jax_activation_bytes(spec, remat, tokens_micro)
    logits = (
        min(tokens_micro * spec.padded_vocab_size * 4, HEAD_CHUNK_BYTES)
        + tokens_micro * spec.d_model * 2
        + spec.d_model * spec.padded_vocab_size * 4
    )
    if framework == "torch" and remat == "block" and shard > 1:
        head_phase = _torch_head_phase(spec, n_local, layout.accumulation_steps, tokens_micro)
        if sum(head_phase) > state + gathered + acts + logits:
            state, gathered, acts, logits = head_phase
    # The K/V of the whole sequence that one global layer gathers under context parallelism.
    exchange = _context_terms(spec, layout.per_device_batch, seq, cp)[1]
    if framework == "jax":
        flash = device_kind not in TPU_KINDS and jax_flash_attention(recipe, spec)
        state, logits, attention = _jax_step(
            spec, n_local, layout.accumulation_steps, layout.per_device_batch, seq, cp, flash
        )
        acts += attention
    return state, gathered, acts, logits, exchange


def _advice(framework: str, remat: str, layout: BatchLayout, shard: int, devices: int, cp: int) -> str:
    """What to change when the step does not fit: each knob that would lower the peak."""
    knobs = []
    if remat != "block":
        knobs.append("jax.remat=block" if framework == "jax" else "torch.activation_checkpointing=true")
    if layout.per_device_batch > 1:
        knobs.append(f"train.micro_batch_size={max(layout.per_device_batch // 2, 1)} (gradient accumulation)")
    if shard < devices:
        knobs.append("shard the state over more devices (jax.mesh fsdp=-1 / torch.parallel=fsdp)")
    if not knobs or layout.per_device_batch == 1:
        key = "jax.mesh.context" if framework == "jax" else "torch.context_parallel"
        knobs.append(f"split each sequence over more devices ({key}={2 * cp}, context parallelism)")
    return "does not fit: " + "; or ".join(knobs)


def make_plan(recipe: Recipe, device_kind: str, devices: int, mfu: float, framework: str | None = None) -> Plan:
    """The plan of ``recipe`` on ``devices`` of ``device_kind`` for ``framework`` (None: JAX on
    TPU kinds, torch on GPUs)."""
    spec = recipe.model_spec()
    peak = resolve_device_kind(device_kind)
    seq = recipe.train.sequence_length
    if seq is None:
        raise RecipeError("olmo-plan needs train.sequence_length in the recipe (the dry run reads no data)")
    framework, dp, shard, expert_shard, remat, cp = _framework_layout(recipe, peak.kind, devices, framework)
    if cp > 1 and seq % (2 * cp):
        raise RecipeError(
            f"context degree {cp} needs train.sequence_length={seq} to split into 2 x {cp} equal chunks; "
            "choose a degree whose double divides the sequence length"
        )
    global_batch = recipe.global_batch_sequences(seq)
    layout = batch_layout(global_batch, dp, recipe.train.micro_batch_size)
    tokens_micro = layout.per_device_batch * seq // cp
    state, gathered, acts, logits, exchange = _memory_terms(
        recipe, spec, peak.kind, framework, shard, expert_shard, remat, cp, layout, seq, tokens_micro
    )
    total = state + gathered + acts + logits + exchange
    hbm = peak.hbm_bytes
    fits = total <= HEADROOM * hbm
    advice = "" if fits else _advice(framework, remat, layout, shard, devices, cp)
    fpt = flops_per_token(spec, seq)
    step_time = fpt * recipe.train.global_batch_tokens / (mfu * peak.bf16_flops_per_device * devices)
    steps = recipe.total_steps()
    return Plan(
        device_kind=peak.kind,
        devices=devices,
        framework=framework,
        sequence_length=seq,
        global_batch=global_batch,
        global_batch_tokens=recipe.train.global_batch_tokens,
        dp_size=dp,
        context_degree=cp,
        tokens_per_device=tokens_micro,
        shard_group=shard,
        per_device_batch=layout.per_device_batch,
        accumulation_steps=layout.accumulation_steps,
        memory_state_gib=state / GIB,
        memory_gathered_weights_gib=gathered / GIB,
        memory_activations_gib=acts / GIB,
        memory_logits_gib=logits / GIB,
        memory_kv_exchange_gib=exchange / GIB,
        memory_total_gib=total / GIB,
        hbm_gib=hbm / GIB,
        fits=fits,
        flops_per_token=fpt,
        mfu=mfu,
        step_time_s=step_time,
        steps=steps,
        total_tokens=steps * recipe.train.global_batch_tokens,
        device_hours=step_time * steps * devices / 3600,
        days=step_time * steps / 86400,
        advice=advice,
    )


def _changes(a: Plan, b: Plan) -> list[str]:
    out = []
    for key in (
        "device_kind",
        "devices",
        "dp_size",
        "context_degree",
        "per_device_batch",
        "accumulation_steps",
        "shard_group",
    ):
        if getattr(a, key) != getattr(b, key):
            out.append(f"{key} {getattr(a, key)} -> {getattr(b, key)}")
    out.append(f"global batch kept: {b.global_batch} x {b.sequence_length} tokens")
    out.append(f"step time {a.step_time_s:.2f}s -> {b.step_time_s:.2f}s at MFU {b.mfu:.0%}")
    return out


def parse_devices(text: str) -> tuple[str, int]:
    kind, _, count = text.partition(":")
    if not count.isdigit() or int(count) <= 0:
        raise RecipeError(f"--devices '{text}': write KIND:COUNT, e.g. h100:512")
    return kind, int(count)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olmo-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument(
        "--devices",
        action="append",
        required=True,
        metavar="KIND:COUNT",
        help=f"repeatable; KIND is one of {', '.join(PEAKS)} (olmo_model.PEAKS: bf16 peak and HBM "
        "per device); olmo-plan takes no other peak, so another kind needs its entry added there",
    )
    parser.add_argument("--mfu", type=float, default=0.40, help="MFU assumed for step time (default 0.40)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--framework",
        choices=("jax", "torch"),
        default=None,
        help="trainer to plan for (default: JAX on TPUs, torch on GPUs)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        recipe = load_recipe(args.recipe, overrides)
        plans = [make_plan(recipe, *parse_devices(d), args.mfu, args.framework) for d in args.devices]
    except (RecipeError, UnknownDeviceError, ValueError) as err:
        print(f"olmo-plan: {err}", file=sys.stderr)
        return 2
    changes = [_changes(plans[0], p) for p in plans[1:]]
    if args.json:
        print(json.dumps({"plans": [asdict(p) for p in plans], "changes": changes}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"olmo-plan {args.recipe}: {recipe.model_spec().name or 'model'}")
        table.add_column("")
        for p in plans:
            table.add_column(f"{p.device_kind}:{p.devices}", justify="right")
        rows = [
            ("framework", lambda p: p.framework),
            ("global batch (seqs x len)", lambda p: f"{p.global_batch} x {p.sequence_length}"),
            ("data-parallel / shard group", lambda p: f"{p.dp_size} / {p.shard_group}"),
            ("context degree", lambda p: str(p.context_degree)),
            ("per-device batch", lambda p: str(p.per_device_batch)),
            ("tokens per device", lambda p: f"{p.tokens_per_device:,}"),
            ("accumulation steps", lambda p: str(p.accumulation_steps)),
            ("memory: state (GiB)", lambda p: f"{p.memory_state_gib:.1f}"),
            ("memory: activations (GiB)", lambda p: f"{p.memory_activations_gib:.1f}"),
            ("memory: head + loss (GiB)", lambda p: f"{p.memory_logits_gib:.1f}"),
            ("memory: K/V exchange (GiB)", lambda p: f"{p.memory_kv_exchange_gib:.1f}"),
            ("memory: total / HBM (GiB)", lambda p: f"{p.memory_total_gib:.1f} / {p.hbm_gib:.0f}"),
            ("fits", lambda p: "yes" if p.fits else "NO"),
            ("step time @ MFU", lambda p: f"{p.step_time_s:.2f}s @ {p.mfu:.0%}"),
            ("steps", lambda p: f"{p.steps:,}"),
            ("tokens", lambda p: f"{p.total_tokens:.3e}"),
            ("device-hours / days", lambda p: f"{p.device_hours:,.0f} / {p.days:.1f}"),
        ]
        for label, fn in rows:
            table.add_row(label, *[fn(p) for p in plans])
        console = Console()
        console.print(table)
        for p in plans:
            if not p.fits:
                console.print(f"[red]{p.device_kind}:{p.devices} {p.advice}[/red]")
        for p, ch in zip(plans[1:], changes):
            console.print(f"{plans[0].device_kind}:{plans[0].devices} -> {p.device_kind}:{p.devices}: " + "; ".join(ch))
    return 0 if all(p.fits for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
