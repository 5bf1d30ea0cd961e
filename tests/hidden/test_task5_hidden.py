"""Task 5 (hidden): clipping below max_norm changes nothing and returns the same global norm on every rank;
resuming from sharded and full checkpoints on W=3 (where units have padding) keeps the padding zero and
equals never stopping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import adapters
from fsdp_assignment.support.state import named_flat_params
from tests.harness import run_ranks
from tests.public.common import assert_close, expected_shard
# The rank bodies and set-up are the public tests' own (one copy); these tests check other cases with them.
from tests.public.test_task5_optim_ckpt import _clip, _sharded_model, _train, single_process_clip

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
        for desc in got["flat"]:
            assert_close(desc["grad"], expected_shard(desc, grads), (
                f"rank {rank}: gradient shard of unit '{desc['prefix'] or '<root>'}' after clip_grad_norm_ with a "
                f"norm below max_norm: clipping only ever scales gradients down (coefficient at most 1)"))


def _shards(model):
    return [fp.shard.detach().clone() for _, fp in named_flat_params(model)]


def _paddings(model):
    """Each shard's padding (the elements past numel that this rank holds)."""
    out = []
    for _, fp in named_flat_params(model):
        pad_from = max(0, fp.numel - fp.shard_offset)
        out.append(fp.shard.detach()[pad_from:].clone())
    return out


def _resume(rank, world_size):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    model = _sharded_model()
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, **kwargs)
    _train(model, optim, rank, world_size, range(1))
    saved = {kind: (adapters.get_model_state_dict(model, full=kind == "full"),
                    adapters.get_optimizer_state_dict(model, optim, full=kind == "full"))
             for kind in ("sharded", "full")}
    _train(model, optim, rank, world_size, range(1, 3))
    uninterrupted = _shards(model)
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)  # a full checkpoint is made on rank 0; every rank loads it
    saved["full"] = box[0]
    resumed, paddings = {}, {}
    for kind in ("sharded", "full"):
        model = _sharded_model(seed=1)
        optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, **kwargs)
        adapters.set_model_state_dict(model, saved[kind][0], full=kind == "full")
        adapters.set_optimizer_state_dict(model, optim, saved[kind][1], full=kind == "full")
        _train(model, optim, rank, world_size, range(1, 3))
        resumed[kind], paddings[kind] = _shards(model), _paddings(model)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "paddings": paddings}


@pytest.mark.weight(3)
def test_resume_keeps_padding_zero_and_matches():
    for rank, got in enumerate(run_ranks(_resume, 3, timeout=90)):
        for kind in ("sharded", "full"):
            for i, pad in enumerate(got["paddings"][kind]):
                assert not pad.any(), (
                    f"rank {rank}: after resuming from a {kind} checkpoint and two AdamW steps, the padding of flat "
                    f"parameter {i} is not zero ({pad.tolist()}): padding must stay zero, in the optimizer state too")
            for i, (a, b) in enumerate(zip(got["uninterrupted"], got["resumed"][kind])):
                assert torch.equal(a, b), (f"rank {rank}: flat parameter {i} after resuming from a {kind} checkpoint "
                                           f"differs from never stopping (W=3)")
