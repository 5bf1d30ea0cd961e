"""Task 3: forward.

Before a unit's forward runs, every rank all-gathers its shard into the unit's unsharded flat buffer and
points the module's original parameter names at views of it; after the forward, the unit frees that buffer
again (``reshard_after_forward``), so at most a few units are ever unsharded at once.

Invariant this file protects: while a unit is SHARDED its unsharded storage has size 0; while it is
UNSHARDED the buffer holds every rank's shard, in rank order, cast to the unit's ``param_dtype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..support.state import FSDPUnit, ShardedState, TrainingState
from .task2_flat_param import FlatParameter


def _all_gather_single(output, input, group, async_op):
    # Looked up at call time (not bound at import) so benchmarks can count or delay collectives by patching
    # torch.distributed. ``all_gather_single`` is the current name; ``all_gather_into_tensor`` the older one.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


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
    flat_param.alloc_unsharded()
    shard = flat_param.shard.detach()
    if param_dtype is not None and shard.dtype != param_dtype:
        shard = shard.to(param_dtype)
    work = _all_gather_single(flat_param.unsharded.data, shard, group, async_op)
    return work if async_op else None


def reshard(flat_param: FlatParameter) -> None:
    """Free ``flat_param``'s unsharded buffer (storage size 0); its shard is untouched."""
    flat_param.free_unsharded()


def wait_for_unshard(unit: FSDPUnit) -> None:
    """Make ``unit`` UNSHARDED: wait for its prefetched all-gathers if any are in flight (Task 6), else
    all-gather now unless it is unsharded already. Then point its module's parameter names at fresh views
    (fresh, so that views made under ``torch.no_grad()`` in an earlier forward never cut the gradient path)."""
    if unit.pending_unshard:
        for work in unit.pending_unshard:
            work.wait()
        unit.pending_unshard.clear()
    elif unit.sharded_state == ShardedState.SHARDED:
        for flat_param in unit.flat_params:
            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)
    for flat_param in unit.flat_params:
        flat_param.use_unsharded_views()
    unit.sharded_state = ShardedState.UNSHARDED


def reshard_unit(unit: FSDPUnit) -> None:
    """Free every unsharded buffer of ``unit`` and mark it SHARDED."""
    # An all-gather still in flight writes into the buffer: finish it before freeing the storage.
    for work in unit.pending_unshard:
        work.wait()
    unit.pending_unshard.clear()
    for flat_param in unit.flat_params:
        reshard(flat_param)
    unit.sharded_state = ShardedState.SHARDED


def _cast_floating(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if torch.is_floating_point(x) else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    return x


def pre_forward(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Runs before ``unit.module.forward``: unshard the unit and return the (possibly cast) inputs.

    Steps: mark the unit FORWARD; with prefetching on, record the execution order and issue the next
    unit's all-gather (Task 6); make the unit UNSHARDED (``wait_for_unshard``); with ``param_dtype`` set,
    cast floating-point inputs to it (the unsharded parameters are in that dtype).
    """
    unit.training_state = TrainingState.FORWARD
    shared = unit.shared
    if shared is not None and shared.prefetch:
        from .task6_prefetch import prefetch_forward, record_forward_order
        record_forward_order(unit)
        wait_for_unshard(unit)
        prefetch_forward(unit)  # after our own wait: at most this unit and the next one are unsharded
    else:
        wait_for_unshard(unit)
    if unit.param_dtype is not None and unit.cast_forward_inputs:
        args, kwargs = _cast_floating(args, unit.param_dtype), _cast_floating(kwargs, unit.param_dtype)
    return args, kwargs


def post_forward(unit: FSDPUnit, output):
    """Runs after ``unit.module.forward``: reshard if ``unit.reshard_after_forward`` (the root too: the
    backward re-gathers it first thing), and, when autograd is recording, register the pre-backward hook on
    the output (Task 4). Returns the output."""
    if unit.reshard_after_forward:
        reshard_unit(unit)
    unit.training_state = TrainingState.IDLE
    if torch.is_grad_enabled():
        from .task4_backward import register_pre_backward_hook
        output = register_pre_backward_hook(unit, output)
    return output


def register_forward_hooks(unit: FSDPUnit) -> None:
    """Register ``pre_forward`` and ``post_forward`` as ``unit.module``'s forward pre-hook and forward hook."""
    def _pre_hook(module: nn.Module, args, kwargs):
        return pre_forward(unit, args, kwargs)

    def _post_hook(module: nn.Module, args, output):
        return post_forward(unit, output)

    unit.module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    unit.module.register_forward_hook(_post_hook)
