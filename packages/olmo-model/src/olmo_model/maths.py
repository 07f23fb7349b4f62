"""Framework-neutral maths: parameter counts, training FLOPs per token, MFU, memory.

FLOPs count what the matmuls compute (2 FLOPs per multiply-add; backward = 2x forward):
- every weight matmul: 6 x its parameter count per token (embedding lookups excluded,
  the output head included);
- attention scores and the weighted sum: 2 x 2 x head_dim x n_heads x (keys seen) per query
  forward, so 12 x head_dim x n_heads x keys for training. A causal query at position p
  sees p+1 keys; a sliding one sees min(p+1, window). Averaged over a sequence of length S.
- MoE: the router matmul and only the top-k routed experts a token visits (plus shared).
RMSNorm, RoPE, softmax and the loss are not matmuls and are left out, as in PaLM's MFU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .spec import SLIDING, ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter stored
    non_embedding: int  # total minus the input embedding and the output head
    active: int  # parameters a token uses (MoE: top-k experts only); dense: = total
    embedding: int  # input embedding + output head


def _attn_params(spec: ModelSpec) -> int:
    d = spec.d_model
    proj = d * spec.q_width + 2 * d * spec.kv_width + spec.q_width * d
    if spec.qk_norm == "full":
        norms = spec.q_width + spec.kv_width
    elif spec.qk_norm == "per_head":
        norms = 2 * spec.head_dim
    else:
        norms = 0
    return proj + norms


def _ffn_params(spec: ModelSpec, layer: int) -> tuple[int, int]:
    """(stored, active) feed-forward parameters of one layer."""
    d = spec.d_model
    if not spec.is_moe_layer(layer):
        p = 3 * d * spec.mlp_hidden
        return p, p
    moe = spec.moe
    assert moe is not None
    router = d * moe.n_experts
    expert = 3 * d * moe.expert_hidden
    shared = moe.n_shared_experts * 3 * d * moe.shared_hidden
    return router + moe.n_experts * expert + shared, router + moe.top_k * expert + shared


def param_counts(spec: ModelSpec) -> ParamCounts:
    d = spec.d_model
    embedding = 2 * spec.padded_vocab_size * d  # untied embedding + lm_head
    norms = d * (2 if spec.embedding_norm else 1)  # final norm (+ the embedding norm)
    total = embedding + norms
    active = embedding + norms
    sublayer_norms = 4 if spec.norm_placement == "peri" else 2  # peri-norm: an input and an output norm each
    for i in range(spec.n_layers):
        stored, act = _ffn_params(spec, i)
        block = _attn_params(spec) + sublayer_norms * d
        total += block + stored
        active += block + act
    return ParamCounts(total=total, non_embedding=total - embedding, active=active, embedding=embedding)


def mean_keys_per_query(seq_len: int, window: int | None) -> float:
    """Average keys a causal query attends to over positions 0..seq_len-1."""
    s = seq_len
    if window is None or window >= s:
        return (s + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (s - w) * w) / s


def matmul_params_per_token(spec: ModelSpec) -> int:
    """Weights a token multiplies through (embedding lookup excluded, head included)."""
    d = spec.d_model
    n = spec.padded_vocab_size * d  # output head
    for i in range(spec.n_layers):
        n += d * spec.q_width + 2 * d * spec.kv_width + spec.q_width * d
        n += _ffn_params(spec, i)[1]
    return n


def attention_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs of QK^T and AV per token, averaged over a sequence of seq_len."""
    total = 0.0
    for i in range(spec.n_layers):
        keys = mean_keys_per_query(seq_len, spec.window_of(i))
        total += 12 * spec.n_heads * spec.head_dim * keys
    return total


def flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at a sequence length."""
    return 6 * matmul_params_per_token(spec) + attention_flops_per_token(spec, seq_len)


# ---- peak table and MFU ---------------------------------------------------------------


@dataclass(frozen=True)
class DevicePeak:
    kind: str
    bf16_flops_per_chip: float
    devices_per_chip: int = 1  # JAX shows tpu7x (Ironwood) as 2 devices per chip
    hbm_bytes: float = 0.0

    @property
    def bf16_flops_per_device(self) -> float:
        return self.bf16_flops_per_chip / self.devices_per_chip


# bf16 dense peaks (docs/design.md). HBM per device for the planner and the dry runs; for the H100
# and H200 the total nvidia-smi reports (81559 MiB for the H100 80GB HBM3; 143771 MiB on the H200
# this project was lent, tools/bench/gpu/results/h200-run1-env.txt: the datasheet's "141 GB" is GiB).
# B200 and B300: NVIDIA's HGX B200 / HGX B300 datasheets give 36 PFLOPS of FP16/BF16 and 72 of FP8
# per 8-GPU board, both "with sparsity"; dense is half, 2250 TFLOP/s bf16 (and 4500 fp8, which this
# table has no column for) per GPU, the bf16 figure OLMo-core 3's report divides by for B300 MFU.
# Their HBM is nvidia-smi's total: 183359 MiB on a B200 (the datasheet's "180 GB" per GPU, 1.44 TB
# per board, is this in GiB), 275040 MiB on a "B300 SXM6 AC" (288 GB, the datasheet's per-GPU figure).
# GB200 / GB300 (Grace superchips, NVL72, 4 GPUs per compute tray) are not B200 / B300 at another
# count per host: their NVL72 datasheets give 360 PFLOPS sparse bf16 per 72 GPUs, 2.5 PFLOP/s dense
# each (GB200 also 186 GB of HBM, not 180), so they have no entry here.
PEAKS: dict[str, DevicePeak] = {
    "h100": DevicePeak("h100", 989e12, hbm_bytes=81559 * 2**20),
    "h200": DevicePeak("h200", 989e12, hbm_bytes=143771 * 2**20),
    "b200": DevicePeak("b200", 2250e12, hbm_bytes=183359 * 2**20),
    "b300": DevicePeak("b300", 2250e12, hbm_bytes=275040 * 2**20),
    "a100": DevicePeak("a100", 312e12, hbm_bytes=80 * 2**30),
    "v5p": DevicePeak("v5p", 459e12, hbm_bytes=95 * 2**30),
    "v6e": DevicePeak("v6e", 918e12, hbm_bytes=32 * 2**30),
    "tpu7x": DevicePeak("tpu7x", 2307e12, devices_per_chip=2, hbm_bytes=96 * 2**30),
}

# Strings JAX (device_kind) and torch (get_device_name) report, mapped to table keys.
_ALIASES: list[tuple[str, str]] = [
    (r"h100", "h100"),
    (r"h200", "h200"),
    # Not "NVIDIA GB200" / "GB300": those have other peaks (above).
    (r"(?<!g)b200", "b200"),
    (r"(?<!g)b300", "b300"),
    (r"a100", "a100"),
    # JAX calls v5p "TPU v5" (and v5e "TPU v5 lite", which has no entry here).
    (r"v5p|v5 ?p|^tpu v5$", "v5p"),
    (r"v6e|v6 ?lite|trillium", "v6e"),
    (r"tpu ?7x|ironwood|tpu7", "tpu7x"),
]


class UnknownDeviceError(ValueError):
    pass


def resolve_device_kind(name: str) -> DevicePeak:
    """Map a device name ('NVIDIA H100 80GB HBM3', 'TPU v5p', 'h100') to its peak entry."""
    low = name.lower().strip()
    if low in PEAKS:
        return PEAKS[low]
    for pattern, key in _ALIASES:
        if re.search(pattern, low):
            return PEAKS[key]
    raise UnknownDeviceError(
        f"unknown device kind '{name}': no bf16 peak is known for it; "
        f"use one of {', '.join(PEAKS)}, or add its datasheet peak to olmo_model.PEAKS "
        "(from Python, mfu() also takes an explicit peak_flops_per_device)"
    )


def mfu(
    spec: ModelSpec,
    seq_len: int,
    tokens_per_second_per_device: float,
    device_kind: str | None = None,
    peak_flops_per_device: float | None = None,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak.

    Give either a device kind from the peak table or an explicit (e.g. measured) peak."""
    if peak_flops_per_device is None:
        if device_kind is None:
            raise ValueError("mfu needs device_kind or peak_flops_per_device")
        peak_flops_per_device = resolve_device_kind(device_kind).bf16_flops_per_device
    return flops_per_token(spec, seq_len) * tokens_per_second_per_device / peak_flops_per_device


# ---- memory ---------------------------------------------------------------------------

# Float32 logits per chunk of the trainers' fused output head + loss (olmo_train_jax.head_loss,
# olmo_train_torch.head_loss) and of olmo-plan's memory model. olmo3-30m on 2 CPU cores: 128 MiB
# 5.14 s, 256 MiB 5.04 s, 512 MiB 5.44 s, 1 GiB 5.62 s per JAX step (bench_train.py).
HEAD_CHUNK_BYTES = 256 * 2**20

_BYTES = {"float32": 4, "bfloat16": 2}


def training_state_bytes(spec: ModelSpec, param_dtype: str = "float32") -> dict[str, int]:
    """Bytes for weights, gradients and AdamW's two moments (moments kept in fp32)."""
    n = param_counts(spec).total
    b = _BYTES[param_dtype]
    return {"weights": n * b, "gradients": n * b, "adamw_state": n * 8, "total": n * (2 * b + 8)}


def describe(spec: ModelSpec, seq_len: int) -> dict:
    """The numbers `olmo-model describe` prints, as a JSON-ready dict."""
    counts = param_counts(spec)
    assert spec.layer_types is not None  # filled by ModelSpec._fill_layer_types
    n_sliding = sum(1 for t in spec.layer_types if t == SLIDING)
    return {
        "spec": spec.model_dump(mode="json"),
        "seq_len": seq_len,
        "params_total": counts.total,
        "params_non_embedding": counts.non_embedding,
        "params_active": counts.active,
        "params_embedding": counts.embedding,
        "flops_per_token": flops_per_token(spec, seq_len),
        "attention_flops_per_token": attention_flops_per_token(spec, seq_len),
        "layers_sliding": n_sliding,
        "layers_global": spec.n_layers - n_sliding,
        "memory_fp32": training_state_bytes(spec, "float32"),
        "memory_bf16_params_fp32_adam": training_state_bytes(spec, "bfloat16"),
    }


# ---- how closely two float32 runs can agree ---------------------------------------------------

FP32_UNIT_ROUNDOFF = 2.0**-24  # u: a rounded fp32 sum a + b is (a + b)(1 + d) with |d| <= u


def fp32_mean_tolerance(mean: float, count: int, *, both_fp32: bool = True, sigmas: float = 6.0) -> float:
    """How far a logged fp32 mean of ``count`` terms of typical size ``mean`` (a step's loss over
    its tokens) can move when only the summation order changes: the bound a cross-layout or
    cross-framework comparison of per-step losses must allow, since a mesh, a rank count or an
    accumulation split each reorder the sum.

    Summing n terms one after the other, the k-th addition rounds a partial sum S_k ~ k*|mean|
    with a relative error of at most u, taken as uniform in [-u, u] (variance (u*S_k)^2 / 3; an
    over-estimate, since the error is uniform over half an ulp and an ulp is u..2u of S_k;
    ``test_fp32_mean_tolerance_bounds_a_sequential_fp32_sum`` checks the simulated spread lies
    between 0.6 and 1 of this). The errors add up to a variance u^2 mean^2 n^3 / 9, so the mean's
    rounding error has standard deviation u * |mean| * sqrt(n) / 3. Sequential order is the worst
    one a backend realistically picks (pairwise and blocked sums round far less), so this bounds
    the other orders too. Two fp32 runs differ by sqrt(2) of that; a run against a float64
    reference by one of it. ``sigmas`` 6 puts a false alarm below one in 10^8 comparisons.
    Olmo-sized example: 1024 tokens at loss 8.3 give 4.5e-5 between two fp32 runs."""
    std = FP32_UNIT_ROUNDOFF * abs(mean) * count**0.5 / 3
    return sigmas * std * (2**0.5 if both_fp32 else 1.0)


# What two fp32 runs' logged losses may drift apart once their weights differ in the last bits:
# a measured envelope times a safety factor, not a derivation (layout_loss_tolerance says why).
LAYOUT_DRIFT_LOSS = 2.5e-4


def layout_loss_tolerance(loss: float, count: int, step: int, *, both_fp32: bool = True) -> float:
    """How far the logged loss of two fp32 training runs that differ only in layout (mesh, rank or
    process count, micro-batch split, context split, CPU code path) may part at the ``step``-th
    step they take from bitwise-equal weights: 1 for the first step from the same initial weights
    or the same checkpoint, 2 for the next, and so on. ``loss``: the step's loss (either run's);
    ``count``: the token losses its mean sums.

    Step 1: ``fp32_mean_tolerance(loss, count)``. The weights are equal, so the layouts differ only
    in the order of their fp32 sums; that function derives the bound for the loss mean.

    Steps 2 on: that plus LAYOUT_DRIFT_LOSS. From step 2 the weights themselves differ in their
    last bits (the gradients were summed in another order), and AdamW divides each gradient
    element by its own running RMS: where a gradient is near zero, a last-bit difference becomes
    an update difference of up to the learning rate, and on some trajectories these grow
    chaotically (one of 14 in
    packages/olmo-train-jax/bench/results/2026-12-02-layout-drift-moe-uniform-cpu.md parts from
    step 7 on, as much under a one-device micro-batch split as under expert parallelism).
    No rounding derivation bounds that, so LAYOUT_DRIFT_LOSS is an envelope of measurement times
    a safety factor, from the trainers' layout tests (fp32, lr 5e-4 to 3e-3, up to 20 steps,
    losses 7-8.4) on both CPU code paths: natively (AVX-512) and with the AVX2 kernels
    (``XLA_FLAGS=--xla_cpu_max_isa=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``)
    every test stays at or below 2.9e-5 (torch expert parallelism, AVX2, step 19; 4.8e-6 for
    every other test on either path), and CPUs without AVX-512 reported up to 4.4e-5 (tiny-moe
    expert parallelism, step 14; CI on an AMD EPYC: 3.6e-5 and 2.3e-5). 5 x 4.4e-5, rounded up, is
    2.5e-4. Every test's gap and margin on both paths:
    packages/olmo-train-jax/bench/results/2026-12-03-layout-bounds-cpu.md.

    Why that still catches a layout bug: a bug in what a layout computes shows at step 1, where
    the bound is the derived one (2.3e-5 to 4.5e-5 at 256 to 1024 tokens): simulated, a context-
    parallel halo one key short or long moves the step-1 loss by 1.9e-3 to 2.0e-3 (43-44x), a lost
    document mask by 2.8e-3 (63x), a wrong expert all-to-all return by 2.2e-3 (70x); a bug only in
    the backward (a doubled or lost expert gradient) shows from step 2, by 1e-3 or more at most
    steps (median 1.8e-3 to 3.0e-3, 6-11x the later bound). A test asserts every step, so one step
    past the bound fails it."""
    if step < 1:
        raise ValueError(f"layout_loss_tolerance: step={step}; the first step from equal weights is 1")
    bound = fp32_mean_tolerance(loss, count, both_fp32=both_fp32)
    return bound if step == 1 else bound + LAYOUT_DRIFT_LOSS
