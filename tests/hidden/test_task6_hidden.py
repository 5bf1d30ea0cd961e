"""Task 6 (hidden): with prefetching, each unit is all-gathered exactly once per forward and once per backward (a
prefetched gather is used, not repeated), at most two non-root units are unsharded, and every reduce-scatter has
landed when backward returns: the gradients then equal those without prefetching, bit for bit, with collectives
that finish late. When the forward order changes, prefetching follows the new order; a unit prefetched by the
recorded order that then does not run is freed by the end of backward and never serves stale parameters."""

from __future__ import annotations

import pytest
import torch
from fsdp_assignment.support.models import gpt_batch, gpt_loss
from tests.harness import run_ranks
from fsdp_assignment.support.models import GPT
from tests.public.common import (WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, assert_close, check_flat_params, expected_shard,
                                 full_params_of, witness_for)
from tests.public.test_task4_backward import check_lora, lora_run, lora_witness
# _both and _reorder are what the ranks run
from tests.hidden.scenarios.task6 import CFG, ORDERS, STEPS, TWICE, ReorderedGPT, _both, _reorder  # noqa: F401

pytestmark = pytest.mark.task6


def _prefetch_witness(world_size: int, *, unsharded: int = 3, moved: float):
    """The scenarios' GPT(CFG), built whole and sharded by hand: at most the block computing, the one prefetched and
    the root unsharded (``unsharded``), SGD momentum on the shards."""
    return witness_for(lambda: GPT(CFG), [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], world_size,
                       shard_copies=3, unsharded=unsharded, overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
                       moved=moved)


# Per step: the order the blocks run in. The order changes at step 2 (the first forward after a change may
# prefetch by the old order; step 3 must use the new one), and at step 4 block 0 is skipped although the
# previous forward ran it (a unit prefetched by the recorded order that never runs).
RELEARNED_STEP, SKIP_STEP = 3, 4


def _train_reordered_single_process(world_size, orders=ORDERS):
    torch.manual_seed(0)
    model = ReorderedGPT(CFG)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, order in enumerate(orders):
        model.order = order
        idx, tgt = gpt_batch(CFG, 2 * world_size, seed=step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        optim.step()
    return model


@pytest.mark.weight(3)
@pytest.mark.evidence("memory")
def test_prefetch_gathers_each_unit_once_and_finishes_every_reduction():
    n = CFG.n_layer
    # Two trainings of STEPS steps (prefetching off, then on): every unit gathered twice and reduce-scattered once a
    # step; the unit computing, the one prefetched and the root unsharded at most.
    witness = _prefetch_witness(3, moved=2 * STEPS * 3)
    for rank, got in enumerate(run_ranks(_both, 3, witness=witness)):
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
@pytest.mark.evidence("memory")
def test_prefetch_follows_a_changed_order_and_frees_units_that_never_run():
    world_size = 2
    expected = _train_reordered_single_process(world_size)
    full = full_params_of(expected)
    witness = _prefetch_witness(world_size, moved=len(ORDERS) * 3)  # a step per order; SGD, no state
    for rank, got in enumerate(run_ranks(_reorder, world_size, witness=witness)):
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
        for step, left in got["unwaited_after_backward"].items():
            assert left == [], (
                f"rank {rank}: asynchronous collectives of step {step} (blocks run: {ORDERS[step]}) never waited on "
                f"when backward returned: {left}. A unit prefetched by the recorded order that then never ran is "
                f"freed at the end of backward: wait on its all-gather handles before freeing its buffer (on a GPU "
                f"the all-gather may still be writing into that memory)")
        worst = got["max_unsharded"][RELEARNED_STEP]
        assert worst <= 2, (f"rank {rank}: {worst} non-root units were unsharded at once at step {RELEARNED_STEP} "
                            f"(at most 2: the one computing and the one prefetched by the current order)")
        check_flat_params(got["flat"], expected, [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["shard"], expected_shard(desc, full), (
                f"rank {rank}: unit '{desc['prefix'] or '<root>'}' after {len(ORDERS)} steps with changing block "
                f"orders and a skipped block, against single-process training: a prefetched gather must never "
                f"serve parameters of an earlier step"))


@pytest.mark.weight(1)
@pytest.mark.evidence("memory")
def test_prefetch_with_a_block_run_twice_keeps_two_units_unsharded():
    """Block 0 runs again after block 3 (blocks 0-3-... of 4): the unit after it in the recorded order (block 1) has
    already run in this forward, so prefetching it now would keep it unsharded, unused, through the backward of
    blocks 3 and 2: three non-root units at once."""
    world_size = 2
    expected = _train_reordered_single_process(world_size, TWICE)
    full = full_params_of(expected)
    # Block 0 runs twice a step: up to two more gathers of it, and one more unit alive (its second run's).
    witness = _prefetch_witness(world_size, unsharded=4, moved=len(TWICE) * 4)
    for rank, got in enumerate(run_ranks(_reorder, world_size, TWICE, witness=witness)):
        for step, worst in got["max_unsharded"].items():
            assert worst <= 2, (
                f"rank {rank}: step {step}, blocks run in the order {TWICE[step]}: {worst} non-root units were "
                f"unsharded at once (at most 2). When a unit runs a second time, the unit after it in the "
                f"recorded order has already run in this forward: do not prefetch it again")
        for step, left in got["unsharded_after_backward"].items():
            assert left == [], f"rank {rank}: units still unsharded after backward of step {step}: {left}"
        check_flat_params(got["flat"], expected, [f"blocks.{i}." for i in range(CFG.n_layer)] + [""], f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["shard"], expected_shard(desc, full),
                         f"rank {rank}: unit '{desc['prefix'] or '<root>'}' after {len(TWICE)} steps with block 0 "
                         f"run twice, against single-process training")


@pytest.mark.weight(2)
@pytest.mark.evidence("memory")
def test_prefetch_with_frozen_embedding_and_a_fully_frozen_unit():
    """As Task 4's hidden LoRA test, with prefetching on: the first block's input needs no gradient and one block
    has no trainable parameter; at most two non-root units unsharded, gradients and one AdamW step as one process."""
    world_size = 2
    witness = lora_witness(world_size, prefetch=True, freeze_embedding=True, frozen_block=2)
    check_lora(run_ranks(lora_run, world_size, 6, True, True, 2, witness=witness), world_size, prefetch=True,
               freeze_embedding=True, frozen_block=2)
