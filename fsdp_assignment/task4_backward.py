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
  ``reduce_dtype`` when set); nothing else, no all-reduce. Every rank issues the same collectives in the same
  order, so nothing ever hangs.

The hard cases, each a test; your design must solve them:

- frozen parameters (``LoRAModel`` in ``support/models.py``): every block holds a frozen base weight beside a
  trainable adapter, so every unit has a FlatParameter that never gets a gradient, and yet each unit must be
  resharded when its own backward is done; one block may be frozen entirely, and behind a frozen embedding the
  first block's input needs no gradient;
- a unit with several outputs (a tuple, non-tensors included) of which the loss uses only one, whichever it is;
- a unit run twice in one forward (its gradient is the sum of both runs');
- a unit whose output is detached, a unit that runs forward but never reaches the loss, and a loss made from a
  block's output that the root does not return (the root's output never gets a gradient): the rules above still
  hold when ``loss.backward()`` returns, and such a unit gets no gradient (or zeros);
- a forward under ``torch.no_grad()`` (evaluation) followed by a training step: every gradient still arrives;
- activation checkpointing (``torch.utils.checkpoint``) around a unit or around a block inside a unit, with
  ``use_reentrant=True`` or ``False``, early stop on or off: the gradients above, the bound on unsharded units
  during the recomputation too, and each unit all-gathered exactly once per backward (counted per unit).

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
from .task3_forward import ForwardHooks, cast_forward_inputs, reshard_unit, wait_for_unshard


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
    class, and Task 7's ``fully_shard`` registers that.

    Suggested decomposition (you may restructure it, and Task 6's with it): ``pre_backward`` runs before the
    unit's backward computation, ``post_backward`` once it is done, ``finalize_backward`` once at the end of each
    backward pass; ``reduce_grad`` and ``reduce_scatter`` reduce one FlatParameter's gradient; Task 6 overrides
    ``pre_forward``, ``pre_backward``, ``reduce_scatter`` and ``wait_for_reductions``. How each of them gets
    called at its moment is this task's design.
    """

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Runs before every forward of ``unit.module`` (Task 3's, extended), including a forward that activation
        checkpointing runs again during backward to recompute a region. Returns the ``(args, kwargs)`` the forward
        runs with: the inputs cast as Task 3 casts them (same values; they may be other tensor objects). A
        recomputation finds the unit unsharded or makes it so, and gathers nothing more than the module
        docstring allows.
        """
        raise NotImplementedError("Task 4: implement BackwardHooks.pre_forward() in fsdp_assignment/task4_backward.py (see its docstring)")

    def post_forward(self, unit: FSDPUnit, output):
        """Runs after every forward of ``unit.module`` (Task 3's, extended), recomputations included; returns
        ``output`` unchanged. Arranges for ``self.pre_backward(unit)`` to run before autograd computes anything
        of the unit's backward, whichever of ``output``'s tensors (nested tuples, lists and dicts; non-tensors
        ignored) the loss depends on. Reshards as Task 3 does (``reshard_after_forward``), except that a unit is
        never resharded between a recomputation and the backward that needs it."""
        raise NotImplementedError("Task 4: implement BackwardHooks.post_forward() in fsdp_assignment/task4_backward.py (see its docstring)")

    def pre_backward(self, unit: FSDPUnit) -> None:
        """Runs before autograd computes anything of the unit's backward (see ``post_forward``). Afterwards the
        unit is UNSHARDED (all-gathered again only if it was resharded) and its parameter names are views through
        which the gradients reach ``unsharded.grad``, also for a checkpointed region inside the unit that is
        recomputed from them. Raises ``RuntimeError`` when ``unit.shared`` is None (the tree was never
        initialized: ``support.state.init_shared_state``, which Task 7's ``lazy_init`` calls)."""
        raise NotImplementedError("Task 4: implement BackwardHooks.pre_backward() in fsdp_assignment/task4_backward.py (see its docstring)")

    def post_backward(self, unit: FSDPUnit) -> None:
        """The unit's backward is done: reduce its gradients and reshard it, frozen parameters included.

        Each trainable FlatParameter whose full gradient ``unsharded.grad`` is set gives it up (nothing may keep
        it alive) to ``self.reduce_grad``; then every FlatParameter of the unit is resharded (a frozen one's
        ``shard.grad`` stays None) and the unit is marked POST_BACKWARD. It must run as soon as every operation
        of the unit's backward has run, for a unit without any gradient too (the module docstring's frozen
        units). Safe to call more than once per backward (a unit run twice in forward: each call reduces what
        accumulated since the last) and when nothing happened (nothing to reduce).
        """
        raise NotImplementedError("Task 4: implement BackwardHooks.post_backward() in fsdp_assignment/task4_backward.py (see its docstring)")

    def reduce_grad(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """Reduce one full flat gradient ``grad`` of the trainable ``flat_param`` into ``flat_param.shard.grad``.

        With gradient sync off (``unit.requires_gradient_sync`` False: Task 7's ``set_requires_gradient_sync``)
        nothing is communicated: the gradient is kept, full, in ``flat_param.unsynced_grad``, summed with any
        kept before; the next backward with sync on reduces that sum plus its own gradient, once. Gradients are
        summed and reduced in ``unit.reduce_dtype`` (else their own dtype): small gradients summed in bf16 are
        lost."""
        raise NotImplementedError("Task 4: implement BackwardHooks.reduce_grad() in fsdp_assignment/task4_backward.py (see its docstring)")

    def reduce_scatter(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """Reduce-scatter ``grad`` (already in ``reduce_dtype``) and add this rank's slice to
        ``flat_param.shard.grad``, synchronously."""
        raise NotImplementedError("Task 4: implement BackwardHooks.reduce_scatter() in fsdp_assignment/task4_backward.py (see its docstring)")

    def finalize_backward(self, shared: SharedState) -> None:
        """Runs exactly once per backward pass, after autograd's last operation of it (nested passes that a
        reentrant checkpoint runs inside it included), whichever unit the loss came from: the backstop that makes
        the module docstring's "when ``loss.backward()`` returns" rules hold. It runs ``self.post_backward`` for
        every unit that still needs it (still unsharded, holding a full gradient, or with an all-gather in flight:
        a unit that Task 6 prefetched and that then did not run), then finishes every reduction in flight
        (``self.wait_for_reductions``), and leaves every unit ready for the next iteration."""
        raise NotImplementedError("Task 4: implement BackwardHooks.finalize_backward() in fsdp_assignment/task4_backward.py (see its docstring)")

    def wait_for_reductions(self, shared: SharedState) -> None:
        """Finish every reduction still in flight. Here they are all synchronous: nothing to do (Task 6
        overrides it)."""
        raise NotImplementedError("Task 4: implement BackwardHooks.wait_for_reductions() in fsdp_assignment/task4_backward.py (see its docstring)")
