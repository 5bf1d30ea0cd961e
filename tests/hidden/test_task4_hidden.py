"""Task 4 (hidden): gradients accumulate over backward passes (no zero_grad in between), with nested units, frozen
parameters, a unit that never runs, and padding on W=3."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import ToyMLP
from tests.harness import run_ranks
from tests.public.common import assert_close, describe_flat_params, expected_shard, hand_shard, unsharded_storage_sizes

pytestmark = pytest.mark.task4

BATCH = 4  # per rank


def _inputs(world_size: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH * world_size, 13, generator=torch.Generator().manual_seed(10 + step))


def _two_backwards(rank, world_size):
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    # Nested units (inner, then its block), the never-used head `unused` as a unit of its own, then the root.
    units = [m for b in model.blocks for m in (b.inner, b)] + [model.unused, model]
    hand_shard(model, units)
    for step in range(2):  # no zero_grad: the second backward adds to the first one's gradients
        x = _inputs(world_size, step)[BATCH * rank:BATCH * (rank + 1)]
        model(x).pow(2).mean().backward()
    full_grads_alive = sum(fp.unsharded.grad is not None for u in adapters.fsdp_units(model) for fp in u.flat_params)
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": full_grads_alive}


@pytest.mark.weight(3)
def test_gradients_accumulate_over_backward_passes():
    world_size = 3
    results = run_ranks(_two_backwards, world_size, timeout=30)
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    for step in range(2):
        model(_inputs(world_size, step)).pow(2).mean().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters(remove_duplicate=False)}
    for rank, got in enumerate(results):
        for desc in got["flat"]:
            unit = desc["prefix"] or "<root>"
            if not desc["requires_grad"]:
                assert desc["grad"] is None, f"rank {rank}: frozen parameters of {unit} must get no gradient"
                continue
            expected = expected_shard(desc, grads)
            if unit == "unused.":
                assert desc["grad"] is None or not desc["grad"].any(), \
                    f"rank {rank}: unit {unit} never ran, so it must have no (or a zero) gradient"
                continue
            assert desc["grad"] is not None, f"rank {rank}: unit {unit} has no gradient after two backward passes"
            assert_close(desc["grad"], expected, (
                f"rank {rank}: gradient shard of unit {unit} after two backward passes without zero_grad "
                f"(the second must add to the first, as plain PyTorch does)"))
            pad_from = max(0, desc["numel"] - desc["shard_offset"])
            assert not desc["grad"][pad_from:].any(), f"rank {rank}: gradient padding of {unit} must stay zero"
        assert got["full_grads_alive"] == 0, f"rank {rank}: full (unsharded) gradients alive after backward"
        assert all(s == 0 for s in got["sizes"]), f"rank {rank}: units still unsharded after backward: {got['sizes']}"
