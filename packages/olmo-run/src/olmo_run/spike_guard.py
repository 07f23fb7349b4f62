"""The spike guard: skip a step whose loss or grad norm is a spike, and stop a run that diverged."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .checkpoints import complete_checkpoints
from .errors import TrainingDivergedError
from .recipe import Recipe
from .run_dir import RunPath


@dataclass
class SpikeGuard:
    """Decides, from accepted history only, whether a step's loss or grad norm is a spike, and
    when the run must stop instead (``decide``).

    The rule (``should_skip``, OLMo-core's SkipStepAdamW idea): with the guard enabled, a step is
    skipped when its loss or grad norm is not finite, or, once ``min_history`` accepted steps
    are known, when either exceeds the mean + ``sigma`` x the (population) standard deviation
    of the last ``window`` accepted steps' values. The trainers decide it on their device, so
    that a skipped update costs no host read (``olmo_train_torch.spike_guard``, the JAX
    trainer's ``step.guarded_update``), from this history as it was at the run's start; the
    driver reads their decisions every few steps and replays them here (``observe``), which
    keeps this history, the one checkpoints carry, equal to the device's."""

    enabled: bool = False
    window: int = 128
    sigma: float = 6.0
    min_history: int = 20
    max_consecutive_skips: int = 10
    losses: deque = field(default_factory=deque)
    norms: deque = field(default_factory=deque)
    consecutive_skips: int = 0

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SpikeGuard:
        g = recipe.spike_guard
        return cls(
            enabled=g.enabled,
            window=g.window,
            sigma=g.sigma,
            min_history=g.min_history,
            max_consecutive_skips=g.max_consecutive_skips,
        )

    def decide(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when this step's update must be skipped (``should_skip``, the reference rule),
        applied to the history as ``observe`` does (and raising where it raises)."""
        return self.observe(step, loss, grad_norm, self.should_skip(loss, grad_norm))

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool) -> bool:
        """A step's decision, made on the device by the trainer from the same history (the rule
        of ``should_skip``), applied here: an accepted step enters the history and resets the
        count of skips in a row. Returns ``skipped``. Raises TrainingDivergedError for a
        non-finite loss or grad norm without the guard (nothing could undo that update), and
        after more than ``max_consecutive_skips`` skips in a row with it."""
        if not self.enabled:
            if math.isfinite(loss) and math.isfinite(grad_norm):
                return False
            raise TrainingDivergedError(
                f"step {step}: loss {loss} / grad norm {grad_norm} is not finite; stopped before any checkpoint "
                "of this state was written; resume from the newest checkpoint with a lower optim.lr "
                "(--optim.lr=... --checkpoint.allow_recipe_change=true), or --spike_guard.enabled=true to skip such steps"
            )
        if not skipped:
            self.consecutive_skips = 0
            self.record(loss, grad_norm)
            return False
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            raise TrainingDivergedError(
                f"step {step}: the spike guard skipped {self.consecutive_skips} steps in a row (loss {loss}, "
                f"grad norm {grad_norm}; spike_guard.max_consecutive_skips={self.max_consecutive_skips}): the "
                "weights no longer recover; resume from an earlier checkpoint with a lower optim.lr "
                "(--optim.lr=... --checkpoint.allow_recipe_change=true)"
            )
        return True

    @staticmethod
    def _too_high(history: deque, value: float, sigma: float) -> bool:
        n = len(history)
        mean = sum(history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in history) / n)
        return value > mean + sigma * std

    def should_skip(self, loss: float, grad_norm: float) -> bool:
        if not self.enabled:
            return False
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return True
        if len(self.losses) < self.min_history:
            return False
        return self._too_high(self.losses, loss, self.sigma) or self._too_high(self.norms, grad_norm, self.sigma)

    def record(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.norms.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state.get("losses", []))
        self.norms = deque(state.get("norms", []))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))


def refuse_non_finite_state(step: int, run_dir: RunPath) -> None:
    """Stop instead of checkpointing a state whose parameters or moments are not finite."""
    done = complete_checkpoints(run_dir)
    newest = f"the newest checkpoint is step {done[-1][0]}" if done else "no checkpoint was written before"
    raise TrainingDivergedError(
        f"step {step}: parameters or optimizer moments are not finite; not checkpointing them ({newest}); "
        "resume from it with a lower optim.lr (--optim.lr=... --checkpoint.allow_recipe_change=true)"
    )
