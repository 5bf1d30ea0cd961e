"""Task 6: prefetching.

Without prefetching, each unit's all-gather sits on the critical path: compute waits for communication.
With it, the all-gather of the unit that runs next is issued asynchronously while the current unit computes
(forward and backward), and reduce-scatters run asynchronously behind the next unit's backward.

What "next" means is learned, not assumed: the order in which units ran their forward is recorded every
iteration. Forward prefetch uses the order of the previous forward (the first iteration prefetches nothing);
backward runs the units in the reverse of the forward just recorded.

Invariants: prefetching never changes a single number (results are bitwise identical with it on or off);
at most two non-root units are unsharded at any moment (the one computing and the one prefetched), during
an activation-checkpointing recomputation too; each unit is all-gathered exactly once per forward, and once
per backward if it was resharded after forward (a prefetched unit waits on its own handle and uses that
gather, it never gathers again); an all-gather in flight is always waited on before its buffer is used or
freed; every asynchronous reduce-scatter has landed in ``shard.grad`` when ``loss.backward()`` returns.

Prefetching is checked to happen, not only to stay within bounds (from the order in which a test's counted
collectives are issued relative to every module's forward and backward): with it on, the next unit's all-gather
is issued before the current unit's forward ends (once a forward has recorded the order) and before the current
unit's backward computation ends, and each reduce-scatter is still in flight when the backward reaches the next
unit; with it off, no unit is all-gathered before its own pre-forward or pre-backward. ``set_prefetch`` between
two iterations is in effect in the very next one.
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
    tree of units rooted at ``module`` (the root unit's module), by setting ``shared.prefetch``. Off by
    default. Before the tree's first forward there is no ``SharedState`` yet: create it with
    ``init_shared_state`` (provided), as Task 7's lazy init would; raise ``ValueError`` when ``module`` is
    not a unit's module. It may be called between any two iterations, and takes effect in the very next
    one: backward prefetch and asynchronous reduce-scatters at once, forward prefetch once a forward with
    prefetching on has recorded the order; switched off, nothing is gathered ahead any more (no backward
    prefetch by an order recorded earlier) and reduce-scatters are synchronous again."""
    units = fsdp_units(module)
    if not units or units[0].module is not module:
        raise ValueError("set_prefetch: call it on the root module, after fully_shard(root)")
    if units[0].shared is None:
        init_shared_state(units[0])
    units[0].shared.prefetch = enabled


def record_forward_order(unit: FSDPUnit) -> None:
    """Called at the start of each unit's forward: append ``unit`` to the order being recorded. The first
    unit of the tree (``shared.units[0]``, the root) starts a new recording; the finished recording of the
    previous forward becomes ``shared.forward_order``."""
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
    """Issue the async all-gather of the unit that ran right after ``unit`` in the previous forward, unless
    that unit has already run in this forward (``unit`` runs a second time, after its successor: the
    successor's gather would go unused until backward, a third unit unsharded all along)."""
    shared = unit.shared
    order = shared.forward_order
    if unit in order:
        i = order.index(unit)
        if i + 1 < len(order) and order[i + 1] not in shared.recording_order:
            _issue_unshard(order[i + 1])


def prefetch_backward(unit: FSDPUnit) -> None:
    """Issue the async all-gather of the unit whose backward runs after ``unit``'s: the one that ran right
    before it in this iteration's forward. The root is the exception: it ran first in forward, and its
    backward starts first (the loss is its output), so the unit after it is the last one to run forward."""
    order = unit.shared.recording_order
    if unit in order:
        i = order.index(unit)
        if i >= 1:
            _issue_unshard(order[i - 1])
        elif len(order) > 1:
            _issue_unshard(order[-1])


class PrefetchHooks(BackwardHooks):
    """Task 4's life cycle plus prefetching, active while ``unit.shared.prefetch`` is on: forward and
    backward all-gather prefetch, and asynchronous reduce-scatters (at most one in flight). With prefetching
    off every method behaves exactly as Task 4's. Task 7's ``fully_shard`` registers this class."""

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """With prefetching on: ``record_forward_order(unit)``, then Task 4's ``pre_forward`` (the unit's own
        all-gather is waited on first), then ``prefetch_forward(unit)``: so at most this unit and the next
        one are unsharded. A forward that runs during backward (activation checkpointing recomputation:
        ``torch._C._current_graph_task_id() != -1``) neither records nor prefetches."""
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
        """With prefetching on: issue the reduce-scatter asynchronously and append ``(work, flat_param,
        grad_shard, grad)`` to ``shared.pending_reduce_scatters`` (``grad`` stays referenced until the
        collective has read it); then finish the older ones (wait, ``accumulate_shard_grad``) so that at
        most one is in flight. The new one is not waited on here: it overlaps the next unit's backward and is
        finished when the next one is issued or in ``wait_for_reductions`` (waiting at once overlaps nothing;
        a test checks that it is still in flight when the backward reaches the next unit). Off: Task 4's
        synchronous ``reduce_scatter``."""
        shared = unit.shared
        if not shared.prefetch:
            return super().reduce_scatter(unit, flat_param, grad)
        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)
        shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))
        while len(shared.pending_reduce_scatters) > 1:
            _finish_reduce_scatter(shared.pending_reduce_scatters.pop(0))

    def wait_for_reductions(self, shared: SharedState) -> None:
        """Finish every pending reduce-scatter (wait, then ``accumulate_shard_grad``), in issue order."""
        for pending in shared.pending_reduce_scatters:
            _finish_reduce_scatter(pending)
        shared.pending_reduce_scatters.clear()


def _finish_reduce_scatter(pending) -> None:
    work, flat_param, grad_shard, _input = pending
    work.wait()
    accumulate_shard_grad(flat_param, grad_shard)
