"""The routed experts of the torch MoE block as grouped GEMMs: rows sorted into consecutive
groups of one expert each (``grouped_matmul``, ``GroupedExperts.forward``), or the equal groups of
the capacity layout as batched matmuls (``GroupedExperts.forward_batched``).

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
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from olmo_model.moe import E4M3_MAX, MX_BLOCK

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

    def _operands(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, gate, up, down) in the dtype the GEMMs run in, MXFP8-rounded when ``mxfp8``."""
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
        return xs, gate, up, down

    def _hidden(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        h = F.silu(g) * u
        return _straight_through(h, mxfp8_quantize(h, -1)) if self.mxfp8 else h

    def forward(self, xs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """``xs`` [N, d] sorted by expert, ``group_sizes`` [n] -> SwiGLU outputs [N, d]."""
        xs, gate, up, down = self._operands(xs)
        g = grouped_matmul(xs, gate.transpose(1, 2), group_sizes, self.gemm)
        u = grouped_matmul(xs, up.transpose(1, 2), group_sizes, self.gemm)
        return grouped_matmul(self._hidden(g, u), down.transpose(1, 2), group_sizes, self.gemm)

    def forward_batched(self, xs: torch.Tensor) -> torch.Tensor:
        """``xs`` [n, rows, d], expert e's rows in ``xs[e]`` (equal groups: the capacity
        layout) -> SwiGLU outputs [n, rows, d]; three batched matmuls, no group sizes. Zero
        rows (empty capacity slots) give zero outputs."""
        xs, gate, up, down = self._operands(xs)
        h = self._hidden(torch.bmm(xs, gate.transpose(1, 2)), torch.bmm(xs, up.transpose(1, 2)))
        return torch.bmm(h, down.transpose(1, 2))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
