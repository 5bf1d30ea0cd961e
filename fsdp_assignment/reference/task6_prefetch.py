"""Task 6: prefetching.

Without prefetching, each unit's all-gather sits on the critical path: compute waits for communication.
With it, the all-gather of the unit that runs next is issued asynchronously while the current unit computes
(forward and backward), and reduce-scatters run asynchronously behind the next unit's backward.

What "next" means is learned, not assumed: the order in which units ran their forward is recorded every
iteration. Forward prefetch uses the order of the previous forward (the first iteration prefetches nothing);
backward runs the units in the reverse of the forward just recorded.

Invariants: prefetching never changes a single number (results are bitwise identical with it on or off);
at most two non-root units are unsharded at any moment (the one computing and the one prefetched); an
all-gather in flight is always waited on before its buffer is used or freed.
"""

from __future__ import annotations

import torch.nn as nn

from ..support.state import FSDPUnit, ShardedState, fsdp_units
from .task3_forward import unshard


def set_prefetch(module: nn.Module, enabled: bool) -> None:
    """Turn prefetching (forward and backward all-gather prefetch, async reduce-scatter) on or off for the
    tree of units rooted at ``module`` (a module passed to ``fully_shard``). Off by default."""
    units = fsdp_units(module)
    if not units or units[0].module is not module:
        raise ValueError("set_prefetch: call it on the root module, after fully_shard(root)")
    if units[0].shared is None:
        from .task7_fully_shard import lazy_init
        lazy_init(units[0])
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
    """Issue the async all-gather of the unit that ran right after ``unit`` in the previous forward."""
    order = unit.shared.forward_order
    if unit in order:
        i = order.index(unit)
        if i + 1 < len(order):
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
