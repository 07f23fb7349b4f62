"""RoPE inverse frequencies, default and YaRN, for both trainers (the numpy reference in
``olmo_model.reference`` keeps its own float64 derivation to check them against)."""

from __future__ import annotations

import math

import numpy as np

from .spec import ModelSpec, YarnSpec


def rope_inv_freq(spec: ModelSpec, yarn: YarnSpec | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies (float32, [head_dim // 2]) and the cos/sin scale for one layer kind
    (``yarn``: ``spec.rope_yarn_of(layer)``).

    Follows transformers' default and ``_compute_yarn_parameters`` (modeling_rope_utils.py),
    with its float32 arithmetic and the floor/ceil truncation of the correction range: the
    frequencies rotating more than ``beta_fast`` times over the original context keep their
    value, those rotating fewer than ``beta_slow`` times are divided by ``factor``, with a
    linear ramp between; cos/sin are scaled by ``attention_factor`` or 0.1 ln(factor) + 1."""
    dim = spec.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # The power in float64, rounded once: torch's float32 pow gives exactly these values (and so
    # transformers' tables), numpy's float32 pow differs from them in the last bit.
    pos_freqs = (np.float64(spec.rope_theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv_freq, 1.0
    base, orig = spec.rope_theta, yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) - ramp  # 1: keep the original frequency (high-frequency dims)
    interpolated = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    inv_freq = (interpolated * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)
    if yarn.attention_factor is not None:
        scale = yarn.attention_factor
    else:
        scale = 0.1 * math.log(yarn.factor) + 1.0  # YaRN paper's sqrt(1/t), transformers' default
    return inv_freq, scale
