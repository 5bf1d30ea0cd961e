"""Task 5 (hidden): clipping below max_norm changes nothing and returns the same global norm on every rank;
resuming from sharded and full checkpoints on W=3 (where units have padding) keeps the padding zero, restores
the optimizer's hyperparameters and the model's buffers, and equals never stopping; full state dicts are
materialized on rank 0 only (measured memory on the other ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from fsdp_assignment.support.models import GPT, ToyMLP
from tests.public.common import assert_close, check_flat_params, expected_shard, unit_numels
# The rank bodies and set-up are the public tests' own (one copy); these tests check other cases with them.
from tests.public.test_task5_optim_ckpt import CFG, _clip, single_process_clip
from tests.hidden.scenarios.task5 import MEMORY_CFG, _resume  # noqa: F401 (what the ranks run)

pytestmark = pytest.mark.task5


@pytest.mark.weight(2)
def test_clip_grad_norm_below_max_norm_changes_nothing():
    world_size, max_norm = 3, 1e3
    results = run_ranks(_clip, world_size, max_norm)
    norm, grads = single_process_clip(world_size, max_norm)
    assert norm < max_norm, "test set-up: the norm must be below max_norm"
    for rank, got in enumerate(results):
        assert torch.equal(got["norm"], results[0]["norm"]), \
            f"rank {rank}: returned norm {got['norm']} differs from rank 0's {results[0]['norm']} (it is global)"
        assert_close(got["norm"], norm, f"rank {rank}: returned norm (the global norm over all ranks)")
        check_flat_params(got["flat"], GPT(CFG), [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["grad"], expected_shard(desc, grads), (
                f"rank {rank}: gradient shard of unit '{desc['prefix'] or '<root>'}' after clip_grad_norm_ with a "
                f"norm below max_norm: clipping only ever scales gradients down (coefficient at most 1)"))


@pytest.mark.weight(3)
def test_resume_keeps_padding_zero_and_matches():
    world_size = 3
    results = run_ranks(_resume, world_size, timeout=90)
    # The parent's own model: what a full optimizer state is worth, and the largest unit's share of it.
    units = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]
    memory_units = [f"blocks.{i}." for i in range(MEMORY_CFG.n_layer)] + [""]
    padded = [-(-n // world_size) * world_size for n in unit_numels(GPT(MEMORY_CFG), memory_units).values()]
    adamw_full_bytes = 2 * 4 * sum(padded)  # exp_avg and exp_avg_sq, fp32, every unit
    for rank, got in enumerate(results[1:], start=1):
        for what, full_bytes in (("model", adamw_full_bytes // 2), ("optim", adamw_full_bytes)):
            # Measured against rank 0, which must hold the whole state: allocations both make alike (gathered
            # buffers, what gloo's threads release a little later) cancel out.
            saved = results[0]["memory"][what] - got["memory"][what]
            assert saved >= full_bytes // 2, (
                f"rank {rank}: making the full {what} state dict allocated {got['memory'][what]} bytes at its peak, "
                f"rank 0 {results[0]['memory'][what]}; the full {what} state ({full_bytes} bytes) belongs on rank 0 "
                f"only: other ranks take part in the gathers but must not keep what they gather")
    torch.manual_seed(0)
    toy = ToyMLP()
    with torch.no_grad():
        for i, block in enumerate(toy.blocks):
            block.scale.mul_(i + 2)
    for rank, got in enumerate(results):
        for kind in ("sharded", "full"):
            assert got["buffers"][kind].keys() == dict(toy.named_buffers()).keys(), (
                f"rank {rank}: the buffers restored from the {kind} state dict are {sorted(got['buffers'][kind])}, "
                f"expected every persistent buffer under its name: {sorted(dict(toy.named_buffers()))}")
            for name, b in toy.named_buffers():
                assert torch.equal(got["buffers"][kind][name], b), (
                    f"rank {rank}: buffer {name} after loading a {kind} model state dict: buffers (here changed "
                    f"after init) must be saved and restored too")
            assert got["hyper"][kind] and set(got["hyper"][kind]) == {(1e-2, 0.1)}, (
                f"rank {rank}: (lr, weight_decay) after loading a {kind} optimizer state dict into an optimizer made "
                f"with (0.3, 0.0): {got['hyper'][kind]}; the checkpoint's (0.01, 0.1) must be restored")
            assert len(got["paddings"][kind]) == len(got["resumed"][kind]) == len(units), \
                f"rank {rank}: expected one FlatParameter per unit"
            for i, pad in enumerate(got["paddings"][kind]):
                assert not pad.any(), (
                    f"rank {rank}: after resuming from a {kind} checkpoint and two AdamW steps, the padding of flat "
                    f"parameter {i} is not zero ({pad.tolist()}): padding must stay zero, in the optimizer state too")
            for i, (a, b) in enumerate(zip(got["uninterrupted"], got["resumed"][kind])):
                assert torch.equal(a, b), (f"rank {rank}: flat parameter {i} after resuming from a {kind} checkpoint "
                                           f"differs from never stopping (W=3)")
