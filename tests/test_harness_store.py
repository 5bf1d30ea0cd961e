"""The run's FileStore is no channel between ranks (issue 40): a body that moves data through
``store.set``/``get`` fails the run, and setting up many process groups, as an honest design with one group per
unit does, stays far below the bound (StoreWatch in tests/harness_start.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks
from tests.harness_start import STORE_BOUND_BYTES


def _many_groups(rank, world_size, n):
    for _ in range(n):
        group = dist.new_group(list(range(world_size)))
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert t[0].item() == world_size
    return True


def _through_the_store(rank, world_size, nbytes):
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("smuggled", b"x" * nbytes)
    dist.barrier()
    return len(store.get("smuggled"))


def test_many_process_groups_fit_the_store_bound():
    assert run_ranks(_many_groups, 4, 32) == [True] * 4


def test_data_moved_through_the_store_fails_the_run():
    with pytest.raises(RankFailure, match="through the store instead of through collectives") as info:
        run_ranks(_through_the_store, 2, 2 * STORE_BOUND_BYTES)
    assert info.value.kind == "store"
