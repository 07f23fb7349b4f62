"""The spike guard's stop rules."""

from __future__ import annotations

import json
import math

import pytest

from olmo_run.errors import TrainingDivergedError
from olmo_run.spike_guard import SpikeGuard


def test_without_the_guard_a_non_finite_step_stops_the_run():
    g = SpikeGuard(enabled=False)
    assert g.decide(1, 8.3, 1.2) is False
    for loss, norm in ((math.nan, 1.0), (8.3, math.inf), (-math.inf, 1.0)):
        with pytest.raises(TrainingDivergedError, match="step 7: .* not finite"):
            g.decide(7, loss, norm)


def test_the_guard_skips_then_stops_after_max_consecutive_skips():
    g = SpikeGuard(enabled=True, min_history=2, sigma=6.0, max_consecutive_skips=3)
    assert [g.decide(s, 2.0 + 0.01 * s, 1.0) for s in range(1, 5)] == [False] * 4
    assert g.decide(5, math.nan, 1.0) is True  # skipped, not fatal: the update is never applied
    assert g.decide(6, 50.0, 1.0) is True
    assert g.decide(7, 2.03, 1.0) is False  # an accepted step resets the count
    assert g.consecutive_skips == 0
    assert [g.decide(s, 1e9, 1.0) for s in (8, 9, 10)] == [True] * 3
    state = g.state_dict()
    assert state["consecutive_skips"] == 3
    resumed = SpikeGuard(enabled=True, min_history=2, sigma=6.0, max_consecutive_skips=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as meta.json carries it
    with pytest.raises(TrainingDivergedError, match="skipped 4 steps in a row"):
        resumed.decide(11, 1e9, 1.0)
    assert len(resumed.losses) == 5  # skipped steps never enter the history
