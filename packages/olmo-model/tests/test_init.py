"""``olmo_model.init``: the framework-neutral initial weights, checked against the scheme as its
docstring states it, recomputed here from its parts (sha256, numpy's raw Philox words, Python's
``statistics.NormalDist``), and against the truncated normal's own moments."""

from __future__ import annotations

import hashlib
import math
import statistics

import numpy as np
import pytest

from olmo_model import get_preset, hf_param_shapes
from olmo_model.init import CHUNK, init_values, normal_quantile, parameter_key, truncated_normal

SPEC = get_preset("tiny")
EPS = np.finfo(np.float64).eps


def test_quantile_matches_python_statistics():
    # Both are AS241: the same rational functions, so they differ only where numpy's log/sqrt and
    # the C library's round differently (an ulp), which the polynomials carry through a few
    # operations: 8 ulps of the result bounds it (measured: 2 ulps).
    p = np.concatenate(
        [np.linspace(1e-6, 1 - 1e-6, 20_001), np.geomspace(1e-300, 1e-3, 2_000), 1.0 - np.geomspace(1e-15, 1e-3, 2_000)]
    )
    ours = normal_quantile(p)
    ref = np.array([statistics.NormalDist().inv_cdf(x) for x in p])
    assert np.all(np.abs(ours - ref) <= 8 * EPS * np.maximum(1.0, np.abs(ref)))
    # All three AS241 branches were taken: |q| <= 0.425, r <= 5 and the far tail r > 5.
    assert np.abs(p - 0.5).min() < 0.425 < np.abs(p - 0.5).max()
    assert math.sqrt(-math.log(p.min())) > 5.0


def test_truncated_normal_stays_in_bounds_and_ends_at_the_cutoff():
    u = np.array([0.0, 0.5, 1.0 - 2.0**-53])
    z = truncated_normal(u, 2.5)
    # u = 0 is p = Phi(-2.5): -2.5 up to erfc's and AS241's last bits, times 1 / phi(2.5) = 57.
    assert z[0] == pytest.approx(-2.5, abs=1e-12) and z[1] == pytest.approx(0.0, abs=1e-15)
    # The largest u is 2^-53 below 1: p sits 2^-53 * (1 - 2 Phi(-2.5)) below Phi(2.5), 1e-14 in z.
    assert z[2] == pytest.approx(2.5, abs=1e-12)
    assert np.all(np.abs(truncated_normal(np.random.default_rng(0).random(100_000), 2.5)) <= 2.5)


def _reference(name: str, seed: int) -> np.ndarray:
    """The docstring's scheme, element by element: sha256 key, raw Philox words, inverse CDF."""
    shape = hf_param_shapes(SPEC)[name]
    key = int.from_bytes(hashlib.sha256(f"olmo-init/{seed}/{name}".encode()).digest()[:16], "little")
    words = np.random.Philox(key=key).random_raw(math.prod(shape))
    c = SPEC.init_cutoff
    normal = statistics.NormalDist()
    lo, hi = normal.cdf(-c), normal.cdf(c)
    out = []
    for w in words.tolist():
        u = (w >> 11) * 2.0**-53
        z = min(max(normal.inv_cdf(lo + u * (hi - lo)), -c), c)
        out.append(SPEC.init_std * z)
    return np.array(out, np.float32).reshape(shape)


def test_values_follow_the_documented_scheme():
    name = "model.layers.2.self_attn.k_proj.weight"  # 64 x 64
    assert parameter_key(5, name) == int.from_bytes(
        hashlib.sha256(f"olmo-init/5/{name}".encode()).digest()[:16], "little"
    )
    got = init_values(SPEC, 5, name)
    assert got.dtype == np.float32 and got.shape == (64, 64)
    # Equal as float32: the float64 quantiles agree to a few ulps (test above), and a float32
    # rounding boundary falls within a few float64 ulps of a value with probability ~2^-27.
    assert np.array_equal(got, _reference(name, 5))
    assert np.array_equal(
        init_values(SPEC, 0, "model.layers.2.post_attention_layernorm.weight"), np.ones(64, np.float32)
    )


@pytest.mark.parametrize(
    "region",
    [
        (slice(0, 4096), slice(0, 64)),
        (slice(1000, 1003), slice(0, 64)),  # whole rows: one run
        (slice(3, 4000), slice(5, 6)),  # one column: a run per row
        (slice(17, 2100), slice(1, 63)),
        (slice(4095, 4096), slice(63, 64)),
        (slice(7, 7), slice(0, 64)),  # an empty shard (FSDP gives one to ranks past the rows)
        (slice(None), slice(None, 10)),
    ],
)
def test_any_block_is_the_same_block_of_the_full_tensor(region):
    name = "model.embed_tokens.weight"  # 4096 x 64: longer than one CHUNK, so draws span chunks
    assert math.prod(hf_param_shapes(SPEC)[name]) > 4 * CHUNK
    full = init_values(SPEC, 1, name)
    assert np.array_equal(init_values(SPEC, 1, name, region), full[region])


def test_moments_are_those_of_the_truncated_normal():
    full = init_values(SPEC, 2, "lm_head.weight").astype(np.float64)  # 262,144 values
    c = SPEC.init_cutoff
    phi = math.exp(-c * c / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(c / math.sqrt(2))
    std = SPEC.init_std * math.sqrt(1 - 2 * c * phi / mass)
    # Sampling error of n = 262,144 draws: std(mean) = std / sqrt(n), std(std) ~ std / sqrt(2n);
    # 5 of those is the bound.
    n = full.size
    assert abs(full.mean()) <= 5 * std / math.sqrt(n)
    assert abs(full.std() - std) <= 5 * std / math.sqrt(2 * n)
    assert np.abs(full).max() <= np.float32(c * SPEC.init_std)


def test_names_and_seeds_give_independent_values():
    a = init_values(SPEC, 0, "model.layers.0.self_attn.q_proj.weight")
    assert not np.array_equal(a, init_values(SPEC, 0, "model.layers.1.self_attn.q_proj.weight"))
    assert not np.array_equal(a, init_values(SPEC, 1, "model.layers.0.self_attn.q_proj.weight"))
    # Uncorrelated across names: |r| of 4096 pairs stays within 5 / sqrt(4096).
    b = init_values(SPEC, 0, "model.layers.0.self_attn.k_proj.weight")
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 5 / 64


def test_bad_requests_name_the_fix():
    with pytest.raises(ValueError, match="not a parameter of spec 'tiny'; use a name from hf_param_shapes"):
        init_values(SPEC, 0, "model.embed.weight")
    with pytest.raises(ValueError, match="has 1 axes, the tensor"):
        init_values(SPEC, 0, "lm_head.weight", (slice(0, 2),))
    with pytest.raises(ValueError, match="0 <= start <= stop <= size"):
        init_values(SPEC, 0, "lm_head.weight", (slice(0, 5000), slice(0, 64)))
    with pytest.raises(ValueError, match="0 <= start <= stop <= size"):
        init_values(SPEC, 0, "lm_head.weight", (slice(0, 10, 2), slice(0, 64)))
