"""LR schedules at chosen steps against values computed by hand (step is 1-based)."""

from __future__ import annotations

import math

import pytest
from pydantic import TypeAdapter, ValidationError

from olmo_model import (
    ConstantSchedule,
    CosineSchedule,
    LinearSchedule,
    Schedule,
    StitchedCosineSchedule,
    WSDSchedule,
)


def test_constant():
    s = ConstantSchedule(warmup_steps=4)
    assert [s.lr(k, 2.0, 100) for k in (1, 2, 4, 5, 100)] == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_cosine():
    s = CosineSchedule(warmup_steps=10, alpha=0.1)
    assert s.lr(5, 1.0, 110) == 0.5  # 5 / 10 of the warmup
    assert s.lr(10, 1.0, 110) == 1.0
    # Halfway through the 100 decay steps: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55.
    assert s.lr(60, 1.0, 110) == pytest.approx(0.55, abs=1e-15)
    # A quarter in: 0.1 + 0.9 * (1 + cos(pi / 4)) / 2.
    assert s.lr(35, 1.0, 110) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)), abs=1e-15)
    assert s.lr(110, 1.0, 110) == pytest.approx(0.1, abs=1e-15)
    assert s.lr(500, 1.0, 110) == pytest.approx(0.1, abs=1e-15)  # held after the end


def test_linear():
    s = LinearSchedule(warmup_steps=0, alpha=0.0)
    assert s.lr(25, 2.07e-4, 100) == pytest.approx(0.75 * 2.07e-4, rel=1e-14)
    assert s.lr(100, 2.07e-4, 100) == 0.0
    s = LinearSchedule(warmup_steps=10, alpha=0.5)
    # 10 warmup, then 90 steps from 1 to 0.5: step 55 is halfway, 0.75.
    assert s.lr(55, 1.0, 100) == pytest.approx(0.75, abs=1e-15)


def test_wsd():
    s = WSDSchedule(warmup_steps=10, decay_fraction=0.2, decay_shape="linear", alpha=0.0)
    # 100 steps: decay over the last 20 (81..100), stable before.
    assert s.lr(5, 1.0, 100) == 0.5
    assert s.lr(50, 1.0, 100) == 1.0
    assert s.lr(80, 1.0, 100) == 1.0
    assert s.lr(90, 1.0, 100) == pytest.approx(0.5, abs=1e-15)
    assert s.lr(100, 1.0, 100) == 0.0
    c = WSDSchedule(decay_fraction=0.2, decay_shape="cosine", alpha=0.0)
    # A quarter into the cosine decay: (1 + cos(pi / 4)) / 2.
    assert c.lr(85, 1.0, 100) == pytest.approx((1 + math.sqrt(0.5)) / 2, abs=1e-15)


def test_stitched_cosine():
    s = StitchedCosineSchedule(switch_step=50, first_total_steps=100, alpha=0.1, final_alpha=0.0)
    # First cosine planned over 100 steps to 0.1: at step 50 it is at 0.1 + 0.9 / 2 = 0.55.
    assert s.lr(50, 1.0, 150) == pytest.approx(0.55, abs=1e-15)
    # Second cosine 0.55 -> 0 over steps 50..150: halfway (step 100) 0.55 / 2.
    assert s.lr(100, 1.0, 150) == pytest.approx(0.275, abs=1e-15)
    assert s.lr(150, 1.0, 150) == pytest.approx(0.0, abs=1e-15)
    # Continuous at the switch.
    assert s.lr(51, 1.0, 150) == pytest.approx(0.55 * (1 + math.cos(math.pi / 100)) / 2, abs=1e-15)


def test_schedule_union_parses_by_kind():
    adapter = TypeAdapter(Schedule)
    assert isinstance(adapter.validate_python({"kind": "wsd", "decay_fraction": 0.1}), WSDSchedule)
    with pytest.raises(ValidationError, match="alhpa"):
        adapter.validate_python({"kind": "cosine", "alhpa": 0.1})
