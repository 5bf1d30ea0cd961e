"""The kernel's readings at the moments a body marks (issue 40 item 1): harness_rank.witness_mark, read by the
parent (harness_witness._KernelSamples.body_returned) and bounded by Witness(marks=, held_bytes=, rise_bytes=)."""

import pytest
import torch

from tests.harness import RankFailure, Witness, run_ranks
from tests.harness_rank import witness_mark

pytestmark = pytest.mark.staff


def _hold_then_free(rank, world_size, keep):
    kept = [torch.ones(50_000) for _ in range(4)]  # four blocks of 200 KB: each its own mapping (64 KiB threshold)
    witness_mark()
    if not keep:
        kept.clear()
    witness_mark()
    return len(kept)


@pytest.mark.parametrize("keep", [False, True])
def test_a_mark_sees_small_blocks_freed_or_kept(keep):
    """Four 200 KB tensors held at mark 1; freed or kept at mark 2: the kernel tells them apart (a bound of 0.25 MiB
    at mark 2 passes the one that frees and fails the one that keeps)."""
    w = Witness(marks=2, held_bytes={1: 2 << 20, 2: 1 << 18}, deferred=True)
    run_ranks(_hold_then_free, 1, keep, witness=w)
    held = [r["held_bytes"] for r in w.measured[0]["readings"]]
    assert held[0] >= 500_000, held  # the blocks are resident at mark 1
    if keep:
        with pytest.raises(RankFailure, match="at the body's mark 2"):
            w.check()
    else:
        w.check()


def _marks_twice(rank, world_size):
    witness_mark()
    witness_mark()


def test_a_rank_that_marks_more_than_its_body_fails():
    with pytest.raises(RankFailure, match="readings of its memory"):
        run_ranks(_marks_twice, 1, witness=Witness(marks=1))
