"""The invariant monitor (tests/public/monitor.py + invariants.py) against PyTorch's FSDP2 and wrong variants.

Every invariant ``check_monitor`` enforces must hold on torch's own ``fully_shard`` and on the reference, and
must fail, naming itself, on an implementation that breaks it. The wrong implementations are the reference
with one piece monkeypatched inside the rank (staff-only: they import the reference directly). One spawn
runs them all, one after another, on counted collectives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_assignment.support.models import GPT, GPTConfig, gpt_loss
from tests.harness import run_ranks
from tests.public.invariants import check_monitor

CFG = GPTConfig()
UNITS = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]
WORLD_SIZE = 2


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _run(rank, world_size, log, *, impl="ours", steps=2, raf=True, schedule=None, after_shard=None,
         mixed_precision=None, forward_prefetch=True):
    """Train GPT ``steps`` steps under the monitor. ``schedule(step, model, mon)`` flips switches before a step."""
    import adapters
    from tests.public.common import local_batch
    from tests.public.monitor import Monitor
    torch.manual_seed(0)
    model = GPT(CFG)
    mon = Monitor(model, UNITS, log)
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        # FSDP2 prefetches in backward by default; in forward only where told (explicit forward prefetch)
        for block, following in zip(model.blocks, model.blocks[1:]):
            block.set_modules_to_forward_prefetch([following] if forward_prefetch else [])
    else:
        for block in model.blocks:
            adapters.fully_shard(block, reshard_after_forward=raf, mixed_precision=mixed_precision)
        adapters.fully_shard(model, reshard_after_forward=raf, mixed_precision=mixed_precision)
    if after_shard:
        after_shard(model)
    mon.attach().setting(reshard_after_forward=raf, prefetch=impl == "fsdp2")
    if mixed_precision is not None:
        mon.setting(param_dtype=str(mixed_precision.param_dtype), reduce_dtype=str(mixed_precision.reduce_dtype))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if schedule:
            schedule(step, model, mon)
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        mon.backward(gpt_loss(model, idx, tgt))
        optim.step()
        mon.after_step()
    return mon.report()


def _variants(rank, world_size):
    import adapters
    from fsdp_assignment.reference import (task2_flat_param as t2, task3_forward as t3, task4_backward as t4,
                                           task6_prefetch as t6, task7_fully_shard as t7)
    from tests.public.collectives import use_counted_collectives
    log = use_counted_collectives(late=True)
    out = {"fsdp2": _run(rank, world_size, log, impl="fsdp2"), "reference": _run(rank, world_size, log),
           # the order invariants are no formality on FSDP2 either: without its forward prefetch it fails one
           "fsdp2 without forward prefetch": _run(rank, world_size, log, impl="fsdp2", forward_prefetch=False)}

    def prefetch_on_then_off(step, model, mon):
        adapters.set_prefetch(model, step == 0)
        mon.setting(prefetch=step == 0)

    def prefetch_on_on_off(step, model, mon):  # forward prefetch needs the order its previous forward recorded
        adapters.set_prefetch(model, step < 2)
        mon.setting(prefetch=step < 2)

    out["reference, prefetch flipped off"] = _run(rank, world_size, log, steps=3, schedule=prefetch_on_on_off)
    # unsharded-bound: prefetching that stays on once it has been on (the switch is read once).
    real_set_prefetch = t6.set_prefetch

    def sticky_set_prefetch(module, enabled):
        if enabled:
            real_set_prefetch(module, True)
    with _patched(t6, "set_prefetch", sticky_set_prefetch):
        out["unsharded-bound"] = _run(rank, world_size, log, schedule=prefetch_on_then_off)
    # handles-waited: a prefetched unit's all-gather handles dropped, not waited on (it is gathered again).
    def prefetch_on(step, model, mon):
        adapters.set_prefetch(model, True)
        mon.setting(prefetch=True)
    real_wait_for_unshard = t3.wait_for_unshard

    def dropping_wait(unit):
        unit.pending_unshard.clear()
        return real_wait_for_unshard(unit)
    with _patched(t3, "wait_for_unshard", dropping_wait):
        out["handles-waited"] = _run(rank, world_size, log, schedule=prefetch_on)
    # reductions-in-flight: with prefetching, asynchronous reduce-scatters never finished before the next one.
    real_reduce_scatter = t6.PrefetchHooks.reduce_scatter

    def hoarding_reduce_scatter(self, unit, flat_param, grad):
        if not unit.shared.prefetch:
            return real_reduce_scatter(self, unit, flat_param, grad)
        work, grad_shard = t6.reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)
        unit.shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))
    with _patched(t6.PrefetchHooks, "reduce_scatter", hoarding_reduce_scatter):
        out["reductions-in-flight"] = _run(rank, world_size, log, steps=1, schedule=prefetch_on)
    # forward-gathers: every unshard all-gathers twice.
    real_unshard = t3.unshard

    def unshard_twice(flat_param, group=None, **kw):
        real_unshard(flat_param, group, **kw)
        return real_unshard(flat_param, group, **kw)
    with _patched(t3, "unshard", unshard_twice):
        out["forward-gathers"] = _run(rank, world_size, log, steps=1)
    # backward-gathers: reshard_after_forward=False ignored (every unit resharded after forward anyway).

    def force_reshard(model):
        for unit in adapters.fsdp_units(model):
            unit.reshard_after_forward = True
    out["backward-gathers"] = _run(rank, world_size, log, raf=False, after_shard=force_reshard, steps=1)
    # reduce-scatters: set_requires_gradient_sync(False) does nothing.

    def no_sync_first(step, model, mon):
        adapters.set_requires_gradient_sync(model, step > 0)
        mon.setting(requires_gradient_sync=step > 0)
    with _patched(t7, "set_requires_gradient_sync", lambda module, flag: None):
        out["reduce-scatters"] = _run(rank, world_size, log, schedule=no_sync_first)
    # freed-after-backward: the root is not resharded after its backward.
    real_reshard_unit = t4.reshard_unit
    with _patched(t4, "reshard_unit", lambda unit: None if unit.is_root else real_reshard_unit(unit)):
        out["freed-after-backward"] = _run(rank, world_size, log, steps=1)
    # no-full-copies: a FlatParameter that keeps the original parameters alive.
    real_init = t2.FlatParameter.__init__

    def keeping_init(self, module, param_names, *args, **kw):
        self._originals = [module.get_parameter(n) for n in param_names]
        real_init(self, module, param_names, *args, **kw)
    with _patched(t2.FlatParameter, "__init__", keeping_init):
        out["no-full-copies"] = _run(rank, world_size, log, steps=1)
    # dtypes-and-devices: under mixed precision, shards kept in param_dtype (bf16) instead of their own dtype.
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def bf16_shards(model):
        for unit in adapters.fsdp_units(model):
            for fp in unit.flat_params:
                fp.shard.data = fp.shard.data.to(torch.bfloat16)
    out["reference, mixed precision"] = _run(rank, world_size, log, steps=1, mixed_precision=policy)
    out["dtypes-and-devices"] = _run(rank, world_size, log, steps=1, mixed_precision=policy, after_shard=bf16_shards)
    # forward-prefetch: prefetching on, but nothing prefetched in forward.
    with _patched(t6, "prefetch_forward", lambda unit: None):
        out["forward-prefetch"] = _run(rank, world_size, log, schedule=prefetch_on)
    # backward-prefetch: the next unit is gathered only in its own pre-backward (no prefetch in backward).
    with _patched(t6, "prefetch_backward", lambda unit: None):
        out["backward-prefetch"] = _run(rank, world_size, log, steps=1, schedule=prefetch_on)
    # no-early-gathers: with prefetching off, the next unit is gathered in this unit's post-forward (right after
    # this one is resharded, so never two unsharded at once: the bound alone does not see it).
    real_post_forward = t6.PrefetchHooks.post_forward

    def gathering_post_forward(self, unit, output):
        output = real_post_forward(self, unit, output)
        order = unit.shared.forward_order
        if not unit.shared.prefetch and not unit.is_root and unit in order:
            i = order.index(unit)
            if i + 1 < len(order):
                t6._issue_unshard(order[i + 1])
        return output
    with _patched(t6.PrefetchHooks, "post_forward", gathering_post_forward):
        out["no-early-gathers"] = _run(rank, world_size, log, steps=3, schedule=prefetch_on_on_off)
    # reductions-overlap: each asynchronous reduce-scatter waited on right after it is issued.

    def waiting_reduce_scatter(self, unit, flat_param, grad):
        real_reduce_scatter(self, unit, flat_param, grad)
        self.wait_for_reductions(unit.shared)
    with _patched(t6.PrefetchHooks, "reduce_scatter", waiting_reduce_scatter):
        out["reductions-overlap"] = _run(rank, world_size, log, steps=1, schedule=prefetch_on)
    # A switch flipped between iterations is in effect in the very next one: reshard_after_forward flipped on every
    # unit (the reference passes), and an implementation that reads it once, at a unit's first forward (fails
    # backward-gathers: it still reshards, so backward gathers again).
    def reshard_then_keep(step, model, mon):
        for unit in adapters.fsdp_units(model):
            unit.reshard_after_forward = step == 0
        mon.setting(reshard_after_forward=step == 0, prefetch=True)
        adapters.set_prefetch(model, True)
    out["reference, reshard_after_forward flipped"] = _run(rank, world_size, log, schedule=reshard_then_keep)
    first_seen = {}

    def caching_post_forward(self, unit, output):
        now = unit.reshard_after_forward
        unit.reshard_after_forward = first_seen.setdefault(id(unit), now)
        try:
            return real_post_forward(self, unit, output)
        finally:
            unit.reshard_after_forward = now
    with _patched(t6.PrefetchHooks, "post_forward", caching_post_forward):
        out["backward-gathers, reshard_after_forward read once"] = _run(rank, world_size, log,
                                                                         schedule=reshard_then_keep)
    return out


@pytest.fixture(scope="module")
def reports():
    return run_ranks(_variants, WORLD_SIZE, timeout=240)


def _model():
    torch.manual_seed(0)
    return GPT(CFG)


def test_invariants_hold_on_torch_fsdp2_and_the_reference(reports):
    for rank, got in enumerate(reports):
        check_monitor(got["fsdp2"], _model(), WORLD_SIZE, f"rank {rank} torch FSDP2", layout="per_param")
        for name in ("reference", "reference, prefetch flipped off", "reference, mixed precision",
                     "reference, reshard_after_forward flipped"):
            check_monitor(got[name], _model(), WORLD_SIZE, f"rank {rank} {name}")


INVARIANTS = ["unsharded-bound", "reductions-in-flight", "handles-waited", "forward-gathers", "backward-gathers",
              "reduce-scatters", "freed-after-backward", "no-full-copies", "dtypes-and-devices", "forward-prefetch",
              "backward-prefetch", "no-early-gathers", "reductions-overlap"]


def test_a_switch_read_once_fails(reports):
    with pytest.raises(AssertionError, match="invariant backward-gathers:.*iteration 1"):
        check_monitor(reports[0]["backward-gathers, reshard_after_forward read once"], _model(), WORLD_SIZE, "rank 0")


def test_torch_fsdp2_without_forward_prefetch_fails_forward_prefetch(reports):
    with pytest.raises(AssertionError, match="invariant forward-prefetch:"):
        check_monitor(reports[0]["fsdp2 without forward prefetch"], _model(), WORLD_SIZE, "rank 0", layout="per_param")


@pytest.mark.parametrize("invariant", INVARIANTS)
def test_each_invariant_fails_on_a_wrong_implementation(reports, invariant):
    with pytest.raises(AssertionError, match=f"invariant {invariant}:") as info:
        check_monitor(reports[0][invariant], _model(), WORLD_SIZE, "rank 0")
    assert "rank 0" in str(info.value) and ("iteration" in str(info.value) or "after" in str(info.value))
