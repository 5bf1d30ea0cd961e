"""Task 6, staff alternative: the prefetch schedule is two successor maps, and the forward prefetch goes first.

The reference keeps two lists on ``SharedState`` (the order being recorded and the last one) and looks a unit
up in them (``list.index``) at each prefetch. This one keeps, on the tree's ``SharedState``, a record of the
forward in progress and two dicts built from finished records: ``unit -> the unit that ran after it`` for the
forward prefetch and ``unit -> the unit whose backward comes next`` for the backward prefetch, so a prefetch
is one dict lookup. It also records the order in every forward, prefetching on or off (the reference records
only with prefetching on), so a ``set_prefetch(True)`` prefetches by the order of the forward just before it.

It issues the forward prefetch at another point: at the start of the unit's pre-forward, before waiting on the
unit's own all-gather, not after it. At that moment the previous unit has already been freed by its
post-forward, so this unit and the next one are still the only non-root units unsharded. Backward prefetch is
issued in the pre-backward, after the unit's own gather (before it, three units could be unsharded at once: the
unit just finished is freed by a hook that may run after).

Reduce-scatters go asynchronous with prefetching on, at most one in flight, kept in the provided
``SharedState.pending_reduce_scatters`` (Task 7's HSDP hooks add theirs there too).

Written to the contract of ``fsdp_assignment/task6_prefetch.py`` (``set_prefetch``, ``PrefetchHooks``).
Staff only: see staff/alternatives/README.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .support.state import FSDPUnit, ShardedState, SharedState, fsdp_units, init_shared_state
from .task2_flat_param import FlatParameter
from .task3_forward import unshard
from .task4_backward import BackwardHooks, _in_backward, accumulate_shard_grad, reduce_scatter_grad


def set_prefetch(module: nn.Module, enabled: bool) -> None:
    units = fsdp_units(module)
    if not units or units[0].module is not module:
        raise ValueError("set_prefetch: pass the root module (the one fully_shard was applied to last)")
    shared = units[0].shared or init_shared_state(units[0])
    shared.prefetch = enabled


class _Schedule:
    """What prefetching knows about the order units run in, kept on the tree's ``SharedState``.

    ``running``: the units of the forward in progress, in first-run order (a dict used as an ordered set).
    ``after``: from the last finished forward, each unit -> the unit that ran next (forward prefetch).
    ``backward_next``: built lazily from ``running`` at the first pre-backward after a forward: each unit ->
    the unit whose backward runs next (the one that ran before it; the root, first in forward and first in
    backward because the loss is its output, -> the last unit to run)."""

    def __init__(self):
        self.running: dict[FSDPUnit, None] = {}
        self.after: dict[FSDPUnit, FSDPUnit] = {}
        self.backward_next: dict[FSDPUnit, FSDPUnit] | None = None

    def forward_started(self, unit: FSDPUnit, root: FSDPUnit) -> None:
        if unit is root:  # a new forward: the one just finished becomes the forward schedule
            if self.running:
                order = list(self.running)
                self.after = dict(zip(order, order[1:]))
            self.running = {}
        self.running.setdefault(unit, None)
        self.backward_next = None

    def next_in_backward(self, unit: FSDPUnit) -> FSDPUnit | None:
        if self.backward_next is None:
            order = list(self.running)
            self.backward_next = dict(zip(order[1:], order))
            if len(order) > 1:
                self.backward_next[order[0]] = order[-1]
        return self.backward_next.get(unit)


def _schedule(shared: SharedState) -> _Schedule:
    if not hasattr(shared, "_alt_schedule"):
        shared._alt_schedule = _Schedule()
    return shared._alt_schedule


def _gather_ahead(unit: FSDPUnit | None) -> None:
    """Issue ``unit``'s all-gathers asynchronously, unless it is unsharded or on its way already."""
    if unit is None or unit.pending_unshard or unit.sharded_state is ShardedState.UNSHARDED:
        return
    unit.pending_unshard = [unshard(fp, unit.group, param_dtype=unit.param_dtype, async_op=True)
                            for fp in unit.flat_params]


class PrefetchHooks(BackwardHooks):
    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        shared = unit.shared
        if _in_backward():  # a checkpoint's recomputation: neither recorded nor a reason to prefetch
            return super().pre_forward(unit, args, kwargs)
        schedule = _schedule(shared)
        schedule.forward_started(unit, shared.units[0])
        if shared.prefetch:
            successor = schedule.after.get(unit)
            # A successor that already ran in this forward (this unit runs a second time) would sit unsharded,
            # unused, until backward: not prefetched.
            if successor is not None and successor not in schedule.running:
                _gather_ahead(successor)
        return super().pre_forward(unit, args, kwargs)

    def pre_backward(self, unit: FSDPUnit) -> None:
        super().pre_backward(unit)
        if unit.shared.prefetch:
            _gather_ahead(_schedule(unit.shared).next_in_backward(unit))

    def reduce_scatter(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        shared = unit.shared
        if not shared.prefetch:
            return super().reduce_scatter(unit, flat_param, grad)
        # The one in flight before is finished first: at most one in flight, and the new one overlaps the
        # next unit's backward (it is finished when the next one is issued, or at the end of backward).
        self.wait_for_reductions(shared)
        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)
        shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))  # grad: alive until read

    def wait_for_reductions(self, shared: SharedState) -> None:
        while shared.pending_reduce_scatters:
            work, flat_param, grad_shard, _ = shared.pending_reduce_scatters.pop(0)
            work.wait()
            accumulate_shard_grad(flat_param, grad_shard)
