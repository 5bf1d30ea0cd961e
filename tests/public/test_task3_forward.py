"""Task 3: forward (unshard, reshard, pre_forward/post_forward hooks)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, Block, GPTConfig, ToyMLP
from tests.harness import run_ranks
from tests.public.collectives import use_counted_collectives
from tests.public.common import (assert_close, hand_shard, hand_shard_as_built, local_batch, rank_device,
                                 unsharded_storage_sizes, witness_for)

pytestmark = pytest.mark.task3


def _unshard(rank, world_size):
    torch.manual_seed(0)
    block = ToyMLP().blocks[0].to(rank_device())
    names = [n for n, p in block.named_parameters() if p.requires_grad]
    fp = adapters.make_flat_param(block, names, rank, world_size)
    adapters.unshard(fp)
    gathered = fp.unsharded.detach()[:fp.numel].clone().cpu()
    sizes = [fp.unsharded.untyped_storage().size()]
    adapters.reshard(fp)
    sizes.append(fp.unsharded.untyped_storage().size())
    work = adapters.unshard(fp, async_op=True)
    work.wait()
    gathered_async = fp.unsharded.detach()[:fp.numel].clone().cpu()
    adapters.reshard(fp)
    return {"gathered": gathered, "gathered_async": gathered_async, "sizes": sizes,
            "itemsize": fp.unsharded.element_size(), "padded_numel": fp.padded_numel}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.evidence("memory")
def test_unshard_gathers_every_rank_shard_and_reshard_frees(backend, world_size):
    # One block: its shard, its gathered buffer (twice, one at a time), nothing else.
    witness = witness_for(lambda: ToyMLP().blocks[0], [""], world_size, shard_copies=1, unsharded=1, full_grads=0,
                          moved=2)
    results = run_ranks(_unshard, world_size, backend=backend, witness=witness)
    torch.manual_seed(0)
    block = ToyMLP().blocks[0]
    flat = torch.cat([p.detach().reshape(-1) for p in block.parameters() if p.requires_grad])
    for rank, got in enumerate(results):
        assert torch.equal(got["gathered"], flat), f"rank {rank}: unshard() must gather every rank's shard in rank order"
        assert torch.equal(got["gathered_async"], flat), f"rank {rank}: unshard(async_op=True) + wait() gathers wrong data"
        assert got["sizes"][0] == got["padded_numel"] * got["itemsize"], f"rank {rank}: unsharded storage not allocated"
        assert got["sizes"][1] == 0, f"rank {rank}: reshard() must leave the unsharded storage at size 0"


# Wide blocks (12.6 MiB of parameters each), built and sharded one at a time: a forward that keeps every block
# unsharded holds 4 blocks more than one that reshards, far above the kernel's noise (1-2 MiB) and the witness's
# stated overhead, so the kernel decides whether resharding frees.
FORWARD_CFG = GPTConfig(n_layer=6, n_embd=512, n_head=4)


def _forward(rank, world_size, reshard_after_forward):
    cfg = FORWARD_CFG
    torch.manual_seed(0)
    model = hand_shard_as_built(lambda: GPT(cfg), Block, reshard_after_forward=reshard_after_forward, hooks=3)
    idx, _ = local_batch(cfg, rank, world_size, step=0)
    with torch.no_grad():
        logits = model(idx)
        logits_again = model(idx)  # a second forward re-gathers (or reuses) correctly
    return {"logits": logits, "again": logits_again, "sizes": unsharded_storage_sizes(model)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.evidence("memory")
def test_forward_matches_single_process(world_size, reshard_after_forward):
    cfg = FORWARD_CFG
    # Two forwards without gradients, the model built unit by unit: the root and the block computing unsharded (or
    # every unit: they stay unsharded); each unit gathered in each forward, or once.
    n_units = cfg.n_layer + 1
    witness = witness_for(lambda: GPT(cfg), [f"blocks.{i}." for i in range(cfg.n_layer)] + [""], world_size,
                          built=0, shard_copies=1, unsharded=2 if reshard_after_forward else n_units, full_grads=0,
                          moved=2 if reshard_after_forward else 1)
    results = run_ranks(_forward, world_size, reshard_after_forward, witness=witness)
    torch.manual_seed(0)
    model = GPT(cfg)
    for rank, got in enumerate(results):
        idx, _ = local_batch(cfg, rank, world_size, step=0)
        with torch.no_grad():
            expected = model(idx)
        assert_close(got["logits"], expected, f"rank {rank}: logits", rtol=1e-6)
        assert_close(got["again"], expected, f"rank {rank}: logits of a second forward", rtol=1e-6)
        assert len(got["sizes"]) == cfg.n_layer + 1, \
            f"rank {rank}: {len(got['sizes'])} FlatParameters, expected one per unit ({cfg.n_layer} blocks + root)"
        if reshard_after_forward:
            assert all(s == 0 for s in got["sizes"]), \
                f"rank {rank}: after forward with reshard_after_forward=True every unit must be resharded " \
                f"(unsharded storage sizes {got['sizes']})"
        else:
            assert all(s > 0 for s in got["sizes"]), \
                f"rank {rank}: with reshard_after_forward=False units stay unsharded after forward ({got['sizes']})"


def _late_regather(rank, world_size):
    # Collectives finish late, as on a GPU: an asynchronous all-gather's output holds NaN until its handle is
    # waited on, and only then receives the data (tests/public/collectives.py).
    use_counted_collectives(late=True)
    torch.manual_seed(0)
    block = ToyMLP().blocks[0]
    names = [n for n, p in block.named_parameters() if p.requires_grad]
    fp = adapters.make_flat_param(block, names, rank, world_size)
    adapters.unshard(fp)
    fp.use_unsharded_views()
    x = torch.randn(2 * world_size, 29, generator=torch.Generator().manual_seed(3))[2 * rank:2 * (rank + 1)]
    x.requires_grad_(True)
    y = block(x)  # autograd saves views of the gathered buffer for backward
    adapters.reshard(fp)
    work = adapters.unshard(fp, async_op=True)  # refilled by a gather that completes only at wait()
    work.wait()
    try:
        y.square().sum().backward()
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0]}
    grad = fp.unsharded.grad
    return {"error": None, "x_grad": x.grad, "flat_grad": None if grad is None else grad[:fp.numel].clone()}


def test_saved_views_survive_an_async_gather_that_completes_late():
    # A backward after the buffer was freed and refilled by unshard(async_op=True): the views autograd saved in
    # forward must see the refilled data and stay usable, however late the gather completes (Task 6 prefetches
    # with exactly such gathers).
    world_size = 2
    results = run_ranks(_late_regather, world_size)
    torch.manual_seed(0)
    block = ToyMLP().blocks[0]
    x = torch.randn(2 * world_size, 29, generator=torch.Generator().manual_seed(3))
    for rank, got in enumerate(results):
        assert got["error"] is None, (
            f"rank {rank}: backward through views saved in forward failed after the buffer was freed and refilled "
            f"by unshard(async_op=True) + wait(), with a gather that completes only at wait(): {got['error']}. "
            f"Views autograd saved stay usable whenever the gather completes, not only inside the call")
        xs = x[2 * rank:2 * (rank + 1)].clone().requires_grad_(True)
        block.zero_grad()
        block(xs).square().sum().backward()
        assert_close(got["x_grad"], xs.grad, f"rank {rank}: the input's gradient (through the refilled views)")
        flat = torch.cat([p.grad.reshape(-1) for p in block.parameters() if p.requires_grad])
        assert got["flat_grad"] is not None, f"rank {rank}: no gradient reached unsharded.grad through the views"
        assert_close(got["flat_grad"], flat, f"rank {rank}: unsharded.grad (the parameters' gradients, flattened)")


# ---- reshard_after_forward is a switch read at every forward -------------------------------------------------------
SWITCH_CFG = GPTConfig(n_layer=3)
SWITCHES = [True, False, False, True]  # each unit's reshard_after_forward in consecutive forwards


def _switch_reshard(rank, world_size):
    torch.manual_seed(0)
    model = GPT(SWITCH_CFG)
    hand_shard(model, [*model.blocks, model], hooks=3)
    idx, _ = local_batch(SWITCH_CFG, rank, world_size, step=0)
    logits, sizes = [], []
    for switch in SWITCHES:
        for unit in adapters.fsdp_units(model):
            unit.reshard_after_forward = switch  # between two forwards, as support/state.py allows
        with torch.no_grad():
            logits.append(model(idx))
        sizes.append(unsharded_storage_sizes(model))
    return {"logits": logits, "sizes": sizes}


def test_reshard_after_forward_is_read_at_every_forward():
    world_size = 2
    results = run_ranks(_switch_reshard, world_size)
    torch.manual_seed(0)
    model = GPT(SWITCH_CFG)
    for rank, got in enumerate(results):
        idx, _ = local_batch(SWITCH_CFG, rank, world_size, step=0)
        with torch.no_grad():
            expected = model(idx)
        for i, switch in enumerate(SWITCHES):
            where = f"rank {rank}, forward {i} (reshard_after_forward of the forwards so far: {SWITCHES[:i + 1]})"
            assert_close(got["logits"][i], expected, f"{where}: logits", rtol=1e-6)
            sizes = got["sizes"][i]
            assert all(s == 0 for s in sizes) if switch else all(s > 0 for s in sizes), (
                f"{where}: unsharded storage sizes after the forward {sizes}; with every unit's "
                f"reshard_after_forward={switch} each unit must be "
                f"{'resharded (size 0)' if switch else 'left unsharded (size > 0)'}. The tests change "
                f"unit.reshard_after_forward between forwards (support/state.py): read it at every forward, never "
                f"keep the value an earlier forward saw")
