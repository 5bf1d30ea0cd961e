"""Task 3 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import time

import torch

from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, Block, GPTConfig
from fsdp_assignment.support.state import fsdp_units
from tests.public.common import hand_shard_as_built, local_batch


# Wide blocks (12.6 MiB each), built and sharded one at a time: a forward that frees none holds 4 blocks more than
# the witness allows, far above the kernel's noise, so the kernel decides as well as the storage tracker.
CFG = GPTConfig(n_layer=6, n_embd=512, n_head=4)


def _memory(rank, world_size):
    torch.manual_seed(0)
    model = hand_shard_as_built(lambda: GPT(CFG), Block, hooks=3)
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
        # A collective's own worker thread may hold its output tensors for a moment after wait() returns (gloo
        # releases a finished work on its thread): a correct list all-gather then reads a few KiB high at random.
        # Memory an implementation keeps does not go away by waiting, so settle for up to a second first.
        bound = root_bytes + logits_bytes + min(block_bytes) // 2
        deadline = time.monotonic() + 1.0
        while after_forward > bound and time.monotonic() < deadline:
            time.sleep(0.01)
            after_forward = mem.current_bytes - base
    return {"after_forward": after_forward, "block_bytes": block_bytes, "root_bytes": root_bytes,
            "logits_bytes": logits_bytes}
