"""The zigzag context layout against values derived by hand."""

import numpy as np
import pytest

from olmo_model.context import ContextLayout, ContextLayoutError


def test_zigzag_chunks_and_positions():
    lay = ContextLayout(16, 2)  # 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert lay.chunk == 4 and lay.shard_length == 8
    assert lay.chunks_of(0) == (0, 3) and lay.chunks_of(1) == (1, 2)
    assert lay.positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert lay.positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = np.arange(32).reshape(2, 16)
    assert np.array_equal(lay.unshard(lay.shard(x)), x)
    assert lay.shard(x)[1, :8].tolist() == [16, 17, 18, 19, 28, 29, 30, 31]


def test_balanced_causal_work():
    # Causal keys per query summed over a rank's positions: equal on every rank.
    lay = ContextLayout(64, 4)
    work = [int((lay.positions(r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2


def test_halo():
    lay = ContextLayout(32, 4)  # chunks of 4
    assert lay.halo(1) == 0 and lay.halo(4) == 1 and lay.halo(5) == 1 and lay.halo(6) == 2
    # rank 1 holds chunks 1 and 6; a window of 4 needs chunk 0 (rank 0, slot 0) and chunk 5 (rank 2, slot 1)
    assert lay.halo_sources(1, 4) == [(0, 0, 0), (1, 2, 1)]
    # rank 0's chunk 0 has nothing before it; its chunk 7 needs chunk 6 (rank 1, slot 1)
    assert lay.halo_sources(0, 4) == [(1, 1, 1)]
    assert ContextLayout(32, 1).halo(4096) == 0


def test_bad_degree_is_one_line():
    with pytest.raises(ContextLayoutError, match="sequence_length=30 does not split into 2 x 4"):
        ContextLayout(30, 4)
