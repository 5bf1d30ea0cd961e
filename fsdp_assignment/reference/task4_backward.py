"""Task 4: backward.

A unit that resharded after forward must be all-gathered again before autograd runs its backward, because
the views autograd saved point into the (now empty) unsharded buffer. Once autograd has accumulated every
gradient of a unit's views into the padded flat gradient ``unsharded.grad``, the unit reduce-scatters it
(mean over ranks) into its shard's ``.grad`` and frees both the full gradient and the full parameters.

Invariants: every reduce-scatter has finished and landed in ``shard.grad`` when ``loss.backward()``
returns (``finalize_backward`` runs as autograd's final callback); the padding of ``shard.grad`` is zero;
no unit stays unsharded after backward; a unit whose parameters got no gradient never blocks (there is
simply nothing to reduce for it, on every rank alike).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..support.state import FSDPUnit, ShardedState, SharedState, TrainingState
from .task2_flat_param import FlatParameter
from .task3_forward import reshard, reshard_unit, wait_for_unshard


def _reduce_scatter_single(output, input, group, async_op):
    # Looked up at call time so benchmarks can patch torch.distributed (see task3_forward._all_gather_single).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def reduce_scatter_grad(flat_param: FlatParameter, unsharded_grad: torch.Tensor,
                        group: dist.ProcessGroup | None = None, *, reduce_dtype: torch.dtype | None = None,
                        async_op: bool = False):
    """Reduce-scatter the padded flat gradient ``unsharded_grad`` (``padded_numel`` elements) over ranks.

    Casts it to ``reduce_dtype`` (mixed precision; None keeps its dtype), averages it over the ranks
    (mean, not sum: each rank's loss is a mean over its own batch), and returns ``(work, grad_shard)``:
    ``grad_shard`` has ``shard_numel`` elements, this rank's slice of the averaged gradient, in
    ``reduce_dtype``. ``work`` is None unless ``async_op`` (then ``grad_shard`` is valid after ``wait()``).
    """
    if reduce_dtype is not None and unsharded_grad.dtype != reduce_dtype:
        unsharded_grad = unsharded_grad.to(reduce_dtype)
    grad_shard = torch.empty(flat_param.shard_numel, dtype=unsharded_grad.dtype, device=unsharded_grad.device)
    work = _reduce_scatter_single(grad_shard, unsharded_grad.contiguous(), group, async_op)
    return (work if async_op else None), grad_shard


def accumulate_shard_grad(flat_param: FlatParameter, grad_shard: torch.Tensor) -> None:
    """Add a reduced gradient shard into ``flat_param.shard.grad`` (in the shard's dtype)."""
    grad_shard = grad_shard.to(flat_param.shard.dtype)
    if flat_param.shard.grad is None:
        flat_param.shard.grad = grad_shard
    else:
        flat_param.shard.grad += grad_shard


def _flatten_tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flatten_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flatten_tensors(v)]
    return []


def register_pre_backward_hook(unit: FSDPUnit, output):
    """Arrange for ``pre_backward(unit)`` to run once, when autograd first reaches any of ``output``'s
    tensors that require grad, i.e. before any of this unit's backward computation. Returns ``output``."""
    tensors = [t for t in _flatten_tensors(output) if t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: pre_backward(unit), mode="any")
    return output


def pre_backward(unit: FSDPUnit) -> None:
    """Before the unit's backward: queue ``finalize_backward`` once per backward pass (autograd's final
    callback), re-gather the unit if it was resharded, and (Task 6) prefetch the next unit to run backward."""
    shared = unit.shared
    if shared is None:
        raise RuntimeError("pre_backward: unit.shared is None; the tree was never initialized")
    if not shared.backward_callback_queued:
        shared.backward_callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: finalize_backward(shared))
    unit.training_state = TrainingState.PRE_BACKWARD
    wait_for_unshard(unit)
    if shared.prefetch:
        from .task6_prefetch import prefetch_backward
        prefetch_backward(unit)


def register_post_backward_hooks(unit: FSDPUnit) -> None:
    """Register ``post_backward(unit, flat_param)`` to run when autograd has finished accumulating the
    gradient of each trainable ``flat_param.unsharded`` (``register_post_accumulate_grad_hook``)."""
    for flat_param in unit.flat_params:
        if flat_param.requires_grad:
            flat_param.unsharded.register_post_accumulate_grad_hook(
                lambda _tensor, fp=flat_param: post_backward(unit, fp))


def post_backward(unit: FSDPUnit, flat_param: FlatParameter) -> None:
    """``flat_param.unsharded.grad`` is complete: reduce it into the shard's gradient and free memory.

    With gradient sync on (``unit.requires_gradient_sync``): reduce-scatter the gradient (plus any gradient
    accumulated without sync) in ``reduce_dtype`` and add it to ``shard.grad``; asynchronously when
    prefetching (Task 6: at most one reduce-scatter in flight, the older one is finished first). With sync
    off: keep the full gradient (in ``reduce_dtype``) for a later synced backward. Either way drop
    ``unsharded.grad`` and reshard ``flat_param``: every backward node that uses its views has run.
    """
    unit.training_state = TrainingState.POST_BACKWARD
    grad = flat_param.unsharded.grad
    flat_param.unsharded.grad = None
    reduce_dtype = unit.reduce_dtype or grad.dtype
    grad = grad.to(reduce_dtype)
    # Gradient accumulated by earlier backward passes without sync (Task 7), kept in reduce_dtype.
    accumulated = flat_param.unsynced_grad
    if accumulated is not None:
        grad = accumulated.add_(grad)
        flat_param.unsynced_grad = None
    if not unit.requires_gradient_sync:
        flat_param.unsynced_grad = grad
    else:
        shared = unit.shared
        async_op = shared is not None and shared.prefetch
        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=async_op)
        if async_op:
            # Keep ``grad`` referenced until the collective has read it.
            shared.pending_reduce_scatters.append((work, flat_param, grad_shard, grad))
            while len(shared.pending_reduce_scatters) > 1:
                _finish_reduce_scatter(shared.pending_reduce_scatters.pop(0))
        else:
            accumulate_shard_grad(flat_param, grad_shard)
    reshard(flat_param)
    if not any(fp.is_unsharded() for fp in unit.flat_params):
        unit.sharded_state = ShardedState.SHARDED


def _finish_reduce_scatter(pending) -> None:
    work, flat_param, grad_shard, _input = pending
    work.wait()
    accumulate_shard_grad(flat_param, grad_shard)


def finalize_backward(shared: SharedState) -> None:
    """Autograd's final callback: finish every pending reduce-scatter, reshard every unit that is still
    unsharded (frozen parameters, units whose parameters got no gradient), and reset the states."""
    for pending in shared.pending_reduce_scatters:
        _finish_reduce_scatter(pending)
    shared.pending_reduce_scatters.clear()
    for unit in shared.units:
        if unit.sharded_state == ShardedState.UNSHARDED or unit.pending_unshard:
            reshard_unit(unit)
        unit.training_state = TrainingState.IDLE
    shared.backward_callback_queued = False
