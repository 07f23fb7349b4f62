"""The spike guard on the device (``olmo_train_torch.spike_guard``) against the host reference
(``olmo_run.spike_guard.SpikeGuard``), and the undone update on both of its paths."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from olmo_run.spike_guard import SpikeGuard
from olmo_train_torch.spike_guard import DeviceSpikeGuard, step_unless

# (loss, grad norm) of 40 steps: a noisy descent with spikes of either figure and non-finite
# values; each spike is tens of sigmas above the window's mean, far from any rounding.
STEPS = [(3.0 - 0.01 * i + 0.003 * math.sin(7 * i), 1.0 + 0.05 * math.cos(3 * i)) for i in range(40)]
STEPS[25] = (9.0, STEPS[25][1])
STEPS[30] = (STEPS[30][0], 40.0)
STEPS[33] = (math.nan, 1.0)
STEPS[36] = (STEPS[36][0], math.inf)


def test_device_decisions_and_history_are_the_references():
    host = SpikeGuard(enabled=True, window=16, sigma=6.0, min_history=4, max_consecutive_skips=100)
    device = DeviceSpikeGuard(copy.deepcopy(host), torch.device("cpu"))
    skipped = []
    for step, (loss, norm) in enumerate(STEPS, start=1):
        skip = device.skip(torch.tensor(loss, dtype=torch.float64), torch.tensor(norm))
        assert skip is not None and bool(skip) == host.decide(step, loss, float(torch.tensor(norm))), step
        skipped += [step] if skip else []
    assert skipped == [26, 31, 34, 37]  # the two spikes and the two non-finite steps, 1-based
    kept = device.history[-int(device.count) :].tolist()
    assert int(device.count) == 16 and kept == [list(p) for p in zip(host.losses, host.norms)]
    # A resume: the device history starts from the host's, and decides as the run went on.
    resumed = DeviceSpikeGuard(host, torch.device("cpu"))
    assert torch.equal(resumed.history, device.history) and int(resumed.count) == 16


def test_without_the_guard_nothing_is_decided():
    assert DeviceSpikeGuard(SpikeGuard(), torch.device("cpu")).skip(torch.tensor(math.nan), torch.tensor(1.0)) is None


@pytest.mark.parametrize("fused", [True, False])
def test_a_skipped_update_is_undone_and_an_accepted_one_is_the_optimizers(fused):
    """Both paths of ``step_unless``: a fused AdamW takes the decision as its ``found_inf``, the
    foreach one has its tensors kept and selected back (the state the step made counts as zeros)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    for step in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for m in (model, twin):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
        before = [p.detach().clone() for p in model.parameters()]
        moments = copy.deepcopy(opt.state_dict()["state"])
        skip = step == 1
        step_unless(opt, model, torch.tensor(skip))
        if skip:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            after = opt.state_dict()["state"]
            assert all(torch.equal(after[k][n], v) for k, st in moments.items() for n, v in st.items())
            continue
        twin_opt.step()
        assert all(torch.equal(a, p) for a, p in zip(twin.parameters(), model.parameters()))
    assert all(float(st["step"]) == 2 for st in opt.state.values())  # the skipped step not counted
