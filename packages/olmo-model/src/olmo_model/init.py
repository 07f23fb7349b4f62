"""Initial weights that depend on (seed, parameter name, element) only: the same full weights
for either trainer, any world size and any sharding.

Every parameter is named and shaped as in ``hf_param_shapes`` (transformers' Olmo3 names; linear
weights (out, in)); element ``i`` is the ``i``-th element in that tensor's row-major order:

- a vector (the norm weights; the model has no biases) is ones;
- a matrix (every linear, the embedding, the output head, the MoE router and experts) holds
  ``float32(std * z_i)``, ``z_i`` the standard normal truncated at ``+-cutoff``
  (``spec.init_std``, ``spec.init_cutoff``) by inversion: ``z_i = Phi^-1(Phi(-cutoff) + u_i
  (Phi(cutoff) - Phi(-cutoff)))``, with ``u_i = (w_i >> 11) * 2^-53`` and ``w_i`` the ``i``-th
  64-bit word of Philox4x64-10 (numpy's ``Philox``: counter from 0, word ``i`` is word ``i % 4``
  of counter ``i // 4``) keyed by the first 16 bytes (little-endian) of
  ``sha256("olmo-init/{seed}/{name}")``. ``Phi^-1`` is Wichura's AS241 (error ~1e-16, as
  Python's ``statistics.NormalDist.inv_cdf``).

Inversion needs one uniform per element (no rejection loop), and a counter-based generator jumps
to any element in O(1) (``Philox.advance``), so a rank computes exactly the elements of its shard
(``init_values(..., region=...)``), at the same cost per element as a full draw, and the shards of
any layout put together are the full tensor bit for bit. The values are computed in float64 by
numpy on the host: IEEE arithmetic in a fixed order, the same bits in every process of a job
(``log``/``sqrt`` of another libm could move a float64 by an ulp, which the float32 result
almost never shows). Generating on an accelerator would not give the same bits across frameworks
(XLA fuses multiply-adds), so both trainers call this module and copy the result to the device.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np

from .hf import hf_param_shapes
from .spec import ModelSpec

# Elements per numpy call: the float64 temporaries (128 KiB each) stay in the CPU cache.
CHUNK = 1 << 14

Region = tuple[slice, ...]

# Wichura (1988), Algorithm AS241 (PPND16), Applied Statistics 37(3): 477-484; highest power first.
_CENTRAL_NUM = (
    2.5090809287301226727e3,
    3.3430575583588128105e4,
    6.7265770927008700853e4,
    4.5921953931549871457e4,
    1.3731693765509461125e4,
    1.9715909503065514427e3,
    1.3314166789178437745e2,
    3.3871328727963666080e0,
)
_CENTRAL_DEN = (
    5.2264952788528545610e3,
    2.8729085735721942674e4,
    3.9307895800092710610e4,
    2.1213794301586595867e4,
    5.3941960214247511077e3,
    6.8718700749205790830e2,
    4.2313330701600911252e1,
    1.0,
)
_NEAR_NUM = (
    7.7454501427834140764e-4,
    2.2723844989269184583e-2,
    2.4178072517745061177e-1,
    1.2704582524523683826e0,
    3.6478483247632045605e0,
    5.7694972214606914055e0,
    4.6303378461565452959e0,
    1.4234371107496835773e0,
)
_NEAR_DEN = (
    1.0507500716444168432e-9,
    5.4759380849953449460e-4,
    1.5198666563616457197e-2,
    1.4810397642748007459e-1,
    6.8976733498510000455e-1,
    1.6763848301838038494e0,
    2.0531916266377588219e0,
    1.0,
)
_FAR_NUM = (
    2.0103343992922881327e-7,
    2.7115555687434875782e-5,
    1.2426609473880784386e-3,
    2.6532189526576123093e-2,
    2.9656057182850489123e-1,
    1.7848265399172913358e0,
    5.4637849111641143699e0,
    6.6579046435011037772e0,
)
_FAR_DEN = (
    2.0442631033899397856e-15,
    1.4215117583164458887e-7,
    1.8463183175100546818e-5,
    7.8686913114561325910e-4,
    1.4875361290850614852e-2,
    1.3692988092273580531e-1,
    5.9983220655588793769e-1,
    1.0,
)


def _horner(coefs: tuple[float, ...], r: np.ndarray) -> np.ndarray:
    out = np.multiply(r, coefs[0])
    out += coefs[1]
    for c in coefs[2:]:
        out *= r
        out += c
    return out


def normal_quantile(p: np.ndarray) -> np.ndarray:
    """``Phi^-1(p)`` for float64 ``p`` in (0, 1), elementwise (AS241, as ``statistics.NormalDist``)."""
    q = p - 0.5
    # The central formula on every element (cheaper than selecting them), then the tails redone.
    r = 0.180625 - q * q
    z = _horner(_CENTRAL_NUM, r)
    z *= q
    z /= _horner(_CENTRAL_DEN, r)
    tails = np.flatnonzero(np.abs(q) > 0.425)
    if tails.size:
        qt, pt = q[tails], p[tails]
        r = np.sqrt(-np.log(np.where(qt <= 0.0, pt, 1.0 - pt)))
        near = r <= 5.0
        x = np.empty_like(r)
        rn, rf = r[near] - 1.6, r[~near] - 5.0
        x[near] = _horner(_NEAR_NUM, rn) / _horner(_NEAR_DEN, rn)
        x[~near] = _horner(_FAR_NUM, rf) / _horner(_FAR_DEN, rf)
        z[tails] = np.where(qt < 0.0, -x, x)
    return z


def truncated_normal(u: np.ndarray, cutoff: float) -> np.ndarray:
    """Standard normal values truncated to [-cutoff, cutoff] from uniforms ``u`` in [0, 1), by
    inversion of the CDF (float64)."""
    lo = 0.5 * math.erfc(cutoff / math.sqrt(2.0))  # Phi(-cutoff)
    z = normal_quantile(lo + u * (1.0 - 2.0 * lo))
    # The quantile of p = Phi(-cutoff) is -cutoff up to the approximation's last bits: clip so the
    # stated bound holds exactly.
    return np.clip(z, -cutoff, cutoff, out=z)


def parameter_key(seed: int, name: str) -> int:
    """The 128-bit Philox key of parameter ``name`` for ``seed``."""
    return int.from_bytes(hashlib.sha256(f"olmo-init/{seed}/{name}".encode()).digest()[:16], "little")


def _stream_at(key: int, start: int) -> np.random.Generator:
    """The uniforms of stream ``key`` from ``u_start`` on (``Generator.random`` is Philox's
    next_double: (word >> 11) * 2^-53)."""
    bits = np.random.Philox(key=key)
    bits.advance(start // 4)  # one Philox counter step yields four 64-bit words
    stream = np.random.Generator(bits)
    stream.random(start % 4)
    return stream


def _runs(shape: tuple[int, ...], region: Region) -> tuple[list[int], int]:
    """The region as runs of consecutive flat indices: (the start of each run, run length)."""
    bounds = [s.indices(n)[:2] for s, n in zip(region, shape)]
    # Trailing axes covered in full merge into the run; the first partial axis from the end ends it.
    run, split = 1, len(shape)
    while split > 0:
        lo, hi = bounds[split - 1]
        run *= hi - lo
        split -= 1
        if (lo, hi) != (0, shape[split]):
            break
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    starts = [
        sum(i * st for i, st in zip(index, strides)) + bounds[split][0] * strides[split]
        for index in itertools.product(*(range(lo, hi) for lo, hi in bounds[:split]))
    ]
    return starts, run


def _check_region(name: str, shape: tuple[int, ...], region: Region | None) -> Region:
    if region is None:
        return tuple(slice(0, n) for n in shape)
    if len(region) != len(shape):
        raise ValueError(f"init region for '{name}' has {len(region)} axes, the tensor {shape} has {len(shape)}")
    for s, n in zip(region, shape):
        if s.step not in (None, 1) or not (0 <= (s.start or 0) <= (n if s.stop is None else s.stop) <= n):
            raise ValueError(
                f"init region {region} of '{name}' is not a block of {shape}; pass slices with 0 <= start <= stop <= size"
            )
    return region


def init_values(spec: ModelSpec, seed: int, name: str, region: Region | None = None) -> np.ndarray:
    """Float32 initial values of HF-named parameter ``name`` of ``spec`` for ``seed``: the whole
    tensor, or the block ``region`` (one slice per axis) of it, computed without the rest."""
    shapes = hf_param_shapes(spec)
    if name not in shapes:
        raise ValueError(f"'{name}' is not a parameter of spec '{spec.name}'; use a name from hf_param_shapes(spec)")
    shape = shapes[name]
    region = _check_region(name, shape, region)
    block = tuple(s.indices(n)[1] - s.indices(n)[0] for s, n in zip(region, shape))
    if len(shape) == 1:
        return np.ones(block, np.float32)
    out = np.empty(math.prod(block), np.float32)
    key = parameter_key(seed, name)
    starts, run = _runs(shape, region)
    pos = 0
    for start in starts:
        stream = _stream_at(key, start)
        for offset in range(0, run, CHUNK):
            n = min(CHUNK, run - offset)
            z = truncated_normal(stream.random(n), spec.init_cutoff)
            z *= spec.init_std
            out[pos : pos + n] = z
            pos += n
    return out.reshape(block)
