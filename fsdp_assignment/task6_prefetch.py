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
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.nn as nn
from .support.state import FSDPUnit, ShardedState, SharedState, fsdp_units, init_shared_state
from .task2_flat_param import FlatParameter
from .task3_forward import unshard
from .task4_backward import BackwardHooks, accumulate_shard_grad, reduce_scatter_grad


def set_prefetch(module: nn.Module, enabled: bool) -> None:
    """Turn prefetching (forward and backward all-gather prefetch, async reduce-scatter) on or off for the
    tree of units rooted at ``module`` (the root unit's module): afterwards ``shared.prefetch`` says which.
    Off by default. Works before the tree's first forward too, when no ``SharedState`` exists yet
    (``init_shared_state`` is provided); ``ValueError`` when ``module`` is not a unit's module. It may be
    called between any two iterations, and takes effect in the very next one: backward prefetch and
    asynchronous reduce-scatters at once, forward prefetch at the latest once a forward with prefetching on has
    recorded the order (earlier, by an order recorded before, is allowed); switched off, nothing is gathered ahead any more (no backward prefetch by an order recorded earlier)
    and reduce-scatters are synchronous again."""
    raise NotImplementedError("Task 6: implement set_prefetch() in fsdp_assignment/task6_prefetch.py (see its docstring)")


class PrefetchHooks(BackwardHooks):
    """Task 4's life cycle plus prefetching, while ``unit.shared.prefetch`` is on (read at every use, never
    cached); with prefetching off, exactly Task 4's. The tests call only ``PrefetchHooks().register(unit)``;
    Task 7's ``fully_shard`` registers this class."""
