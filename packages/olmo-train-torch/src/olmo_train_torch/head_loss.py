"""Output head + cross-entropy + z-loss over token chunks, with the gradient computed in the
forward pass (the JAX trainer's ``olmo_train_jax.head_loss`` is the same algorithm, except
that it never forms g: it scales the matmuls' thin operands instead, since XLA cannot rescale
the chunk in place as ``mul_`` does here).

The plain path keeps the logits of every token ([tokens, padded_vocab] float32: 1.6 GB for 4096
tokens of the 100k Olmo 3 vocabulary), then log-softmax, its gradient and the gradient of the
logits are as large again. Here one chunk of tokens at a time:

    logits = x_c @ W^T (float32)  ->  lse, CE and z-loss sums of the chunk
    g = softmax * (1 + 2 z_weight lse) - onehot(label)     (d(ce + z_weight z) / d logits)
    dx_c = g @ W,  dW += g^T @ x_c

in place in the chunk's logits buffer (one chunk alive at a time). ``backward`` multiplies the saved
dx and dW by the incoming gradient of the objective. A step still does exactly the three head
matmuls (no recomputation), so model FLOPs are unchanged. Without gradients (evaluation), only
the sums are computed.
"""

from __future__ import annotations

import torch

from olmo_data.order import IGNORE_INDEX  # the loader's label for "no next token"
from olmo_model.maths import HEAD_CHUNK_BYTES

# One chunk's float32 logits stay near this many bytes (shared with olmo-plan's memory model).
CHUNK_BYTES = HEAD_CHUNK_BYTES


def head_chunk(n_tokens: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, min(n_tokens, chunk_bytes // (4 * vocab)))


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, z_weight: float, chunk: int):
        # x [N, d] and weight [V, d] arrive in the compute dtype; logits maths in float32.
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n, _ = x.shape
        ce = torch.zeros((), dtype=torch.float32, device=x.device)
        z = torch.zeros((), dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if need_grad else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_grad else None
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, n, chunk):
                x_c = x[start : start + chunk]
                lab = labels[start : start + chunk]
                valid = lab != IGNORE_INDEX
                safe = lab.clamp_min(0).unsqueeze(-1)
                logits = (x_c @ weight.t()).float()
                m = logits.amax(dim=-1, keepdim=True)
                target = logits.gather(-1, safe).squeeze(-1)
                logits.sub_(m).exp_()  # e = exp(logits - max), in place
                s = logits.sum(dim=-1)
                lse = s.log() + m.squeeze(-1)
                ce += torch.where(valid, lse - target, 0.0).sum()
                z += torch.where(valid, lse * lse, 0.0).sum()
                if not need_grad:
                    continue
                assert dx is not None and dw is not None  # allocated when need_grad
                scale = torch.where(valid, (1.0 + 2.0 * z_weight * lse) / s, 0.0)
                g = logits.mul_(scale.unsqueeze(-1))
                g.scatter_add_(-1, safe, -valid.to(g.dtype).unsqueeze(-1))
                g = g.to(x.dtype)
                torch.matmul(g, weight, out=dx[start : start + chunk])
                if dw.dtype == g.dtype:
                    dw.addmm_(g.t(), x_c)
                else:
                    dw += (g.t() @ x_c).float()
        if need_grad:
            ctx.save_for_backward(dx, dw)
            ctx.weight_dtype = weight.dtype
        objective = ce + z_weight * z
        return objective, ce, z

    @staticmethod
    def backward(ctx, grad_objective, _grad_ce, _grad_z):
        # ce and z are reported sums (head_loss_sums detaches them); only the objective has a
        # gradient, and d objective / d (x, W) was computed in forward.
        dx, dw = ctx.saved_tensors
        g = grad_objective.to(torch.float32)
        return dx * g.to(dx.dtype), (dw * g).to(ctx.weight_dtype), None, None, None


def head_loss_sums(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_weight: float, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce + z_weight * z, ce, z): sums over labels != -100 in float32, of the head ``weight``
    [V, d] applied to final hidden states ``h`` [..., d]; only the first is differentiable.

    Under autocast the head runs in the autocast dtype (as ``nn.Linear`` would)."""
    device_type = h.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
    x = h.reshape(-1, h.shape[-1]).to(dtype)
    w = weight.to(dtype)
    labels = labels.reshape(-1)
    if chunk is None:
        chunk = head_chunk(x.shape[0], w.shape[0])
    objective, ce, z = _HeadLoss.apply(x, w, labels, float(z_weight), int(chunk))
    return objective, ce.detach(), z.detach()
