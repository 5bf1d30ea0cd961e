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

    Allocates the unsharded storage (``alloc_unsharded``), casts this rank's shard to ``unsharded``'s dtype
    (mixed precision: the FlatParameter was built with ``unsharded_dtype=param_dtype``) and device (the CPU
    offload bonus keeps the shard on the CPU and ``unsharded`` on the compute device: the copy is
    non-blocking, from pinned memory, where the device allows), and all-gathers into
    ``unsharded`` so that shard r lands at offset ``r * shard_numel``. ``param_dtype``, when given, must be
    ``unsharded``'s dtype (``ValueError`` otherwise: the buffer's dtype is fixed when it is built). With
    ``async_op=True`` returns the collective's work handle (the caller must ``wait()`` before using the
    data); otherwise waits and returns None. Use ``group`` (None: the default group) for the collective.

    The tests count collectives through the process group, whatever function you call; the benchmarks
    count and delay them by patching ``torch.distributed``, so look them up as ``dist.<name>`` when you
    call them (not ``from torch.distributed import ...``) for the benchmarks' figures to include them.

    With ``async_op=True`` the collective's input must stay alive until ``wait()``: under mixed precision
    it is the cast copy of the shard, a new tensor that nothing else references, and a collective in flight
    may still read it after this function returns (on a GPU it does). The handle ``torch.distributed``
    returns holds a reference to its input, so returning that handle is enough; a handle of your own
    (wrapping or deferring the collective) must keep the cast copy referenced until its ``wait()``.

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
    """Free every unsharded buffer of ``unit`` and mark it SHARDED. Wait on the handles of any all-gather still in
    flight first (``unit.pending_unshard``: a unit prefetched that then did not run), so that nothing writes into
    memory after it is freed; every test checks that no handle is left unwaited when backward returns."""
    raise NotImplementedError("Task 3: implement reshard_unit() in fsdp_assignment/task3_forward.py (see its docstring)")


def cast_forward_inputs(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """With ``unit.param_dtype`` set and ``unit.cast_forward_inputs`` true, cast every floating-point tensor
    in ``args``/``kwargs`` (nested lists, tuples and dicts included) to ``param_dtype``, the dtype of the
    unsharded parameters; otherwise return them unchanged."""
    raise NotImplementedError("Task 3: implement cast_forward_inputs() in fsdp_assignment/task3_forward.py (see its docstring)")


class ForwardHooks:
    """A unit's life cycle in forward, run by hooks on ``unit.module``.

    Tasks 4 and 6 extend this class (``BackwardHooks(ForwardHooks)``, ``PrefetchHooks(BackwardHooks)``):
    each overrides the steps it adds to and calls ``super()`` for the rest, so the whole life cycle of a unit
    is composed in one chain of classes, and Task 7's ``fully_shard`` registers the last one. Methods call
    each other through ``self``, so a later task's override is the one that runs. The class keeps no state:
    everything lives on the unit (``FSDPUnit``) and its tree (``SharedState``).
    """

    def register(self, unit: FSDPUnit) -> None:
        """Register ``self.pre_forward`` as ``unit.module``'s forward pre-hook (with kwargs) and
        ``self.post_forward`` as its forward hook. Call it once per unit."""
        raise NotImplementedError("Task 3: implement ForwardHooks.register() in fsdp_assignment/task3_forward.py (see its docstring)")

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Runs before ``unit.module.forward``: mark the unit FORWARD, make it UNSHARDED
        (``wait_for_unshard``) and return the inputs cast by ``cast_forward_inputs``."""
        raise NotImplementedError("Task 3: implement ForwardHooks.pre_forward() in fsdp_assignment/task3_forward.py (see its docstring)")

    def post_forward(self, unit: FSDPUnit, output):
        """Runs after ``unit.module.forward``: reshard the unit if ``unit.reshard_after_forward`` (the root
        too), mark it IDLE, and return ``output`` unchanged."""
        raise NotImplementedError("Task 3: implement ForwardHooks.post_forward() in fsdp_assignment/task3_forward.py (see its docstring)")
