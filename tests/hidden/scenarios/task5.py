"""Task 5 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.state import named_flat_params
from fsdp_assignment.support.models import GPT, GPTConfig, ToyMLP, gpt_loss
from tests.public.common import hand_shard, hand_shard_gpt, local_batch
from tests.public.test_task5_optim_ckpt import _sharded_model, _train


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
