"""The capacity rule of ``olmo_model.moe`` on cases worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from olmo_model.moe import capacity_keep, dispatch_rows, expert_capacity, kept_pairs

# Two sequences (one per rank of a 2-rank layout) of 4 tokens, top-2 of 4 experts.
EXPERTS = np.array(
    [
        [[0, 1], [0, 2], [0, 1], [3, 0]],  # expert 0 asked by all 4 tokens
        [[1, 2], [1, 2], [1, 3], [2, 3]],  # experts 1 and 2 asked by 3 tokens each
    ]
)


def test_capacity_one_drops_each_experts_tail_by_hand():
    # C = ceil(1.0 x 4 tokens x 2 slots / 4 experts) = 2 assignments per (sequence, expert).
    capacity = expert_capacity(1.0, sequence_length=4, top_k=2, n_experts=4)
    assert capacity == 2
    keep = capacity_keep(EXPERTS, 4, capacity)
    # Sequence 0: expert 0 keeps tokens 0 and 1, drops token 2 (slot 0) and token 3 (slot 1).
    # Sequence 1: expert 1 drops token 2 (its third), expert 2 drops token 3 (its third).
    dropped = {(0, 2, 0), (0, 3, 1), (1, 2, 0), (1, 3, 0)}
    want = np.ones_like(keep)
    for b, t, j in dropped:
        want[b, t, j] = False
    np.testing.assert_array_equal(keep, want)
    assert int((~keep).sum()) == 4
    # As (token, expert) pairs, tokens numbered over both sequences: the kept pairs by hand.
    kept = {
        (0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (3, 3),  # sequence 0
        (4, 1), (4, 2), (5, 1), (5, 2), (6, 3), (7, 3),  # sequence 1
    }  # fmt: skip
    mask = kept_pairs(EXPERTS, keep, 4)
    assert {tuple(p) for p in np.argwhere(mask)} == kept
    # The slot order of a token does not change the kept pairs.
    swapped = EXPERTS[..., ::-1]
    assert np.array_equal(kept_pairs(swapped, capacity_keep(swapped, 4, capacity), 4), mask)


def test_each_sequence_decides_alone():
    """The kept set of a sequence depends on its own routing only: the two sequences computed
    apart (two ranks) keep what they keep together (one rank)."""
    together = capacity_keep(EXPERTS, 4, 2)
    apart = np.concatenate([capacity_keep(EXPERTS[i : i + 1], 4, 2) for i in range(2)])
    np.testing.assert_array_equal(together, apart)


def test_capacity_reads_the_factor_as_written_and_stays_within_the_sequence():
    assert expert_capacity(1.1, sequence_length=40, top_k=4, n_experts=4) == 40  # 44, capped at 40 tokens
    assert expert_capacity(1.1, sequence_length=80, top_k=2, n_experts=4) == 44  # not 45: 1.1 is read as 11/10
    assert expert_capacity(0.01, sequence_length=4, top_k=2, n_experts=4) == 1  # at least one row
    assert expert_capacity(2.0, sequence_length=4, top_k=2, n_experts=4) == 4  # factor >= E/k: nothing dropped
    assert capacity_keep(EXPERTS, 4, 4).all()
    # Buffer rows: E x B x C, the factor times the B x S x k assignments when C is exact.
    assert dispatch_rows(2, 4, 2) == 16 == EXPERTS.size
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(0.0, 4, 2, 4)
