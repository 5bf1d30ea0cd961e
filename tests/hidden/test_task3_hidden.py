"""Task 3 (hidden): resharding after forward really frees memory. (What backward frees, and a training step after
an evaluation forward under torch.no_grad(), are Task 4's hidden tests: they need backward.)"""

from __future__ import annotations

import pytest

from fsdp_assignment.support.models import GPT
from tests.harness import run_ranks
from tests.public.common import witness_for
from tests.hidden.scenarios.task3 import CFG, _memory  # noqa: F401 (what the ranks run)

pytestmark = pytest.mark.task3


@pytest.mark.weight(3)
@pytest.mark.evidence("memory")
def test_reshard_really_frees_memory():
    # One forward under no_grad, the model built unit by unit: the root, the block computing and a finished gather's
    # buffer that gloo's worker thread has not released yet (see the scenario) at most; every unit gathered once.
    witness = witness_for(lambda: GPT(CFG), [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], 2, built=0,
                          shard_copies=1, unsharded=3, full_grads=0, moved=1)
    for rank, got in enumerate(run_ranks(_memory, 2, witness=witness)):
        slack = min(got["block_bytes"]) // 2  # less than one block's full parameters
        bound = got["root_bytes"] + got["logits_bytes"] + slack
        assert got["after_forward"] <= bound, (
            f"rank {rank}: {got['after_forward']} bytes still alive after a forward under no_grad; expected at "
            f"most the root's full parameters ({got['root_bytes']}) + the output ({got['logits_bytes']}). A "
            f"resharded unit's full parameters must really be freed (its storage resized to 0), not merely "
            f"dropped by one reference while views of it keep the memory alive")
