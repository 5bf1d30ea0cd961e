"""Task 6 (hidden): with prefetching, each unit is all-gathered exactly once per forward and once per backward (a
prefetched gather is used, not repeated), at most two non-root units are unsharded, and every reduce-scatter has
landed when backward returns: the gradients then equal those without prefetching, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_loss
from tests.harness import run_ranks
from tests.public.common import hand_shard_gpt, local_batch

pytestmark = pytest.mark.task6

CFG = GPTConfig(n_layer=4)
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
STEPS = 2


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _run(rank, world_size, prefetch, trace):
    torch.manual_seed(0)
    model = GPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = prefetch
    units = adapters.fsdp_units(model)
    names = {id(u): ("root" if u.is_root else f"block{[b._fsdp_unit for b in model.blocks].index(u)}")
             for u in units}
    gathers = {"forward": {}, "backward": {}}
    phase = ["forward"]
    max_unsharded = [0]

    def owner(output):
        ptr = output.untyped_storage().data_ptr() if isinstance(output, torch.Tensor) else None
        for u in units:
            for fp in u.flat_params:
                if ptr is not None and fp.unsharded.untyped_storage().data_ptr() == ptr:
                    return names[id(u)]
        return "other"

    def wrap(name):
        real = getattr(dist, name)

        def patched(output, *args, **kwargs):
            work = real(output, *args, **kwargs)
            who = owner(output)
            gathers[phase[0]][who] = gathers[phase[0]].get(who, 0) + 1
            max_unsharded[0] = max(max_unsharded[0], sum(any(fp.is_unsharded() for fp in u.flat_params)
                                                         for u in units if not u.is_root))
            return work
        return patched

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = None
    for step in range(STEPS):
        last = step == STEPS - 1
        if trace and last:  # the first step records the execution order; trace the second
            for name in ALL_GATHERS:
                if hasattr(dist, name):
                    setattr(dist, name, wrap(name))
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        phase[0] = "forward"
        loss = gpt_loss(model, idx, tgt)
        # the units backward must gather: those resharded after forward (reshard_after_forward)
        resharded = sorted(names[id(u)] for u in units if not any(fp.is_unsharded() for fp in u.flat_params))
        phase[0] = "backward"
        loss.backward()
        if last:
            grads = _grads(model)  # right when backward returns: every reduce-scatter must have landed
        optim.step()
    return {"grads": grads, "gathers": gathers, "max_unsharded": max_unsharded[0], "resharded": resharded}


def _both(rank, world_size):
    return {"off": _run(rank, world_size, False, False), "on": _run(rank, world_size, True, True)}


@pytest.mark.weight(3)
def test_prefetch_gathers_each_unit_once_and_finishes_every_reduction():
    n = CFG.n_layer
    for rank, got in enumerate(run_ranks(_both, 3)):
        on, off = got["on"], got["off"]
        fwd, bwd = on["gathers"]["forward"], on["gathers"]["backward"]
        expected_fwd = {"root": 1, **{f"block{i}": 1 for i in range(n)}}
        assert fwd or bwd, (f"rank {rank}: no all-gather was seen: call the collectives through the module "
                            f"(dist.all_gather_into_tensor(...)), as the public Task 6 tests also need")
        assert fwd == expected_fwd, (
            f"rank {rank}: all-gathers per unit in one forward with prefetching: {fwd}, expected each unit exactly "
            f"once ({expected_fwd}): a prefetched unit must wait on its own handle and use that gather, not "
            f"gather again")
        assert set(on["resharded"]) >= {f"block{i}" for i in range(n)}, \
            f"rank {rank}: units unsharded after forward: only {on['resharded']} were resharded"
        expected_bwd = {name: 1 for name in on["resharded"]}
        assert bwd == expected_bwd, (
            f"rank {rank}: all-gathers per unit in one backward with prefetching: {bwd}, expected each unit that "
            f"was resharded after forward exactly once: {expected_bwd}")
        assert on["max_unsharded"] <= 2, \
            f"rank {rank}: {on['max_unsharded']} non-root units unsharded at once (at most 2: current + next)"
        for i, (a, b) in enumerate(zip(off["grads"], on["grads"])):
            assert b is not None, (
                f"rank {rank}: parameter {i} has no gradient when backward returns with prefetching on: every "
                f"asynchronous reduce-scatter must be waited on and accumulated before backward returns")
            assert a is not None and torch.equal(a, b), \
                f"rank {rank}: the gradient of parameter {i} differs with prefetching on vs off"
