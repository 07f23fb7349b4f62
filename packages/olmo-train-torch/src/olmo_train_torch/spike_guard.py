"""The spike guard on the device (``olmo_run.spike_guard.SpikeGuard``'s rule, OLMo-core's
SkipStepAdamW idea): whether a step's update is skipped is decided from a history kept in a
small float64 tensor, and the update is undone on the device where it is, so a step reads
nothing to the host; the driver replays the decisions on its own history when it reads.

The history is a shift register of the last ``window`` accepted steps' (loss, grad norm),
oldest first, the newest in the last row (rows before ``count`` are zeros): the same content
gives the same sums however the run was resumed. The threshold is mean + sigma x population
std in float64, as the reference; its sums run in another order than the reference's (which
adds in sequence), so a decision can differ from it only for a value within a few float64
roundings of the threshold.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from olmo_run.spike_guard import SpikeGuard


class DeviceSpikeGuard:
    """``guard``'s settings and history on ``device``; ``skip(loss, grad_norm)`` decides."""

    def __init__(self, guard: SpikeGuard, device: torch.device):
        self.enabled, self.sigma, self.min_history = guard.enabled, guard.sigma, guard.min_history
        self.window = guard.window
        known = list(zip(guard.losses, guard.norms))[-self.window :]
        rows = torch.zeros(self.window, 2, dtype=torch.float64)
        if known:  # once, at the run's start: the resumed history
            rows[self.window - len(known) :] = torch.tensor(known, dtype=torch.float64)
        self.history = rows.to(device)
        self.count = torch.full((), len(known), dtype=torch.int64, device=device)
        self.rows = torch.arange(self.window, device=device)

    def skip(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """A bool tensor, true where this step's update must be skipped (None without the
        guard); an accepted step enters the history."""
        if not self.enabled:
            return None
        value = torch.stack([loss.detach().double(), grad_norm.detach().double()])
        valid = (self.rows >= self.window - self.count).unsqueeze(1)
        n = self.count.clamp_min(1).double()
        mean = torch.where(valid, self.history, 0.0).sum(0) / n
        std = (torch.where(valid, (self.history - mean) ** 2, 0.0).sum(0) / n).sqrt()
        spike = (self.count >= self.min_history) & (value > mean + self.sigma * std).any()
        skip = ~torch.isfinite(value).all() | spike
        shifted = torch.cat([self.history[1:], value.unsqueeze(0)])
        self.history = torch.where(skip, self.history, shifted)
        self.count = torch.where(skip, self.count, (self.count + 1).clamp_max(self.window))
        return skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )


@torch.no_grad()
def step_unless(optimizer: torch.optim.Optimizer, model: nn.Module, skip: torch.Tensor | None) -> None:
    """``optimizer.step()``, its effect undone on the device where ``skip`` is true: parameters,
    moments and step counts as before it. A fused AdamW takes ``skip`` as its ``found_inf``
    (the kernel then leaves them untouched, as under a GradScaler): no copy. Otherwise the
    model's and the optimizer's tensors are kept before the step and selected back after it
    (a state made by this step counts as zeros before it, which is what a fresh one holds)."""
    if skip is None:
        optimizer.step()
        return
    if _fused(optimizer):
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return
    tensors = {id(p): p for p in [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]}
    before = {key: _local(t).clone() for key, t in tensors.items()}
    states = {id(p): dict(optimizer.state.get(p, {})) for p in tensors.values()}
    saved = {(key, name): v.clone() for key, st in states.items() for name, v in st.items() if torch.is_tensor(v)}
    optimizer.step()
    for key, t in tensors.items():
        _local(t).copy_(torch.where(skip, before[key], _local(t)))
        for name, v in optimizer.state.get(t, {}).items():
            if torch.is_tensor(v):
                old = saved.get((key, name))
                kept = torch.zeros_like(_local(v)) if old is None else _local(old)
                _local(v).copy_(torch.where(skip.to(v.device), kept, _local(v)))
