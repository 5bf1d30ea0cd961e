"""Task 6: prefetching (execution order, async all-gather in forward and backward, async reduce-scatter)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.common import assert_close, check_flat_params, describe_flat_params, expected_shard, full_params_of
from tests.public.collectives import gathered_unit, use_counted_collectives
from tests.public.common import WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, hand_shard_gpt, local_batch, witness_for
from tests.public.invariants import check_monitor
from tests.public.monitor import Monitor
from tests.public.test_task4_backward import (check_checkpointing, check_lora, checkpointing_run,
                                             checkpointing_witness, lora_run, lora_witness)

pytestmark = pytest.mark.task6

CFG = GPTConfig(n_layer=4)


GPT_UNITS = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]  # hand_shard_gpt: the blocks, then the root


def _train(rank, world_size, prefetch, steps=3, log=None, reports=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    mon = Monitor(model, GPT_UNITS, log)  # the invariant monitor (tests/public/monitor.py)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = prefetch
    mon.attach().setting(prefetch=prefetch)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        mon.backward(gpt_loss(model, idx, tgt))
        optim.step()
        mon.after_step()
    if reports is not None:
        reports.append(mon.report())
    return model


def _bitwise(rank, world_size):
    # Collectives finish late (their outputs hold NaN until wait()), as on a GPU: a prefetched all-gather or an
    # asynchronous reduce-scatter used before its handle is waited on changes the numbers here.
    log, reports = use_counted_collectives(late=True), []
    out = {p: [prm.detach().clone() for prm in _train(rank, world_size, p, log=log, reports=reports).parameters()]
           for p in (False, True)}
    return {**out, "monitors": reports}


@pytest.mark.evidence("bytes", "memory")
def test_prefetch_changes_no_number():
    model = GPT(CFG)
    # Two trainings of 3 SGD steps (momentum on the shards), prefetching off then on: each step gathers every unit
    # twice and reduce-scatters it once; at most the unit computing, the one prefetched and the root unsharded.
    witness = witness_for(lambda: GPT(CFG), GPT_UNITS, 2, models=2, shard_copies=3, unsharded=3,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, moved=2 * 3 * 3)
    for rank, got in enumerate(run_ranks(_bitwise, 2, witness=witness)):
        for report, prefetch in zip(got["monitors"], (False, True)):
            check_monitor(report, model, 2, f"rank {rank}, prefetch={prefetch}")
            reductions = [c["async_op"] for it in report["iterations"] for c in it["backward_calls"]
                          if c["kind"] == "reduce_scatter"]
            assert reductions, f"rank {rank}, prefetch={prefetch}: the monitor counted no reduce-scatter in backward"
            assert all(reductions) if prefetch else not any(reductions), (
                f"rank {rank}: with prefetching {'on' if prefetch else 'off'}, {sum(reductions)} of "
                f"{len(reductions)} reduce-scatters were issued with async_op=True; set_prefetch turns the "
                f"asynchronous reduce-scatter on and off with the all-gather prefetch: on, every reduce-scatter is "
                f"asynchronous (at most one in flight); off, Task 4's synchronous one")
        for off, on in zip(got[False], got[True]):
            assert not on.isnan().any(), (
                f"rank {rank}: NaN in the parameters with prefetching on. In this test a collective's output holds NaN "
                f"until its handle's wait() is called: wait on every async all-gather and reduce-scatter before using "
                f"its result")
            assert torch.equal(off, on), f"rank {rank}: parameters after 3 steps differ with prefetching on vs off"


def _trace(rank, world_size):
    """One warm-up step (records the order), then a traced step: every collective (in issue order, whichever
    way it is called), every block's forward, and the first backward computation inside every block."""
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    units = adapters.fsdp_units(model)
    blocks = [b._fsdp_unit for b in model.blocks]
    events, unsharded_counts = [], []
    tracing = [False]

    def count_unsharded():
        unsharded_counts.append(sum(any(fp.is_unsharded() for fp in u.flat_params) for u in units if not u.is_root))

    def on_collective(call, output, sent):
        if not tracing[0] or call.kind not in ("all_gather", "reduce_scatter"):
            return
        which = None
        if call.kind == "all_gather":  # identify the unit by the shard it sends, not by where it writes
            which = gathered_unit(sent, {**dict(enumerate(blocks)), "root": root})
        events.append(("ag" if call.kind == "all_gather" else "rs", which, call.async_op))
        count_unsharded()

    log.listener = on_collective

    def forward_started(i):
        def hook(module, args):
            events.append(("fwd", i, None))
            count_unsharded()
        return hook

    def backward_started(i):
        # The gradient of the block's last layer's output: the block's first backward computation comes next.
        def hook(module, args, output):
            if torch.is_grad_enabled() and tracing[0]:
                output.register_hook(lambda grad: events.append(("bwd", i, None)))
        return hook

    for i, block in enumerate(model.blocks):
        # Registered after FSDP's hooks, so they run once FSDP's pre-forward has done its work.
        block.register_forward_pre_hook(forward_started(i))
        block.mlp.c_proj.register_forward_hook(backward_started(i))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        tracing[0] = step == 1
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        loss = gpt_loss(model, idx, tgt)
        if step == 1:
            events.append(("backward", None, None))
        loss.backward()
        optim.step()
    return {"events": events, "max_unsharded": max(unsharded_counts)}


@pytest.mark.evidence("bytes", "memory")
def test_prefetch_order_and_at_most_two_units_unsharded():
    n = CFG.n_layer
    # A warm-up step and a traced one (SGD): at most two blocks and the root unsharded; every unit moved 3 times a step.
    witness = witness_for(lambda: GPT(CFG), GPT_UNITS, 2, shard_copies=3, unsharded=3,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, moved=2 * 3)
    for rank, got in enumerate(run_ranks(_trace, 2, witness=witness)):
        events = got["events"]
        split = events.index(("backward", None, None))
        fwd, bwd = events[:split], events[split + 1:]
        pos = {e: i for i, e in enumerate(fwd)}
        for i in range(n - 1):
            ag = next((j for j, e in enumerate(fwd) if e[0] == "ag" and e[1] == i + 1), None)
            assert ag is not None, f"rank {rank}: no all-gather for block {i + 1} in forward"
            assert fwd[ag][2], f"rank {rank}: the forward prefetch of block {i + 1} must be async (async_op=True)"
            assert ag < pos[("fwd", i, None)], \
                f"rank {rank}: block {i + 1}'s all-gather must be issued before block {i}'s forward computes " \
                f"(forward prefetch); forward events: {fwd}"
        bwd_ags = [e[1] for e in bwd if e[0] == "ag" and e[1] != "root"]
        assert bwd_ags == list(range(n - 1, -1, -1)), \
            f"rank {rank}: backward must all-gather the blocks in reverse forward order, got {bwd_ags}"
        rs_positions = [j for j, e in enumerate(bwd) if e[0] == "rs"]
        last = next((j for j, e in enumerate(bwd) if e[:2] == ("ag", n - 1)), None)
        assert last is not None and bwd[last][2] and last < bwd.index(("bwd", n - 1, None)), (
            f"rank {rank}: block {n - 1}, the last to run forward, must be prefetched (async_op=True) when backward "
            f"starts, in the root's pre-backward (the root's backward runs first: the loss is its output); "
            f"backward events: {bwd}")
        for k in range(1, n):  # block n-k's reduce-scatter is the k-th; block n-1-k must be gathered before it
            ag = next((j for j, e in enumerate(bwd) if e[:2] == ("ag", n - 1 - k)), None)
            assert ag is not None and bwd[ag][2], \
                f"rank {rank}: block {n - 1 - k} must be prefetched (async_op=True) in backward; backward events: {bwd}"
            started = bwd.index(("bwd", n - k, None))
            assert ag < started, (
                f"rank {rank}: block {n - 1 - k}'s backward prefetch must be issued before block {n - k}'s backward "
                f"starts computing (in block {n - k}'s pre-backward), so that it overlaps that computation; it came "
                f"after. Backward events: {bwd}")
            assert len(rs_positions) >= k and ag < rs_positions[k - 1], \
                f"rank {rank}: block {n - 1 - k} must be prefetched (async) before block {n - k}'s reduce-scatter; " \
                f"backward events: {bwd}"
        assert got["max_unsharded"] <= 2, \
            f"rank {rank}: {got['max_unsharded']} non-root units were unsharded at once (at most 2: current + next)"


# ---- Frozen units (LoRA) and activation checkpointing, with prefetching (Task 4's bodies, Task 6's hooks) ----
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.evidence("memory")
def test_prefetch_with_frozen_base_weights(world_size):
    """LoRA-style blocks with prefetching on: adapter gradients and one AdamW step equal one process; at most two
    non-root units unsharded (the one computing and the one prefetched) at any sampled moment; none after."""
    check_lora(run_ranks(lora_run, world_size, 6, True, witness=lora_witness(world_size, prefetch=True)), world_size,
               prefetch=True)


@pytest.mark.evidence("memory")
def test_prefetch_with_activation_checkpointing():
    """Activation checkpointing (around each unit, around a block inside a unit) with prefetching on: gradients
    equal one process, at most two non-root units unsharded, recomputation included: a forward that runs during
    backward neither records the order nor prefetches."""
    check_checkpointing(run_ranks(checkpointing_run, 2, 6, True, timeout=90,
                                  witness=checkpointing_witness(2, prefetch=True)), 2, prefetch=True)


# ---- A unit prefetched that then does not run, a unit run a second time at the end of a forward (problems the module
# docstring poses): waited on and freed by the end of backward, never serving stale parameters, never a third unit
# unsharded.
class SkippingGPT(GPT):
    """GPT whose blocks run in ``self.order`` (block indices; a block left out is skipped this iteration)."""

    order: list[int]

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i in self.order:
            x = self.blocks[i](x)
        return self.lm_head(self.ln_f(x))


# Step 1 skips block 1, which step 0's order prefetches while block 0 computes; step 2 runs it again, and block 0
# a second time at the end of the forward (a unit that already ran is not prefetched again), as does step 3.
SKIP_ORDERS = [[0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3, 0], [0, 1, 2, 3, 0]]


def _skip_a_prefetched_unit(rank, world_size):
    log = use_counted_collectives(late=True)  # a gather still in flight holds NaN and is listed as unwaited
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    units = adapters.fsdp_units(model)
    unsharded, unwaited, most = [], [], []

    def count_unsharded(call, output, sent):  # at every collective issued: the non-root units unsharded
        most[-1] = max(most[-1], sum(any(fp.is_unsharded() for fp in u.flat_params) for u in units if not u.is_root))

    log.listener = count_unsharded
    for step, order in enumerate(SKIP_ORDERS):
        model.order = order
        most.append(0)
        mark = log.mark()
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        unsharded.append([i for i, u in enumerate(adapters.fsdp_units(model))
                          if any(fp.is_unsharded() for fp in u.flat_params)])
        unwaited.append([(c["kind"], c["numel"]) for c in log.unwaited(mark)])
        optim.step()
    log.listener = None
    return {"unsharded": unsharded, "unwaited": unwaited, "most": most, "flat": describe_flat_params(model)}


@pytest.mark.evidence("memory")
def test_prefetch_with_a_skipped_unit_and_a_unit_run_twice():
    world_size = 2
    # Memory only (a skipped or repeated unit changes what is gathered): three units unsharded at most, SGD's step.
    witness = witness_for(lambda: SkippingGPT(CFG), GPT_UNITS, world_size, unsharded=3,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES)
    witness.sent_bytes = None
    results = run_ranks(_skip_a_prefetched_unit, world_size, witness=witness)
    torch.manual_seed(0)
    expected = SkippingGPT(CFG)
    optim = torch.optim.SGD(expected.parameters(), lr=0.1)
    for step, order in enumerate(SKIP_ORDERS):
        expected.order = order
        idx, tgt = gpt_batch(CFG, 2 * world_size, seed=step)
        optim.zero_grad()
        gpt_loss(expected, idx, tgt).backward()
        optim.step()
    full = full_params_of(expected)
    for rank, got in enumerate(results):
        for step, order in enumerate(SKIP_ORDERS):
            where = f"rank {rank}, step {step} (blocks run: {order}, the previous forward's: {SKIP_ORDERS[step - 1]})"
            assert got["unwaited"][step] == [], (
                f"{where}: asynchronous collectives never waited on when backward returned: {got['unwaited'][step]}. "
                f"A unit prefetched that then did not run is freed by the end of backward, its all-gather waited on "
                f"first: on a GPU the gather may still be writing into the buffer")
            assert got["unsharded"][step] == [], (
                f"{where}: units {got['unsharded'][step]} (in fsdp_units order) still unsharded after backward; a "
                f"unit prefetched that then did not run must be resharded too")
            # The first forward after an order change may still prefetch by the old order (the docstring): bounded
            # where the previous forward ran the same order.
            assert step == 0 or order != SKIP_ORDERS[step - 1] or got["most"][step] <= 2, (
                f"{where}: {got['most'][step]} non-root units were unsharded at once (counted at every collective); "
                f"at most 2, the one computing and the one prefetched, also with a unit run a second time at the end "
                f"of the forward (a unit that already ran is not prefetched again)")
        check_flat_params(got["flat"], expected, GPT_UNITS, f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["shard"], expected_shard(desc, full), (
                f"rank {rank}: unit '{desc['prefix'] or '<root>'}' after {len(SKIP_ORDERS)} SGD steps with the block "
                f"orders {SKIP_ORDERS}: a prefetched gather must never serve parameters of an earlier step"))


# ---- Whatever an asynchronous collective reads stays alive until its wait() --------------------------------------
def _async_inputs(rank, world_size):
    # Late collectives whose handles hold what gloo's hold: an all-gather's input, but no reduce-scatter's
    # (tests/public/collectives.py). At every wait() the counter checks that what the collective reads still exists.
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        optim.step()
    return {"freed": log.freed_before_wait(), "async": sorted({c["kind"] for c in log.since() if c["async_op"]})}


def test_what_an_async_collective_reads_stays_alive_until_its_wait():
    for rank, got in enumerate(run_ranks(_async_inputs, 2)):
        freed = [(c["kind"], c["numel"], c["how"]) for c in got["freed"]]
        assert not freed, (
            f"rank {rank}: {len(freed)} asynchronous collectives whose input was gone before their wait() (kind, "
            f"elements per rank, what happened; the first ones): {freed[:3]}. On a GPU a collective reads its input "
            f"later, at any moment before wait() returns; memory freed before then is reused, and it reads garbage. "
            f"Hold on to whatever an asynchronous collective reads (a reduce-scatter: the padded gradient you pass "
            f"it) until you wait() on its handle: gloo's reduce_scatter_tensor handle keeps none (asynchronous "
            f"collectives issued here: {got['async']})")


# ---- After an order change, the second forward prefetches by the new order ---------------------------------------
REORDERS = [[0, 1, 2, 3], [3, 2, 1, 0], [3, 2, 1, 0], [1, 3, 0, 2], [1, 3, 0, 2]]  # blocks run, per step


def _reordered(rank, world_size):
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = SkippingGPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    units = {"root": root, **{f"block {i}": b._fsdp_unit for i, b in enumerate(model.blocks)}}
    gathered, in_forward = [], [False]

    def record(call, output, sent):  # which unit each all-gather of a forward is for, in issue order
        if call.kind == "all_gather" and in_forward[0]:
            gathered[-1].append(gathered_unit(sent, units))

    log.listener = record
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, order in enumerate(REORDERS):
        model.order, in_forward[0] = order, True
        gathered.append([])
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        loss = gpt_loss(model, idx, tgt)
        in_forward[0] = False
        loss.backward()
        optim.step()
    log.listener = None
    return {"gathered": gathered}


def test_prefetch_follows_a_new_order_from_the_second_forward_on():
    for rank, got in enumerate(run_ranks(_reordered, 2)):
        for step, order in enumerate(REORDERS):
            if step and order != REORDERS[step - 1]:
                continue  # the first forward after an order change may still prefetch by the old order
            blocks = [u for u in got["gathered"][step] if u != "root"]  # the root's: before or after the first block's
            expected = [f"block {i}" for i in order]
            assert blocks == expected, (
                f"rank {rank}, step {step}: the forward's all-gathers were issued for {got['gathered'][step]}, in "
                f"that order; the blocks ran in the order {order}, as in the forward before (step {step - 1}), so "
                f"the blocks are gathered in that order: {expected}. Prefetching follows the order the last forward "
                f"ran (the first forward after an order change may still follow the old one, the next may not)")
