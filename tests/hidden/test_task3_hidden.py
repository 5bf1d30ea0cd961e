"""Task 3 (hidden): resharding after forward really frees memory. (What backward frees, and a training step after
an evaluation forward under torch.no_grad(), are Task 4's hidden tests: they need backward.)"""

from __future__ import annotations

import pytest
import torch

from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, GPTConfig
from fsdp_assignment.support.state import fsdp_units
from tests.harness import run_ranks
from tests.public.common import hand_shard_gpt, local_batch

pytestmark = pytest.mark.task3

CFG = GPTConfig()


def _memory(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    hand_shard_gpt(model, hooks=3)
    units = fsdp_units(model)
    block_bytes = [sum(fp.padded_numel * fp.unsharded.element_size() for fp in u.flat_params)
                   for u in units if not u.is_root]
    root_bytes = sum(fp.padded_numel * fp.unsharded.element_size() for u in units if u.is_root for fp in u.flat_params)
    idx, _ = local_batch(CFG, rank, world_size, step=0)
    with LiveStorageTracker(device="cpu") as mem:
        mem.track(model)  # the shards (and buffers): counted from the start, so what follows is on top of them
        base = mem.current_bytes
        with torch.no_grad():
            logits = model(idx)
        logits_bytes = logits.untyped_storage().nbytes()
        after_forward = mem.current_bytes - base
    return {"after_forward": after_forward, "block_bytes": block_bytes, "root_bytes": root_bytes,
            "logits_bytes": logits_bytes}


@pytest.mark.weight(3)
def test_reshard_really_frees_memory():
    for rank, got in enumerate(run_ranks(_memory, 2)):
        slack = min(got["block_bytes"]) // 2  # less than one block's full parameters
        bound = got["root_bytes"] + got["logits_bytes"] + slack
        assert got["after_forward"] <= bound, (
            f"rank {rank}: {got['after_forward']} bytes still alive after a forward under no_grad; expected at "
            f"most the root's full parameters ({got['root_bytes']}) + the output ({got['logits_bytes']}). A "
            f"resharded unit's full parameters must really be freed (its storage resized to 0), not merely "
            f"dropped by one reference while views of it keep the memory alive")
