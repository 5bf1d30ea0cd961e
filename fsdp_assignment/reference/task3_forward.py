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
    dtype = flat_param.unsharded.dtype
    if param_dtype is not None and param_dtype != dtype:
        raise ValueError(f"unshard: param_dtype={param_dtype} but the unsharded buffer holds {dtype}; build the "
                         f"FlatParameter with unsharded_dtype={param_dtype}")
    flat_param.alloc_unsharded()
    shard = flat_param.shard.detach()
    if shard.dtype != dtype or shard.device != flat_param.unsharded.device:
        # Stream-ordered before the collective, so a non-blocking host-to-device copy is safe here.
        shard = shard.to(device=flat_param.unsharded.device, dtype=dtype, non_blocking=True)
    # Write through ``.data``: writing into the autograd-visible tensor would bump its version counter, and
    # autograd would then refuse the views it saved for backward ("modified by an inplace operation") although
    # their data is exactly what was saved. The returned handle holds a reference to its input (the cast copy),
    # which keeps it alive until wait(); a handle of one's own would have to do the same.
    work = _all_gather_single(flat_param.unsharded.data, shard, group, async_op)
    return work if async_op else None


def reshard(flat_param: FlatParameter) -> None:
    """Free ``flat_param``'s unsharded buffer (storage size 0, memory really returned); its shard is untouched."""
    flat_param.free_unsharded()


def wait_for_unshard(unit: FSDPUnit) -> None:
    """Make ``unit`` UNSHARDED (a suggested helper; the tests do not call it): its buffers hold the gathered
    data (all-gathered now, or by Task 6's prefetch still in ``unit.pending_unshard``; not gathered again when
    already unsharded), and its parameter names are views through which gradients reach ``unsharded.grad``,
    also after a forward under ``torch.no_grad()``."""
    if unit.pending_unshard:
        for work in unit.pending_unshard:
            work.wait()
        unit.pending_unshard.clear()
    elif unit.sharded_state == ShardedState.SHARDED:
        for flat_param in unit.flat_params:
            unshard(flat_param, unit.group, param_dtype=unit.param_dtype)
    # Fresh views every time: views made under torch.no_grad() in an earlier forward would cut the gradient path.
    for flat_param in unit.flat_params:
        flat_param.use_unsharded_views()
    unit.sharded_state = ShardedState.UNSHARDED


def reshard_unit(unit: FSDPUnit) -> None:
    """Free every unsharded buffer of ``unit`` and mark it SHARDED (a suggested helper; the tests do not call
    it). A buffer must never be freed while an all-gather into it may still write (``unit.pending_unshard``: a
    unit prefetched that then did not run); no handle may be left unwaited when backward returns."""
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


def cast_forward_inputs(unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """With ``unit.param_dtype`` set and ``unit.cast_forward_inputs`` true, cast every floating-point tensor
    in ``args``/``kwargs`` (nested lists, tuples and dicts included) to ``param_dtype``, the dtype of the
    unsharded parameters; other values, and everything when either is unset, are returned unchanged."""
    if unit.param_dtype is None or not unit.cast_forward_inputs:
        return args, kwargs
    return _cast_floating(args, unit.param_dtype), _cast_floating(kwargs, unit.param_dtype)


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
        def _pre_hook(module: nn.Module, args, kwargs):
            return self.pre_forward(unit, args, kwargs)

        def _post_hook(module: nn.Module, args, output):
            return self.post_forward(unit, output)

        # with_kwargs=True: the pre-hook sees (and may replace) keyword inputs too, which mixed precision casts.
        unit.module.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        unit.module.register_forward_hook(_post_hook)

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Runs before ``unit.module.forward``: mark the unit FORWARD, make it UNSHARDED
        (``wait_for_unshard``) and return the inputs cast by ``cast_forward_inputs``."""
        unit.training_state = TrainingState.FORWARD
        wait_for_unshard(unit)
        return cast_forward_inputs(unit, args, kwargs)

    def post_forward(self, unit: FSDPUnit, output):
        """Runs after ``unit.module.forward``: reshard the unit if ``unit.reshard_after_forward`` (the root
        too), mark it IDLE, and return ``output`` unchanged."""
        if unit.reshard_after_forward:
            reshard_unit(unit)
        unit.training_state = TrainingState.IDLE
        return output
