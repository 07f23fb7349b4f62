"""Learning-rate schedules as pure functions of the step.

``step`` is the 1-based number of the optimizer update being taken (step 1 is the first
update), so warmup never spends an update at LR 0. Both trainers call these on the host
and feed the value into their update, so their learning rates agree by construction.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Sched(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    warmup_steps: int = Field(0, ge=0)  # linear ramp from 0 to the peak over these updates

    def _warm(self, step: int, peak: float) -> float | None:
        if self.warmup_steps and step <= self.warmup_steps:
            return peak * step / self.warmup_steps
        return None


def _cos(progress: float, start: float, end: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ConstantSchedule(_Sched):
    kind: Literal["constant"] = "constant"  # one of constant, cosine, stitched_cosine, linear, wsd

    def lr(self, step: int, peak: float, total_steps: int) -> float:
        w = self._warm(step, peak)
        return peak if w is None else w


class CosineSchedule(_Sched):
    """Warmup then a single cosine from the peak to alpha x peak at the last step."""

    kind: Literal["cosine"] = "cosine"  # one of constant, cosine, stitched_cosine, linear, wsd
    alpha: float = Field(0.1, ge=0)  # final LR as a fraction of the peak (Olmo 3 stage 1: 0.1)

    def lr(self, step: int, peak: float, total_steps: int) -> float:
        w = self._warm(step, peak)
        if w is not None:
            return w
        span = max(total_steps - self.warmup_steps, 1)
        return _cos((step - self.warmup_steps) / span, peak, self.alpha * peak)


class StitchedCosineSchedule(_Sched):
    """Ai2's two stitched half-cosines: peak -> mid over the first part, mid -> final after.

    The first half-cosine is the start of a long cosine from ``peak`` to ``alpha x peak``
    over ``first_total_steps``; at ``switch_step`` it is cut and a second half-cosine
    takes the LR from the value reached there down to ``final_alpha x peak`` at the end.
    """

    kind: Literal["stitched_cosine"] = "stitched_cosine"  # one of constant, cosine, stitched_cosine, linear, wsd
    switch_step: int = Field(gt=0)  # where the second cosine starts
    first_total_steps: int = Field(gt=0)  # length the first cosine was planned for
    alpha: float = Field(0.1, ge=0)  # end of the first (planned) cosine, x peak
    final_alpha: float = Field(0.0, ge=0)  # end of the second cosine, x peak

    @model_validator(mode="after")
    def _check(self):
        if self.switch_step <= self.warmup_steps:
            raise ValueError("switch_step must come after warmup_steps")
        return self

    def _first(self, step: int, peak: float) -> float:
        span = max(self.first_total_steps - self.warmup_steps, 1)
        return _cos((step - self.warmup_steps) / span, peak, self.alpha * peak)

    def lr(self, step: int, peak: float, total_steps: int) -> float:
        w = self._warm(step, peak)
        if w is not None:
            return w
        if step <= self.switch_step:
            return self._first(step, peak)
        mid = self._first(self.switch_step, peak)
        span = max(total_steps - self.switch_step, 1)
        return _cos((step - self.switch_step) / span, mid, self.final_alpha * peak)


class LinearSchedule(_Sched):
    """Warmup then linear decay to final_lr x peak at the last step (Olmo 3 stage 2 anneal:
    from about 2.07e-4 linearly to 0)."""

    kind: Literal["linear"] = "linear"  # one of constant, cosine, stitched_cosine, linear, wsd
    alpha: float = Field(0.0, ge=0)  # final LR as a fraction of the peak

    def lr(self, step: int, peak: float, total_steps: int) -> float:
        w = self._warm(step, peak)
        if w is not None:
            return w
        span = max(total_steps - self.warmup_steps, 1)
        frac = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        return peak + (self.alpha * peak - peak) * frac


class WSDSchedule(_Sched):
    """Warmup-stable-decay: constant at the peak, then decay over the last part."""

    kind: Literal["wsd"] = "wsd"  # one of constant, cosine, stitched_cosine, linear, wsd
    decay_fraction: float = Field(0.1, gt=0, le=1)  # share of total steps spent decaying
    decay_shape: Literal["linear", "cosine"] = "linear"
    alpha: float = Field(0.0, ge=0)  # final LR as a fraction of the peak

    def lr(self, step: int, peak: float, total_steps: int) -> float:
        w = self._warm(step, peak)
        if w is not None:
            return w
        decay_steps = max(int(round(self.decay_fraction * total_steps)), 1)
        start = total_steps - decay_steps
        if step <= start:
            return peak
        frac = min((step - start) / decay_steps, 1.0)
        if self.decay_shape == "cosine":
            return _cos(frac, peak, self.alpha * peak)
        return peak + (self.alpha * peak - peak) * frac


Schedule = Annotated[
    Union[ConstantSchedule, CosineSchedule, StitchedCosineSchedule, LinearSchedule, WSDSchedule],
    Field(discriminator="kind"),
]
