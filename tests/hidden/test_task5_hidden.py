"""Task 5 (hidden): clipping below max_norm changes nothing and returns the same global norm on every rank;
resuming from sharded and full checkpoints on W=3 (where units have padding) keeps the padding zero, restores
the optimizer's hyperparameters and the model's buffers, and equals never stopping; full state dicts are
materialized on rank 0 only (measured memory on the other ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.state import named_flat_params
from tests.harness import run_ranks
from fsdp_assignment.support.models import GPT, GPTConfig, ToyMLP, gpt_loss
from tests.public.common import (assert_close, check_flat_params, expected_shard, hand_shard, hand_shard_gpt,
                                 local_batch, unit_numels)
# The rank bodies and set-up are the public tests' own (one copy); these tests check other cases with them.
from tests.public.test_task5_optim_ckpt import CFG, _clip, _sharded_model, _train, single_process_clip

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


def _shards(model):
    return [fp.shard.detach().clone() for _, fp in named_flat_params(model)]


def _paddings(model):
    """Each shard's padding (the elements past numel that this rank holds)."""
    out = []
    for _, fp in named_flat_params(model):
        pad_from = max(0, fp.numel - fp.shard_offset)
        out.append(fp.shard.detach()[pad_from:].clone())
    return out


MEMORY_CFG = GPTConfig(n_layer=16)  # many units: the whole model's state is far more than one unit's


def _full_state_dict_memory(rank, world_size):
    """Peak bytes allocated while making the full model and optimizer state dicts of an 8-block GPT."""
    torch.manual_seed(0)
    model = GPT(MEMORY_CFG)
    hand_shard_gpt(model)
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2)
    idx, tgt = local_batch(MEMORY_CFG, rank, world_size, 0)
    gpt_loss(model, idx, tgt).backward()
    optim.step()
    out = {}
    for what, make in (("model", lambda: adapters.get_model_state_dict(model, full=True)),
                       ("optim", lambda: adapters.get_optimizer_state_dict(model, optim, full=True))):
        with LiveStorageTracker(device="cpu") as mem:
            mem.track([model, optim])  # what exists already (shards, optimizer state) is not the question
            base = mem.current_bytes
            mem.reset_peak()
            result = make()
            out[what] = mem.peak_bytes - base
            del result
    return out


def _buffers_round_trip(rank, world_size):
    """ToyMLP's buffers (``scale``) changed after init must come back from full and sharded checkpoints."""
    torch.manual_seed(0)
    model = ToyMLP()
    hand_shard(model, [m for b in model.blocks for m in (b.inner, b)] + [model])
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.scale.mul_(i + 2)
    saved = {kind: adapters.get_model_state_dict(model, full=kind == "full") for kind in ("sharded", "full")}
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)
    saved["full"] = box[0]
    out = {"full_keys": sorted(box[0])}
    for kind in ("sharded", "full"):
        torch.manual_seed(1)
        fresh = ToyMLP()
        hand_shard(fresh, [m for b in fresh.blocks for m in (b.inner, b)] + [fresh])
        adapters.set_model_state_dict(fresh, saved[kind], full=kind == "full")
        out[kind] = {k: v.detach().clone() for k, v in fresh.named_buffers()}
    return out


def _resume(rank, world_size):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    model = _sharded_model()
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, **kwargs)
    _train(model, optim, rank, world_size, range(1))
    memory = _full_state_dict_memory(rank, world_size)
    saved = {kind: (adapters.get_model_state_dict(model, full=kind == "full"),
                    adapters.get_optimizer_state_dict(model, optim, full=kind == "full"))
             for kind in ("sharded", "full")}
    _train(model, optim, rank, world_size, range(1, 3))
    uninterrupted = _shards(model)
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)  # a full checkpoint is made on rank 0; every rank loads it
    saved["full"] = box[0]
    resumed, paddings = {}, {}
    hyper = {}
    for kind in ("sharded", "full"):
        model = _sharded_model(seed=1)
        # Other hyperparameters than the checkpoint's: loading must restore lr and weight decay as well.
        optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=0.3, weight_decay=0.0)
        adapters.set_model_state_dict(model, saved[kind][0], full=kind == "full")
        adapters.set_optimizer_state_dict(model, optim, saved[kind][1], full=kind == "full")
        hyper[kind] = [(float(g["lr"]), float(g["weight_decay"])) for g in optim.param_groups]
        _train(model, optim, rank, world_size, range(1, 3))
        resumed[kind], paddings[kind] = _shards(model), _paddings(model)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "paddings": paddings, "hyper": hyper,
            "memory": memory, "buffers": _buffers_round_trip(rank, world_size)}


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
