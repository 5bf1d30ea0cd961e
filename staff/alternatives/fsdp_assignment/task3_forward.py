"""Task 3, staff alternative: the all-gather goes into a list of per-rank shard tensors, then into the buffer.

The reference all-gathers straight into the unit's flat buffer (``all_gather_into_tensor``). This one calls
``dist.all_gather`` with one fresh tensor per rank and, once the collective has finished, concatenates them into
``unsharded`` (``torch.cat(..., out=...)``). An asynchronous call returns a handle of our own whose ``wait()``
waits for the collective and then fills the buffer, so nothing reads the buffer before it holds the data.
The inputs' cast uses torch's pytree instead of a hand-written recursion.

Written to the contract of ``fsdp_assignment/task3_forward.py`` (the names the other task files import:
``unshard``, ``reshard``, ``wait_for_unshard``, ``reshard_unit``, ``cast_forward_inputs``, ``ForwardHooks``,
and ``_all_gather_single``, which the reference's Task 5 imports), to show that the tests grade what a forward
does, not how the reference does it. Staff only: see staff/alternatives/README.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .support.state import FSDPUnit, ShardedState, TrainingState
from .task2_flat_param import FlatParameter


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """Gather every rank's ``input`` into ``output`` (rank r's at offset ``r * input.numel()``): the same list
    gather as ``unshard``, for callers that own their output (the reference's Task 5 imports this name)."""
    handle = _ListGather(input, output, group)
    if async_op:
        return handle
    handle.wait()
    return None


class _ListGather:
    """An all-gather into one tensor per rank, and the handle that moves them into ``target`` once done.

    ``wait()`` waits for the collective, then concatenates the pieces in rank order into ``target``. Keeps
    ``source`` (the cast copy of the shard, under mixed precision a tensor nothing else references) alive until
    then: the collective may read it until it has finished."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor, group):
        self.source, self.target = source, target
        self.pieces = [torch.empty_like(source) for _ in range(dist.get_world_size(group))]
        # dist.all_gather is looked up at call time: the benchmarks count collectives by patching it.
        self.work = dist.all_gather(self.pieces, source, group=group, async_op=True)

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait()
            torch.cat(self.pieces, out=self.target)
            self.work, self.pieces, self.source = None, None, None
        return True

    def is_completed(self) -> bool:
        return self.work is None


def unshard(flat_param: FlatParameter, group: dist.ProcessGroup | None = None, *,
            param_dtype: torch.dtype | None = None, async_op: bool = False):
    buffer = flat_param.unsharded
    if param_dtype is not None and param_dtype != buffer.dtype:
        raise ValueError(f"unshard: param_dtype={param_dtype}, but this FlatParameter's unsharded buffer is "
                         f"{buffer.dtype} (it was built with unsharded_dtype={buffer.dtype})")
    # What this rank sends: its shard in the buffer's dtype, on the buffer's device (CPU offload keeps the
    # shard on the host). .to() returns the shard itself when nothing changes; the all-gather only reads it.
    source = flat_param.shard.detach().to(device=buffer.device, dtype=buffer.dtype, non_blocking=True)
    flat_param.alloc_unsharded()
    # Written through ``.data`` (not .detach(), which shares the version counter): refilling must not bump the
    # version of the tensor autograd saved views of, or a unit re-gathered for backward fails "modified by an
    # inplace operation" although the data is what was saved.
    gather = _ListGather(source, buffer.data, group)
    if async_op:
        return gather
    gather.wait()
    return None


def reshard(flat_param: FlatParameter) -> None:
    flat_param.free_unsharded()


def wait_for_unshard(unit: FSDPUnit) -> None:
    """The unit's buffers hold the gathered data and its parameter names are fresh views of them."""
    in_flight, unit.pending_unshard = unit.pending_unshard, []
    if in_flight:
        for handle in in_flight:
            handle.wait()
    elif unit.sharded_state is not ShardedState.UNSHARDED:
        for flat_param in unit.flat_params:
            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)
    # Fresh views every time: views made under no_grad (an earlier forward) would cut the gradient path.
    for flat_param in unit.flat_params:
        flat_param.use_unsharded_views()
    unit.sharded_state = ShardedState.UNSHARDED


def reshard_unit(unit: FSDPUnit) -> None:
    # A prefetched gather still in flight writes into the buffer: finish it before the memory goes.
    in_flight, unit.pending_unshard = unit.pending_unshard, []
    for handle in in_flight:
        handle.wait()
    for flat_param in unit.flat_params:
        reshard(flat_param)
    unit.sharded_state = ShardedState.SHARDED


def cast_forward_inputs(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if unit.param_dtype is None or not unit.cast_forward_inputs:
        return args, kwargs
    dtype = unit.param_dtype

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and torch.is_floating_point(x) else x
    return tree_map(cast, args), tree_map(cast, kwargs)


class ForwardHooks:
    """The forward life cycle; Task 4 and Task 6 subclass it (``pre_forward``, ``post_forward``)."""

    def register(self, unit: FSDPUnit) -> None:
        unit.module.register_forward_pre_hook(lambda module, args, kwargs: self.pre_forward(unit, args, kwargs),
                                              with_kwargs=True)
        unit.module.register_forward_hook(lambda module, args, output: self.post_forward(unit, output))

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        unit.training_state = TrainingState.FORWARD
        wait_for_unshard(unit)
        return cast_forward_inputs(unit, args, kwargs)

    def post_forward(self, unit: FSDPUnit, output):
        if unit.reshard_after_forward:
            reshard_unit(unit)
        unit.training_state = TrainingState.IDLE
        return output
