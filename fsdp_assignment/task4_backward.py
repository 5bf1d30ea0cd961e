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
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.distributed as dist
from .support.state import FSDPUnit, ShardedState, SharedState, TrainingState
from .task2_flat_param import FlatParameter
from .task3_forward import reshard, reshard_unit, wait_for_unshard


def reduce_scatter_grad(flat_param: FlatParameter, unsharded_grad: torch.Tensor,
                        group: dist.ProcessGroup | None = None, *, reduce_dtype: torch.dtype | None = None,
                        async_op: bool = False):
    """Reduce-scatter the padded flat gradient ``unsharded_grad`` (``padded_numel`` elements) over ranks.

    Casts it to ``reduce_dtype`` (mixed precision; None keeps its dtype), averages it over the ranks
    (mean, not sum: each rank's loss is a mean over its own batch), and returns ``(work, grad_shard)``:
    ``grad_shard`` has ``shard_numel`` elements, this rank's slice of the averaged gradient, in
    ``reduce_dtype``. ``work`` is None unless ``async_op`` (then ``grad_shard`` is valid after ``wait()``).
    """
    raise NotImplementedError("Task 4: implement reduce_scatter_grad() in fsdp_assignment/task4_backward.py (see its docstring)")


def accumulate_shard_grad(flat_param: FlatParameter, grad_shard: torch.Tensor) -> None:
    """Add a reduced gradient shard into ``flat_param.shard.grad`` (in the shard's dtype)."""
    raise NotImplementedError("Task 4: implement accumulate_shard_grad() in fsdp_assignment/task4_backward.py (see its docstring)")


def register_pre_backward_hook(unit: FSDPUnit, output):
    """Arrange for ``pre_backward(unit)`` to run once, when autograd first reaches any of ``output``'s
    tensors that require grad, i.e. before any of this unit's backward computation. Returns ``output``."""
    raise NotImplementedError("Task 4: implement register_pre_backward_hook() in fsdp_assignment/task4_backward.py (see its docstring)")


def pre_backward(unit: FSDPUnit) -> None:
    """Before the unit's backward: queue ``finalize_backward`` once per backward pass (autograd's final
    callback), re-gather the unit if it was resharded, and (Task 6) prefetch the next unit to run backward."""
    raise NotImplementedError("Task 4: implement pre_backward() in fsdp_assignment/task4_backward.py (see its docstring)")


def register_post_backward_hooks(unit: FSDPUnit) -> None:
    """Register ``post_backward(unit, flat_param)`` to run when autograd has finished accumulating the
    gradient of each trainable ``flat_param.unsharded`` (``register_post_accumulate_grad_hook``)."""
    raise NotImplementedError("Task 4: implement register_post_backward_hooks() in fsdp_assignment/task4_backward.py (see its docstring)")


def post_backward(unit: FSDPUnit, flat_param: FlatParameter) -> None:
    """``flat_param.unsharded.grad`` is complete: reduce it into the shard's gradient and free memory.

    With gradient sync on (``unit.requires_gradient_sync``): reduce-scatter the gradient (plus any gradient
    accumulated without sync) in ``reduce_dtype`` and add it to ``shard.grad``; asynchronously when
    prefetching (Task 6: at most one reduce-scatter in flight, the older one is finished first). With sync
    off: keep the full gradient (in ``reduce_dtype``) for a later synced backward. Either way drop
    ``unsharded.grad`` and reshard ``flat_param``: every backward node that uses its views has run.
    """
    raise NotImplementedError("Task 4: implement post_backward() in fsdp_assignment/task4_backward.py (see its docstring)")


def finalize_backward(shared: SharedState) -> None:
    """Autograd's final callback: finish every pending reduce-scatter, reshard every unit that is still
    unsharded (frozen parameters, units whose parameters got no gradient), and reset the states."""
    raise NotImplementedError("Task 4: implement finalize_backward() in fsdp_assignment/task4_backward.py (see its docstring)")
