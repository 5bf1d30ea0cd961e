"""Task 3: forward.

A unit's forward runs with its full parameters, and the unit gives their memory back afterwards. The tests
observe, for every unit and every forward:

- when the unit's module computes, ``unsharded`` holds every rank's shard in rank order, in the unit's
  ``param_dtype`` (the parameters' dtype when None), and the original parameter names are views of it through
  which gradients reach ``unsharded.grad``, also after a forward under ``torch.no_grad()``; the output equals
  single-process PyTorch's (relative error at most 1e-6 in fp32), in a second forward too;
- with ``unit.param_dtype`` set and ``unit.cast_forward_inputs`` true, the module receives every floating-point
  tensor of its inputs (positional and keyword, nested lists, tuples and dicts included) in ``param_dtype``;
  other values, and everything otherwise, unchanged; its output is returned unchanged;
- a forward all-gathers each of the unit's FlatParameters once (``shard_numel`` elements per rank, in the
  unsharded dtype) and communicates nothing else;
- after the unit's forward with ``reshard_after_forward`` (the root too) its unsharded storage has size 0
  and the memory is really free; without it the unit stays unsharded;
- a buffer is never freed while an all-gather into it may still write (Task 6 issues gathers ahead of time, for
  a unit that may then not run).

Problems to solve: running code around a module's forward without touching the model's code; refilling a
buffer whose views autograd saved, without autograd rejecting them in backward, whether the gather completes
at once or later (Task 6); keeping the gradient path after a forward under ``torch.no_grad()``.
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

    Afterwards ``unsharded`` has storage for ``padded_numel`` elements and holds shard r at offset
    ``r * shard_numel`` for every rank r, in its own dtype and on its own device (mixed precision casts the
    shard; the CPU offload bonus keeps the shard on the CPU): one all-gather over ``group`` (None: the default
    group) of ``shard_numel`` elements per rank. ``param_dtype``, when given, must be ``unsharded``'s dtype,
    else ``ValueError``.

    Returns None; with ``async_op=True``, a handle to ``wait()`` on before the data is used. Whatever the
    collective reads (under mixed precision, a cast copy nothing else references) must stay alive until then:
    on a GPU the collective reads it later.

    Views of ``unsharded`` that autograd saved in an earlier forward stay usable: a later backward must not fail
    with "one of the variables needed for gradient computation has been modified by an inplace operation",
    whether the gather completes before ``unshard`` returns or later, at ``wait()`` (Task 6's prefetch).

    The tests count collectives through the process group, whatever function you call; the benchmarks count
    and delay them by patching ``torch.distributed``: call them as ``dist.<name>`` (not ``from
    torch.distributed import ...``) for their figures to include them.
    """
    raise NotImplementedError("Task 3: implement unshard() in fsdp_assignment/task3_forward.py (see its docstring)")


def reshard(flat_param: FlatParameter) -> None:
    """Free ``flat_param``'s unsharded buffer (storage size 0, memory really returned); its shard is untouched."""
    raise NotImplementedError("Task 3: implement reshard() in fsdp_assignment/task3_forward.py (see its docstring)")


class ForwardHooks:
    """A unit's life cycle in forward.

    The tests call only ``ForwardHooks().register(unit)``; afterwards every call of ``unit.module`` keeps the
    module docstring's rules. Tasks 4 and 6 provide ``BackwardHooks(ForwardHooks)`` and
    ``PrefetchHooks(BackwardHooks)`` likewise, whose ``register`` installs the life cycle up to their task, and
    Task 7's ``fully_shard`` registers ``PrefetchHooks``. Which methods and helpers the life cycle is made of,
    and how the later classes extend them, is your design; state lives on ``FSDPUnit`` and ``SharedState``.
    """

    def register(self, unit: FSDPUnit) -> None:
        """Install this life cycle on ``unit.module``, for every later call of the module. Called once per
        unit."""
        raise NotImplementedError("Task 3: implement ForwardHooks.register() in fsdp_assignment/task3_forward.py (see its docstring)")
