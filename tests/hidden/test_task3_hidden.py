"""Task 3 (hidden): resharding really frees memory; a forward under torch.no_grad() (evaluation) followed by a
training step still gives every parameter its gradient."""

from __future__ import annotations

import pytest
import torch

from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from fsdp_assignment.support.state import fsdp_units
from tests.harness import run_ranks
from tests.public.common import assert_close, describe_flat_params, expected_shard, hand_shard_gpt, local_batch

pytestmark = pytest.mark.task3

CFG = GPTConfig()


def _memory(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    hand_shard_gpt(model)
    units = fsdp_units(model)
    block_bytes = [sum(fp.padded_numel * fp.unsharded.element_size() for fp in u.flat_params)
                   for u in units if not u.is_root]
    root_bytes = sum(fp.padded_numel * fp.unsharded.element_size() for u in units if u.is_root for fp in u.flat_params)
    grad_shard_bytes = sum(fp.shard_numel * fp.shard.element_size() for u in units for fp in u.flat_params
                           if fp.shard.requires_grad)
    idx, tgt = local_batch(CFG, rank, world_size, step=0)
    with LiveStorageTracker(device="cpu") as mem:
        mem.track(model)  # the shards (and buffers): counted from the start, so what follows is on top of them
        base = mem.current_bytes
        with torch.no_grad():
            logits = model(idx)
        logits_bytes = logits.untyped_storage().nbytes()
        after_forward = mem.current_bytes - base
        del logits
        loss = gpt_loss(model, idx, tgt)
        loss.backward()
        del loss
        after_backward = mem.current_bytes - base
    return {"after_forward": after_forward, "after_backward": after_backward, "block_bytes": block_bytes,
            "root_bytes": root_bytes, "logits_bytes": logits_bytes, "grad_shard_bytes": grad_shard_bytes}


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
        bound = got["grad_shard_bytes"] + slack
        assert got["after_backward"] <= bound, (
            f"rank {rank}: {got['after_backward']} bytes alive after backward; expected about the gradient shards "
            f"({got['grad_shard_bytes']}): full parameters or full gradients were not freed")


def _eval_then_train(rank, world_size):
    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        hand_shard_gpt(model, reshard_after_forward=reshard_after_forward)
        idx, tgt = local_batch(CFG, rank, world_size, step=0)
        with torch.no_grad():
            model(idx)  # evaluation: views made now carry no autograd history
        gpt_loss(model, idx, tgt).backward()
        out[reshard_after_forward] = describe_flat_params(model, grads=True)
    return out


@pytest.mark.weight(3)
def test_eval_under_no_grad_then_train():
    world_size = 2
    results = run_ranks(_eval_then_train, world_size)
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch(CFG, 2 * world_size, seed=0)
    gpt_loss(model, idx, tgt).backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    for rank, got in enumerate(results):
        for reshard_after_forward, descs in got.items():
            for desc in descs:
                where = (f"rank {rank}, reshard_after_forward={reshard_after_forward}, unit "
                         f"'{desc['prefix'] or '<root>'}'")
                assert desc["grad"] is not None, (
                    f"{where}: no gradient after a forward under torch.no_grad() followed by a training step: "
                    f"point the parameters at fresh views in every pre-forward, even when the unit is unsharded "
                    f"already (views made under no_grad have no path to the flat parameter)")
                assert_close(desc["grad"], expected_shard(desc, grads), f"{where}: gradient shard")
