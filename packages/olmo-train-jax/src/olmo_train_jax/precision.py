"""Matmul precision for a compute dtype, shared by the model, the fused head loss and the
blocked attention: float32 compute is the parity mode, so its matmuls run as full float32 on
every backend (TPU/GPU would otherwise use bf16/tf32 passes); bf16 compute uses the default."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
