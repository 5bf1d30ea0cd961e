"""Task 3: forward.

Before a unit's forward runs, every rank all-gathers its shard into the unit's unsharded flat buffer and
points the module's original parameter names at views of it; after the forward, the unit frees that buffer
again (``reshard_after_forward``), so at most a few units are ever unsharded at once.

Invariant this file protects: while a unit is SHARDED its unsharded storage has size 0; while it is
UNSHARDED the buffer holds every rank's shard, in rank order, cast to the unit's ``param_dtype``.
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from .support.state import FSDPUnit, ShardedState, TrainingState
from .task2_flat_param import FlatParameter


def unshard(flat_param: FlatParameter, group: dist.ProcessGroup | None = None, *,
            param_dtype: torch.dtype | None = None, async_op: bool = False):
    """All-gather every rank's shard of ``flat_param`` into ``flat_param.unsharded``.

    Allocates the unsharded storage (``alloc_unsharded``), casts this rank's shard to ``param_dtype`` (mixed
    precision; ``None`` keeps its dtype), and all-gathers into ``unsharded`` so that shard r lands at offset
    ``r * shard_numel``. With ``async_op=True`` returns the collective's work handle (the caller must
    ``wait()`` before using the data); otherwise waits and returns None.

    The all-gather writes into ``unsharded.data``: writing through the autograd-visible tensor would bump its
    version counter, and autograd would then refuse the views it saved for backward ("modified by an
    inplace operation") although their data is exactly what was saved.
    """
    raise NotImplementedError("Task 3: implement unshard() in fsdp_assignment/task3_forward.py (see its docstring)")


def reshard(flat_param: FlatParameter) -> None:
    """Free ``flat_param``'s unsharded buffer (storage size 0); its shard is untouched."""
    raise NotImplementedError("Task 3: implement reshard() in fsdp_assignment/task3_forward.py (see its docstring)")


def wait_for_unshard(unit: FSDPUnit) -> None:
    """Make ``unit`` UNSHARDED: wait for its prefetched all-gathers if any are in flight (Task 6), else
    all-gather now unless it is unsharded already. Then point its module's parameter names at fresh views
    (fresh, so that views made under ``torch.no_grad()`` in an earlier forward never cut the gradient path)."""
    raise NotImplementedError("Task 3: implement wait_for_unshard() in fsdp_assignment/task3_forward.py (see its docstring)")


def reshard_unit(unit: FSDPUnit) -> None:
    """Free every unsharded buffer of ``unit`` and mark it SHARDED."""
    raise NotImplementedError("Task 3: implement reshard_unit() in fsdp_assignment/task3_forward.py (see its docstring)")


def pre_forward(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Runs before ``unit.module.forward``: unshard the unit and return the (possibly cast) inputs.

    Steps: mark the unit FORWARD; with prefetching on, record the execution order and issue the next
    unit's all-gather (Task 6); make the unit UNSHARDED (``wait_for_unshard``); with ``param_dtype`` set,
    cast floating-point inputs to it (the unsharded parameters are in that dtype).
    """
    raise NotImplementedError("Task 3: implement pre_forward() in fsdp_assignment/task3_forward.py (see its docstring)")


def post_forward(unit: FSDPUnit, output):
    """Runs after ``unit.module.forward``: reshard if ``unit.reshard_after_forward`` (the root too: the
    backward re-gathers it first thing), and, when autograd is recording, register the pre-backward hook on
    the output (Task 4). Returns the output."""
    raise NotImplementedError("Task 3: implement post_forward() in fsdp_assignment/task3_forward.py (see its docstring)")


def register_forward_hooks(unit: FSDPUnit) -> None:
    """Register ``pre_forward`` and ``post_forward`` as ``unit.module``'s forward pre-hook and forward hook."""
    raise NotImplementedError("Task 3: implement register_forward_hooks() in fsdp_assignment/task3_forward.py (see its docstring)")
