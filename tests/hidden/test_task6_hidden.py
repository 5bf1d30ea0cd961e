"""Task 6 (hidden): with prefetching, each unit is all-gathered exactly once per forward and once per backward (a
prefetched gather is used, not repeated), at most two non-root units are unsharded, and every reduce-scatter has
landed when backward returns: the gradients then equal those without prefetching, bit for bit, with collectives
that finish late. When the forward order changes, prefetching follows the new order; a unit prefetched by the
recorded order that then does not run is freed by the end of backward and never serves stale parameters."""

from __future__ import annotations

import pytest
import torch
import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.collectives import use_counted_collectives
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard,
                                 full_params_of, hand_shard_gpt, local_batch)
from tests.public.test_task4_backward import check_lora, lora_run

pytestmark = pytest.mark.task6

CFG = GPTConfig(n_layer=4)
STEPS = 2


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _run(rank, world_size, prefetch, trace, log):
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
    tracing = [False]

    def on_collective(call, output):
        if not tracing[0] or call.kind != "all_gather":
            return
        who = _owner(units, names, output)
        gathers[phase[0]][who] = gathers[phase[0]].get(who, 0) + 1
        max_unsharded[0] = max(max_unsharded[0], sum(any(fp.is_unsharded() for fp in u.flat_params)
                                                     for u in units if not u.is_root))

    log.listener = on_collective
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = None
    for step in range(STEPS):
        last = step == STEPS - 1
        tracing[0] = trace and last  # the first step records the execution order; trace the second
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
    log.listener = None
    return {"grads": grads, "gathers": gathers, "max_unsharded": max_unsharded[0], "resharded": resharded}


def _owner(units, names, output):
    ptr = output.untyped_storage().data_ptr() if isinstance(output, torch.Tensor) else None
    for u in units:
        for fp in u.flat_params:
            if ptr is not None and fp.unsharded.untyped_storage().data_ptr() == ptr:
                return names[id(u)]
    return "other"


def _both(rank, world_size):
    # Collectives finish late (NaN until wait()), as on a GPU; every all-gather is seen however it is called.
    log = use_counted_collectives(late=True)
    return {"off": _run(rank, world_size, False, False, log), "on": _run(rank, world_size, True, True, log)}


class ReorderedGPT(GPT):
    """GPT whose blocks run in ``self.order`` (a list of block indices; a block left out is skipped)."""

    order: list[int]

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i in self.order:
            x = self.blocks[i](x)
        return self.lm_head(self.ln_f(x))


# Per step: the order the blocks run in. The order changes at step 2 (the first forward after a change may
# prefetch by the old order; step 3 must use the new one), and at step 4 block 0 is skipped although the
# previous forward ran it (a unit prefetched by the recorded order that never runs).
ORDERS = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0], [3, 2, 1, 0], [3, 2, 1], [3, 2, 1, 0]]
RELEARNED_STEP, SKIP_STEP = 3, 4


def _reorder(rank, world_size):
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = ReorderedGPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    units = adapters.fsdp_units(model)
    blocks = [b._fsdp_unit for b in model.blocks]
    names = {id(u): ("root" if u.is_root else f"block{blocks.index(u)}") for u in units}
    events = []
    max_unsharded = {}

    def on_collective(call, output):
        if call.kind == "all_gather":
            events.append(("ag", _owner(units, names, output)))
        now = sum(any(fp.is_unsharded() for fp in u.flat_params) for u in units if not u.is_root)
        max_unsharded[step] = max(max_unsharded.get(step, 0), now)

    def forward_started(i):
        def hook(module, args):
            events.append(("fwd", f"block{i}"))
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(forward_started(i))
    log.listener = on_collective
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    traced, after_backward = {}, {}
    for step, order in enumerate(ORDERS):
        model.order = order
        events.clear()
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        traced[step] = list(events)
        after_backward[step] = [names[id(u)] for u in units if any(fp.is_unsharded() for fp in u.flat_params)]
        optim.step()
    log.listener = None
    return {"events": traced, "unsharded_after_backward": after_backward, "max_unsharded": max_unsharded,
            "flat": describe_flat_params(model)}


def _train_reordered_single_process(world_size):
    torch.manual_seed(0)
    model = ReorderedGPT(CFG)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, order in enumerate(ORDERS):
        model.order = order
        idx, tgt = gpt_batch(CFG, 2 * world_size, seed=step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        optim.step()
    return model


@pytest.mark.weight(3)
def test_prefetch_gathers_each_unit_once_and_finishes_every_reduction():
    n = CFG.n_layer
    for rank, got in enumerate(run_ranks(_both, 3)):
        on, off = got["on"], got["off"]
        fwd, bwd = on["gathers"]["forward"], on["gathers"]["backward"]
        expected_fwd = {"root": 1, **{f"block{i}": 1 for i in range(n)}}
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
        assert len(off["grads"]) == len(on["grads"]) == n + 1, f"rank {rank}: expected {n + 1} flat shards"
        for i, (a, b) in enumerate(zip(off["grads"], on["grads"])):
            assert b is not None, (
                f"rank {rank}: parameter {i} has no gradient when backward returns with prefetching on: every "
                f"asynchronous reduce-scatter must be waited on and accumulated before backward returns")
            assert a is not None and torch.equal(a, b), \
                f"rank {rank}: the gradient of parameter {i} differs with prefetching on vs off"


@pytest.mark.weight(3)
def test_prefetch_follows_a_changed_order_and_frees_units_that_never_run():
    world_size = 2
    expected = _train_reordered_single_process(world_size)
    full = full_params_of(expected)
    for rank, got in enumerate(run_ranks(_reorder, world_size)):
        order = ORDERS[RELEARNED_STEP]
        events = got["events"][RELEARNED_STEP]
        split = next(i for i, e in enumerate(events) if e == ("fwd", f"block{order[-1]}"))
        fwd = events[:split + 1]
        counts = {}
        for kind, who in fwd:
            if kind == "ag":
                counts[who] = counts.get(who, 0) + 1
        expected_counts = {"root": 1, **{f"block{i}": 1 for i in order}}
        assert counts == expected_counts, (
            f"rank {rank}: all-gathers per unit in the forward of step {RELEARNED_STEP}, after the blocks' order "
            f"changed to {order} at step {RELEARNED_STEP - 1}: {counts}, expected each unit once "
            f"({expected_counts}). Re-record the execution order every iteration; a unit prefetched by a stale "
            f"order is gathered although it does not run next. Events: {fwd}")
        for j in range(1, len(order)):
            ag = fwd.index(("ag", f"block{order[j]}"))
            assert ag < fwd.index(("fwd", f"block{order[j - 1]}")), (
                f"rank {rank}: at step {RELEARNED_STEP} the blocks run in the order {order}: block {order[j]} must "
                f"be prefetched before block {order[j - 1]} computes (the order of the previous forward). "
                f"Events: {fwd}")
        for step, left in got["unsharded_after_backward"].items():
            assert left == [], (
                f"rank {rank}: units still unsharded after backward of step {step} (blocks run: {ORDERS[step]}): "
                f"{left}. A unit prefetched by the recorded order that then never ran must be freed too (its "
                f"all-gather waited on) by the end of backward")
        worst = got["max_unsharded"][RELEARNED_STEP]
        assert worst <= 2, (f"rank {rank}: {worst} non-root units were unsharded at once at step {RELEARNED_STEP} "
                            f"(at most 2: the one computing and the one prefetched by the current order)")
        check_flat_params(got["flat"], expected, [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["shard"], expected_shard(desc, full), (
                f"rank {rank}: unit '{desc['prefix'] or '<root>'}' after {len(ORDERS)} steps with changing block "
                f"orders and a skipped block, against single-process training: a prefetched gather must never "
                f"serve parameters of an earlier step"))


@pytest.mark.weight(2)
def test_prefetch_with_frozen_embedding_and_a_fully_frozen_unit():
    """As Task 4's hidden LoRA test, with prefetching on: the first block's input needs no gradient and one block
    has no trainable parameter; at most two non-root units unsharded, gradients and one AdamW step as one process."""
    world_size = 2
    check_lora(run_ranks(lora_run, world_size, 6, True, True, 2), world_size, prefetch=True, freeze_embedding=True, frozen_block=2)
