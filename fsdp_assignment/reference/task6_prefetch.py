"""Task 6: prefetching.

With prefetching on, the all-gather of the unit that runs next is issued asynchronously while the current unit
computes, in forward and in backward, and reduce-scatters run asynchronously behind the next unit's backward.
"Next" is learned, not assumed: forward prefetch follows the order of the previous iteration's forward (the first
iteration prefetches nothing in forward), and backward runs the units in the reverse of the forward just run. A
model may change that order between iterations, skip a unit, or run one twice.

The tests observe, with prefetching on (``shared.prefetch``), from the order in which counted collectives are
issued relative to every module's forward and backward:

- results are bitwise identical with prefetching on or off, with collectives that finish late (an asynchronous
  result reads as NaN until its handle is waited on);
- forward: each unit's all-gather but the first one's (the root's) is asynchronous (``async_op=True``) and
  issued before the forward computation of the unit that ran before it in the previous forward begins;
- backward: the units are all-gathered in the reverse of this forward's order, each asynchronously, before the
  backward computation of the unit whose backward precedes it begins and before that unit's reduce-scatter (the
  last unit of the forward: before its own backward computation, the root's backward running first);
- reduce-scatters: all asynchronous, at most one in flight at any moment, each still in flight when the backward
  reaches the next unit (what it reads kept alive until it is waited on: a backend's handle need not keep
  it), all landed in ``shard.grad``, in issue order, when ``loss.backward()`` returns;
- at most two non-root units unsharded at any moment (the one computing, the one prefetched; with nested units,
  plus the units the one computing is nested in), also during an
  activation-checkpointing recomputation, after an order change and with a unit run twice; each unit that runs once
  all-gathered exactly once per forward, and once per backward if it was resharded after forward (a unit run
  twice: not counted); an all-gather in flight is
  waited on before its buffer is used or freed; a unit prefetched that then does not run is resharded, its gather
  waited on, by the end of backward, and never serves stale parameters;
- after an order change, the first forward may still prefetch by the old order; the next one follows the new.

Off, everything behaves as Task 4's: nothing is gathered before its own unit's pre-forward or pre-backward, and
reduce-scatters are synchronous. ``set_prefetch`` between two iterations is in effect in the very next one.

Problems to solve: a forward that runs during backward (an activation-checkpointing recomputation) is not a new
iteration; a unit that runs a second time at the end of a forward; a unit prefetched that then does not run.
Stuck? ``hints/task6/`` has, per topic, a question, a mechanism and a recipe (one file each).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..support.state import FSDPUnit, ShardedState, SharedState, fsdp_units, init_shared_state
from .task2_flat_param import FlatParameter
from .task3_forward import unshard
from .task4_backward import BackwardHooks, _in_backward, accumulate_shard_grad, reduce_scatter_grad


def set_prefetch(module: nn.Module, enabled: bool) -> None:
    """Turn prefetching (forward and backward all-gather prefetch, async reduce-scatter) on or off for the
    tree of units rooted at ``module`` (the root unit's module): afterwards ``shared.prefetch`` says which.
    Off by default. Works before the tree's first forward too, when no ``SharedState`` exists yet
    (``init_shared_state`` is provided); ``ValueError`` when ``module`` is not a unit's module. It may be
    called between any two iterations, and takes effect in the very next one: backward prefetch and
    asynchronous reduce-scatters at once, forward prefetch at the latest once a forward with prefetching on has
    recorded the order (earlier, by an order recorded before, is allowed); switched off, nothing is gathered ahead any more (no backward prefetch by an order recorded earlier)
    and reduce-scatters are synchronous again."""
    units = fsdp_units(module)
    if not units or units[0].module is not module:
        raise ValueError("set_prefetch: call it on the root module, after fully_shard(root)")
    if units[0].shared is None:
        init_shared_state(units[0])
    units[0].shared.prefetch = enabled


def record_forward_order(unit: FSDPUnit) -> None:
    """Suggested helper (the tests do not call it): note that ``unit``'s forward has begun, for the order
    the prefetches follow: the previous forward's whole order (forward prefetch) and this forward's so far
    (backward prefetch, and what already ran). ``SharedState`` provides fields for both; any structure works."""
    # The root (shared.units[0]) starts a new recording; the finished recording of the previous forward becomes
    # shared.forward_order. A unit run twice is recorded once.
    shared = unit.shared
    if unit is shared.units[0]:
        if shared.recording_order:
            shared.forward_order = shared.recording_order
        shared.recording_order = []
    if unit not in shared.recording_order:
        shared.recording_order.append(unit)


def _issue_unshard(unit: FSDPUnit) -> None:
    if unit.sharded_state == ShardedState.SHARDED and not unit.pending_unshard:
        for flat_param in unit.flat_params:
            unit.pending_unshard.append(unshard(flat_param, unit.group, param_dtype=unit.param_dtype, async_op=True))


def prefetch_forward(unit: FSDPUnit) -> None:
    """Suggested helper: issue, asynchronously, the all-gather of the unit expected to run after ``unit``
    in this forward, within the module docstring's bounds. Task 3's ``wait_for_unshard`` waits on the handles
    it finds in the prefetched unit's ``pending_unshard`` instead of gathering again."""
    # The unit that ran right after ``unit`` in the previous forward, unless it has already run in this one
    # (``unit`` runs a second time, after its successor: the successor's gather would go unused until backward,
    # a third unit unsharded all along).
    shared = unit.shared
    order = shared.forward_order
    if unit in order:
        i = order.index(unit)
        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:
            _issue_unshard(order[i + 1])


def prefetch_backward(unit: FSDPUnit) -> None:
    """Suggested helper: issue, asynchronously, the all-gather of the unit whose backward runs right after
    ``unit``'s (the module docstring's backward order; the root's backward runs first, although it also ran
    first in forward)."""
    # The one that ran right before ``unit`` in this iteration's forward; for the root (first in forward, first
    # in backward: the loss is its output) the last one to run forward.
    order = unit.shared.recording_order
    if unit in order:
        i = order.index(unit)
        if i >= 1:
            _issue_unshard(order[i - 1])
        elif len(order) > 1:
            _issue_unshard(order[-1])


class PrefetchHooks(BackwardHooks):
    """Task 4's life cycle plus prefetching, while ``unit.shared.prefetch`` is on (read at every use, never
    cached); with prefetching off, exactly Task 4's. The tests call only ``PrefetchHooks().register(unit)``;
    Task 7's ``fully_shard`` registers this class."""

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Task 4's ``pre_forward``; with prefetching on, also the forward's share of the order and of the
        forward prefetch (the module docstring's rules, bound included). A forward that runs during backward
        (an activation-checkpointing recomputation) neither records the order nor prefetches."""
        # Record, then Task 4's pre_forward (the unit's own all-gather waited on first), then prefetch: so at most
        # this unit and the next one are unsharded. _in_backward(): a recomputation.
        if not unit.shared.prefetch or _in_backward():
            return super().pre_forward(unit, args, kwargs)
        record_forward_order(unit)
        args, kwargs = super().pre_forward(unit, args, kwargs)
        prefetch_forward(unit)
        return args, kwargs

    def pre_backward(self, unit: FSDPUnit) -> None:
        """Task 4's ``pre_backward``, then, with prefetching on (only then), ``prefetch_backward(unit)``: the
        next unit's all-gather is issued before this unit's backward computation starts."""
        super().pre_backward(unit)
        if unit.shared.prefetch:
            prefetch_backward(unit)

    def reduce_scatter(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """With prefetching on: the reduce-scatter is asynchronous, at most one is in flight at any moment,
        and it is still in flight when the backward reaches the next unit (the module docstring); its input
        must stay alive until the collective has read it, and its result lands in ``shard.grad`` by the end of
        backward (``wait_for_reductions``). Off: Task 4's synchronous ``reduce_scatter``."""
        # Issue async, keep (work, flat_param, grad_shard, grad) in shared.pending_reduce_scatters (grad stays
        # referenced until the collective has read it), then finish the older ones: the new one overlaps the
        # next unit's backward and is finished when the next is issued or in wait_for_reductions.
        shared = unit.shared
        if not shared.prefetch:
            return super().reduce_scatter(unit, flat_param, grad)
        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)
        shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))
        while len(shared.pending_reduce_scatters) > 1:
            _finish_reduce_scatter(shared.pending_reduce_scatters.pop(0))

    def wait_for_reductions(self, shared: SharedState) -> None:
        """Finish every reduction still in flight: each lands in ``shard.grad``, in issue order."""
        for pending in shared.pending_reduce_scatters:
            _finish_reduce_scatter(pending)
        shared.pending_reduce_scatters.clear()


def _finish_reduce_scatter(pending) -> None:
    work, flat_param, grad_shard, _input = pending
    work.wait()
    accumulate_shard_grad(flat_param, grad_shard)
