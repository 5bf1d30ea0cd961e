"""Task 4: backward.

A unit that resharded after forward must be all-gathered again before autograd runs its backward, because
the views autograd saved point into the (now empty) unsharded buffer. As soon as autograd has finished the
unit's backward, the unit reduce-scatters its padded flat gradient ``unsharded.grad`` (mean over ranks) into
its shard's ``.grad`` and frees both the full gradient and the full parameters: trainable or frozen.

Why "finished the unit's backward" and not "its gradient is ready": take a LoRA-style model, where every
block holds a frozen base weight and a small trainable adapter. The frozen FlatParameter never gets a
gradient, so nothing on it tells you when its block is done; if only the final callback freed it, every
block's frozen weights would be unsharded at the end of backward at once, which is the whole model. So, as
PyTorch's FSDP2 does, the unit applies an identity autograd function to its forward *inputs*
(``RegisterPostBackward``): autograd calls its backward once the gradients of those inputs are complete,
after every operation of the unit has run its backward, and that backward calls ``post_backward``.

Invariants: every reduce-scatter has finished and landed in ``shard.grad`` when ``loss.backward()``
returns (``finalize_backward`` runs as autograd's final callback, the backstop for units whose
post-backward autograd never ran: inputs that need no gradient, detached outputs, units not used); the
padding of ``shard.grad`` is zero; no unit stays unsharded after backward, and during it at most one
non-root unit is unsharded at any moment, the one whose backward runs (activation-checkpointing
recomputation included; Task 6's prefetching adds the next one; the root, whose output is the loss, may
stay unsharded until the final callback); each unit is all-gathered at most once per backward (only if it
was resharded after forward; a reentrant recomputation's gather is that one, see ``post_forward``); a unit
whose parameters got no gradient never blocks (there is nothing to reduce for it, on every rank alike).

Known difference from single-process PyTorch: a trainable parameter that took no part in the forward still
gets a gradient, of zeros, when another parameter of its FlatParameter got one (autograd fills the whole
flat gradient), where plain PyTorch leaves its ``.grad`` at ``None``. Optimizers treat the two differently
(AdamW's weight decay moves a parameter whose gradient is zero, and skips one whose gradient is ``None``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..support.state import FSDPUnit, ShardedState, SharedState, TrainingState
from .task2_flat_param import FlatParameter
from .task3_forward import ForwardHooks, cast_forward_inputs, reshard_unit, wait_for_unshard


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
    """Add a reduced gradient shard into ``flat_param.shard.grad`` (in the shard's dtype, on the shard's device:
    the CPU offload bonus reduces on the compute device and keeps gradients on the CPU)."""
    # A blocking copy when the devices differ: the CPU reads the gradient right after.
    grad_shard = grad_shard.to(device=flat_param.shard.device, dtype=flat_param.shard.dtype)
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


def _replace_tensors(x, new: dict[int, torch.Tensor]):
    """``x`` with every tensor ``t`` for which ``id(t)`` is in ``new`` replaced by ``new[id(t)]``."""
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, (list, tuple)):
        return type(x)(_replace_tensors(v, new) for v in x)
    if isinstance(x, dict):
        return {k: _replace_tensors(v, new) for k, v in x.items()}
    return x


def _in_backward() -> bool:
    # True while autograd's engine runs a backward pass on this thread (FSDP2 asks the same way).
    return torch._C._current_graph_task_id() != -1


class RegisterPostBackward(torch.autograd.Function):
    """Identity on the unit's forward inputs; its backward, which autograd runs once the gradients of those
    inputs are complete (after every operation of the unit), calls ``hooks.post_backward(unit)``."""

    @staticmethod
    def forward(ctx, hooks, unit, *inputs):
        """Keep ``hooks`` and ``unit`` on ``ctx``; return the inputs unchanged (as a tuple of views of them)."""
        ctx.hooks, ctx.unit = hooks, unit
        # Views: new tensors whose grad_fn is this Function, holding the inputs' data (no copy).
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        """Call ``ctx.hooks.post_backward(ctx.unit)``; pass the gradients through (None for hooks and unit)."""
        ctx.hooks.post_backward(ctx.unit)
        return (None, None) + grads


class BackwardHooks(ForwardHooks):
    """Task 3's forward life cycle plus backward: pre-backward re-gather, post-backward reduce-scatter and
    reshard, and the final callback. Task 6's ``PrefetchHooks`` extends it."""

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Task 3's ``pre_forward``, after registering the post-backward trigger on the inputs.

        When autograd is recording, pass the floating-point input tensors that require grad, positional and
        keyword arguments alike, through ``RegisterPostBackward`` (one call for all of them; none when no
        input requires grad) and continue with the returned inputs. Do it *before* Task 3's ``pre_forward``
        makes the parameter views: autograd runs ready nodes newest first, so the views' node (which
        accumulates ``unsharded.grad``) is then guaranteed to run before ``post_backward`` reads the gradient.
        The tests check that every unit whose inputs carry a gradient reduces it from this trigger, before
        backward reaches the root's inputs, not later from the final callback.

        Activation checkpointing: a forward that runs while the unit is in PRE_BACKWARD is the recomputation
        of a checkpointed region during the unit's own backward (``torch.utils.checkpoint`` with
        ``use_reentrant=False``). It must only make sure the unit is unsharded (``wait_for_unshard``) and
        return the cast inputs: no new post-backward trigger, no change of state.
        """
        if unit.training_state == TrainingState.PRE_BACKWARD:
            wait_for_unshard(unit)
            return cast_forward_inputs(unit, args, kwargs)
        if torch.is_grad_enabled():
            inputs = [t for t in _flatten_tensors((args, kwargs)) if t.requires_grad]
            if inputs:
                outputs = RegisterPostBackward.apply(self, unit, *inputs)
                new = {id(t): o for t, o in zip(inputs, outputs)}
                args, kwargs = _replace_tensors(args, new), _replace_tensors(kwargs, new)
        return super().pre_forward(unit, args, kwargs)

    def post_forward(self, unit: FSDPUnit, output):
        """Task 3's ``post_forward``; then, when autograd is recording, arrange for ``self.pre_backward(unit)``
        to run once, when autograd first reaches any of ``output``'s tensors that require grad
        (``torch.autograd.graph.register_multi_grad_hook(..., mode="any")``). During a recomputation
        (the unit is in PRE_BACKWARD, see ``pre_forward``) do nothing: the unit stays unsharded for the
        backward that is running. Returns ``output``.

        Reentrant checkpointing around a whole unit (``checkpoint(block, x, use_reentrant=True)``) is the
        other recomputation: the first forward ran under ``torch.no_grad()`` (so it registered no hooks), and
        the recomputation runs during backward (``torch._C._current_graph_task_id() != -1``) as an ordinary
        forward of the unit, whose own backward follows at once. Then do not reshard (skip Task 3's
        ``post_forward``, just mark the unit IDLE) and still register the pre-backward hook: the unit is
        all-gathered once per backward, by the recomputation (the tests count the all-gathers per unit per
        backward: resharding here costs one more per unit)."""
        if unit.training_state == TrainingState.PRE_BACKWARD:
            return output
        if _in_backward():
            # A reentrant recomputation: its backward comes next; a reshard here would only be undone by
            # pre_backward's re-gather (two all-gathers for one backward).
            unit.training_state = TrainingState.IDLE
        else:
            output = super().post_forward(unit, output)
        if torch.is_grad_enabled():
            tensors = [t for t in _flatten_tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self.pre_backward(unit),
                                                              mode="any")
        return output

    def pre_backward(self, unit: FSDPUnit) -> None:
        """Before the unit's backward: queue ``self.finalize_backward(unit.shared)`` as autograd's final
        callback once per backward pass (``torch.autograd.Variable._execution_engine.queue_callback``;
        ``shared.backward_callback_queued`` says whether it is queued), mark the unit PRE_BACKWARD and
        make it UNSHARDED (``wait_for_unshard``: re-gathers it if it was resharded).

        Make the views under ``torch.enable_grad()``: autograd runs hooks with grad mode off, and a
        reentrant activation checkpoint inside the unit (``use_reentrant=True``) recomputes its forward
        from these views, so they must be connected to ``unsharded`` for its gradient to reach it.

        Where the callback is queued matters under reentrant checkpointing: a reentrant recomputation runs
        its own, nested backward pass (a separate graph task), and a callback queued from a hook inside it
        runs when that nested pass ends, long before the whole backward is done. Queue it from the first
        pre-backward of the outer pass, whichever unit's it is (usually the root's, whose output is the loss;
        but a loss may be made from a unit's output that the root does not return, and then the root's
        pre-backward never runs) and, once ``shared.backward_callback_queued`` is set, never again until
        ``finalize_backward`` clears it."""
        shared = unit.shared
        if shared is None:
            raise RuntimeError("pre_backward: unit.shared is None; the tree was never initialized "
                               "(support.state.init_shared_state, which Task 7's lazy_init calls)")
        if not shared.backward_callback_queued:
            shared.backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finalize_backward(shared))
        unit.training_state = TrainingState.PRE_BACKWARD
        with torch.enable_grad():
            wait_for_unshard(unit)

    def post_backward(self, unit: FSDPUnit) -> None:
        """The unit's backward is done: reduce its gradients and reshard it, frozen parameters included.

        For each trainable FlatParameter whose ``unsharded.grad`` is set: drop ``unsharded.grad`` and hand
        it to ``self.reduce_grad``. Then reshard the unit (``reshard_unit``), frozen FlatParameters included
        (their ``shard.grad`` stays None), and mark it POST_BACKWARD.
        Safe to call more than once per backward (a unit run twice in forward gets one call per run: each
        reduces what was accumulated since the last) and when nothing happened (nothing to reduce).
        """
        unit.training_state = TrainingState.POST_BACKWARD
        for flat_param in unit.flat_params:
            grad = flat_param.unsharded.grad
            if flat_param.requires_grad and grad is not None:
                flat_param.unsharded.grad = None
                self.reduce_grad(unit, flat_param, grad)
        reshard_unit(unit)

    def reduce_grad(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """Reduce one full flat gradient ``grad`` of ``flat_param`` into ``flat_param.shard.grad``.

        ``grad`` is kept in ``reduce_dtype`` (``unit.reduce_dtype``, else its own dtype) and added to any
        gradient accumulated without sync (``flat_param.unsynced_grad``, which is then cleared). With
        gradient sync off (``unit.requires_gradient_sync`` False, Task 7) the sum is stored back in
        ``unsynced_grad`` for a later synced backward; with sync on it is reduce-scattered
        (``reduce_scatter_grad``, synchronously here; Task 6 overrides ``reduce_scatter`` to go async)
        and added to ``shard.grad`` (``accumulate_shard_grad``)."""
        grad = grad.to(unit.reduce_dtype or grad.dtype)
        if flat_param.unsynced_grad is not None:
            grad = flat_param.unsynced_grad.add_(grad)
            flat_param.unsynced_grad = None
        if not unit.requires_gradient_sync:
            flat_param.unsynced_grad = grad
        else:
            self.reduce_scatter(unit, flat_param, grad)

    def reduce_scatter(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """Reduce-scatter ``grad`` (already in ``reduce_dtype``) and add this rank's slice to
        ``flat_param.shard.grad``, synchronously."""
        _, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group)
        accumulate_shard_grad(flat_param, grad_shard)

    def finalize_backward(self, shared: SharedState) -> None:
        """Autograd's final callback, the backstop: run ``self.post_backward`` for every unit that is still
        unsharded, has a prefetched all-gather in flight (a unit prefetched by the recorded order that then did
        not run) or holds an ``unsharded.grad`` (its post-backward autograd never ran: no input required
        grad, its output was detached, or it ran forward but not backward), then ``self.wait_for_reductions``,
        then mark every unit IDLE and clear ``shared.backward_callback_queued``. Units in reverse module
        pre-order, roughly the order backward reaches them."""
        for unit in reversed(shared.units):
            if unit.sharded_state == ShardedState.UNSHARDED or unit.pending_unshard or any(
                    fp.requires_grad and fp.unsharded.grad is not None for fp in unit.flat_params):
                self.post_backward(unit)
        self.wait_for_reductions(shared)
        for unit in shared.units:
            unit.training_state = TrainingState.IDLE
        shared.backward_callback_queued = False

    def wait_for_reductions(self, shared: SharedState) -> None:
        """Finish every reduction still in flight. Here they are all synchronous: nothing to do (Task 6
        overrides it)."""
