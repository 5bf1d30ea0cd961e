"""Task 4: backward.

A unit's backward needs its full parameters again (autograd saved views of the buffer that post-forward freed)
and leaves a padded flat gradient that every rank must turn into its slice of the mean over ranks. The tests
observe, for every unit and every ``loss.backward()``:

- gradients: each trainable shard's ``.grad`` is this rank's slice of the single-process gradient of the mean
  loss over the global batch (relative error at most 1e-5), in the shard's dtype, with zero padding; a frozen
  FlatParameter gets no gradient (``shard.grad`` stays None); a second backward without zeroing adds to the
  first, as plain PyTorch does;
- when ``loss.backward()`` returns: every reduction has landed in ``shard.grad``, no unit is unsharded, no full
  gradient (``unsharded.grad``) is alive and no original parameter name carries a ``.grad`` (the memory is
  measured), and every asynchronous collective has been waited on;
- during backward: at most one non-root unit is unsharded at any moment, the one whose backward runs (with
  nested units, also the units it is nested in; Task 6's prefetching adds one); the root may stay unsharded
  until the backward ends;
- a unit is resharded as soon as its own backward is done, frozen parameters included, and a unit whose forward
  inputs (positional or keyword) carry a gradient has issued its reduce-scatter by then: while the backward pass
  runs, not after autograd's last operation of it;
- collectives: a backward all-gathers again exactly the units that were resharded after forward, each once (the
  root once or not at all), and reduce-scatters each trainable FlatParameter's padded full gradient once (in
  ``reduce_dtype`` when set); nothing else, no all-reduce. These counts are checked where every unit runs once
  per forward; a unit run twice may be gathered again for each run's backward (its gradients and the memory
  rules are checked then, not its count). Every rank issues the same collectives in the same order, so nothing
  ever hangs.

The hard cases, each a test; your design must solve them:

- frozen parameters (``LoRAModel`` in ``support/models.py``): every block holds a frozen base weight beside a
  trainable adapter, so every unit has a FlatParameter that never gets a gradient, and yet each unit must be
  resharded when its own backward is done; one block may be frozen entirely, and behind a frozen embedding the
  first block's input needs no gradient;
- a unit with several outputs (a tuple, non-tensors included) of which the loss uses only one, whichever it is;
- a unit run twice in one forward (its gradient is the sum of both runs');
- a unit whose input another unit also reads (one tensor feeding two units, or a unit and the layer after it):
  that input's gradient arrives in parts, from each reader;
- a unit whose output is detached, a unit that runs forward but never reaches the loss, and a loss made from a
  block's output that the root does not return (the root's output never gets a gradient): the rules above still
  hold when ``loss.backward()`` returns, and such a unit gets no gradient (or zeros);
- a forward under ``torch.no_grad()`` (evaluation) followed by a training step: every gradient still arrives;
- activation checkpointing (``torch.utils.checkpoint``) around a unit or around a block inside a unit, with
  ``use_reentrant=True`` or ``False``, early stop on or off: the gradients above, the bound on unsharded units
  during the recomputation too, and each unit all-gathered exactly once per backward (counted per unit); a
  reentrant checkpoint inside a unit runs a backward pass of its own, nested in the outer one, and the rules of
  "when ``loss.backward()`` returns" are about the outer one.

With gradient sync off (``unit.requires_gradient_sync`` False: Task 7's ``set_requires_gradient_sync``) a
backward communicates no gradient: each trainable FlatParameter keeps its full gradient, summed over such
backwards, in ``flat_param.unsynced_grad``; the next backward with sync on reduces that sum plus its own
gradient, once. Gradients are summed and reduced in ``unit.reduce_dtype`` (else their own dtype).

Known difference from single-process PyTorch: a trainable parameter that took no part in the forward still
gets a gradient, of zeros, when another parameter of its FlatParameter got one (autograd fills the whole
flat gradient), where plain PyTorch leaves its ``.grad`` at ``None``. Optimizers treat the two differently
(AdamW's weight decay moves a parameter whose gradient is zero, and skips one whose gradient is ``None``).

Stuck on one of them? ``hints/task4/`` has, per topic, a question, a mechanism and a recipe (one file each).
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.distributed as dist
from .support.state import FSDPUnit, ShardedState, SharedState, TrainingState
from .task2_flat_param import FlatParameter
from .task3_forward import ForwardHooks


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
    """Add a reduced gradient shard into ``flat_param.shard.grad`` (in the shard's dtype, on the shard's device:
    the CPU offload bonus reduces on the compute device and keeps gradients on the CPU)."""
    raise NotImplementedError("Task 4: implement accumulate_shard_grad() in fsdp_assignment/task4_backward.py (see its docstring)")


class BackwardHooks(ForwardHooks):
    """A unit's life cycle in forward and backward.

    The tests call only ``BackwardHooks().register(unit)`` (Task 3's ``register``): afterwards every forward and
    backward through ``unit.module`` keeps the module docstring's rules. Task 6's ``PrefetchHooks`` extends this
    class, and Task 7's ``fully_shard`` registers that. Which methods it has, and how each runs at its moment,
    is this task's design.
    """
