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


# When is a unit's backward done? Not "when its gradient is ready": a LoRA block's frozen FlatParameter never gets
# a gradient, so nothing on it says when its block is done; if only the final callback freed it, every block's
# frozen weights would be unsharded at the end of backward at once, the whole model. So, as PyTorch's FSDP2 does,
# the unit passes its forward *inputs* through this identity autograd function: autograd calls its backward once
# the gradients of those inputs are complete, after every operation of the unit has run its backward, and that
# backward calls ``post_backward``.
class _RegisterPostBackward(torch.autograd.Function):
    """Identity on the unit's forward inputs; its backward calls ``hooks.post_backward(unit)``."""

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
    """A unit's life cycle in forward and backward.

    The tests call only ``BackwardHooks().register(unit)`` (Task 3's ``register``): afterwards every forward and
    backward through ``unit.module`` keeps the module docstring's rules. Task 6's ``PrefetchHooks`` extends this
    class, and Task 7's ``fully_shard`` registers that. Which methods it has, and how each runs at its moment,
    is this task's design.
    """

    def pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Runs before every forward of ``unit.module`` (Task 3's, extended), including a forward that activation
        checkpointing runs again during backward to recompute a region. Returns the ``(args, kwargs)`` the forward
        runs with: the inputs cast as Task 3 casts them (same values; they may be other tensor objects). A
        recomputation finds the unit unsharded or makes it so, and gathers nothing more than the module
        docstring allows.
        """
        # Activation checkpointing, use_reentrant=False: a forward while the unit is in PRE_BACKWARD is the
        # recomputation of a checkpointed region during the unit's own backward. Only make sure the unit is
        # unsharded and cast the inputs: no new post-backward trigger, no change of state.
        if unit.training_state == TrainingState.PRE_BACKWARD:
            wait_for_unshard(unit)
            return cast_forward_inputs(unit, args, kwargs)
        # The post-backward trigger on every input that requires grad, positional and keyword alike (one call for
        # all of them; none when no input requires grad). Applied *before* Task 3's pre_forward makes the
        # parameter views: autograd runs ready nodes newest first, so the views' node (which accumulates
        # ``unsharded.grad``) then always runs before post_backward reads the gradient.
        if torch.is_grad_enabled():
            inputs = [t for t in _flatten_tensors((args, kwargs)) if t.requires_grad]
            if inputs:
                outputs = _RegisterPostBackward.apply(self, unit, *inputs)
                new = {id(t): o for t, o in zip(inputs, outputs)}
                args, kwargs = _replace_tensors(args, new), _replace_tensors(kwargs, new)
        return super().pre_forward(unit, args, kwargs)

    def post_forward(self, unit: FSDPUnit, output):
        """Runs after every forward of ``unit.module`` (Task 3's, extended), recomputations included; returns
        ``output`` unchanged. Arranges for ``self.pre_backward(unit)`` to run before autograd computes anything
        of the unit's backward, whichever of ``output``'s tensors (nested tuples, lists and dicts; non-tensors
        ignored) the loss depends on. Reshards as Task 3 does (``reshard_after_forward``), except that a unit is
        never resharded between a recomputation and the backward that needs it."""
        # Non-reentrant recomputation (PRE_BACKWARD, see pre_forward): do nothing, the unit stays unsharded for
        # the backward that is running.
        if unit.training_state == TrainingState.PRE_BACKWARD:
            return output
        if _in_backward():
            # A reentrant recomputation: its backward comes next; a reshard here would only be undone by
            # pre_backward's re-gather (two all-gathers for one backward). Reentrant checkpointing around a whole
            # unit runs the first forward under no_grad (no hooks registered), and the recomputation during
            # backward as an ordinary forward of the unit: mark it IDLE and still register the pre-backward hook.
            unit.training_state = TrainingState.IDLE
        else:
            output = super().post_forward(unit, output)
        # pre_backward runs once, when autograd first reaches any of the output tensors that require grad
        # (mode="any": with "all", an output the loss does not use would hold it back forever).
        if torch.is_grad_enabled():
            tensors = [t for t in _flatten_tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self.pre_backward(unit),
                                                              mode="any")
        return output

    def pre_backward(self, unit: FSDPUnit) -> None:
        """Runs before autograd computes anything of the unit's backward (see ``post_forward``). Afterwards the
        unit is UNSHARDED (all-gathered again only if it was resharded) and its parameter names are views through
        which the gradients reach ``unsharded.grad``, also for a checkpointed region inside the unit that is
        recomputed from them. Raises ``RuntimeError`` when ``unit.shared`` is None (the tree was never
        initialized: ``support.state.init_shared_state``, which Task 7's ``lazy_init`` calls)."""
        # Queue finalize_backward as autograd's final callback from the first pre-backward of the pass, whichever
        # unit's it is (usually the root's, whose output is the loss; but a loss may be made from a unit's output
        # that the root does not return, and then the root's pre-backward never runs), and never again until
        # finalize_backward clears the flag. Where matters under reentrant checkpointing: the recomputation runs
        # its own nested backward pass, and a callback queued from a hook inside it would run when that nested
        # pass ends, long before the whole backward is done.
        shared = unit.shared
        if shared is None:
            raise RuntimeError("pre_backward: unit.shared is None; the tree was never initialized "
                               "(support.state.init_shared_state, which Task 7's lazy_init calls)")
        if not shared.backward_callback_queued:
            shared.backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finalize_backward(shared))
        # Views made under enable_grad: autograd runs hooks with grad mode off, and a reentrant checkpoint inside
        # the unit recomputes its forward from these views, so they must be connected to ``unsharded``.
        unit.training_state = TrainingState.PRE_BACKWARD
        with torch.enable_grad():
            wait_for_unshard(unit)

    def post_backward(self, unit: FSDPUnit) -> None:
        """The unit's backward is done: reduce its gradients and reshard it, frozen parameters included.

        Each trainable FlatParameter whose full gradient ``unsharded.grad`` is set gives it up (nothing may keep
        it alive) to ``self.reduce_grad``; then every FlatParameter of the unit is resharded (a frozen one's
        ``shard.grad`` stays None) and the unit is marked POST_BACKWARD. It must run as soon as every operation
        of the unit's backward has run, for a unit without any gradient too (the module docstring's frozen
        units). Safe to call more than once per backward (a unit run twice in forward: each call reduces what
        accumulated since the last) and when nothing happened (nothing to reduce).
        """
        unit.training_state = TrainingState.POST_BACKWARD
        for flat_param in unit.flat_params:
            grad = flat_param.unsharded.grad
            if flat_param.requires_grad and grad is not None:
                flat_param.unsharded.grad = None
                self.reduce_grad(unit, flat_param, grad)
        reshard_unit(unit)

    def reduce_grad(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        """Reduce one full flat gradient ``grad`` of the trainable ``flat_param`` into ``flat_param.shard.grad``.

        With gradient sync off (``unit.requires_gradient_sync`` False: Task 7's ``set_requires_gradient_sync``)
        nothing is communicated: the gradient is kept, full, in ``flat_param.unsynced_grad``, summed with any
        kept before; the next backward with sync on reduces that sum plus its own gradient, once. Gradients are
        summed and reduced in ``unit.reduce_dtype`` (else their own dtype): small gradients summed in bf16 are
        lost."""
        # Synchronous here (reduce_scatter); Task 6 overrides reduce_scatter to go asynchronous.
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
        """Runs exactly once per backward pass, after autograd's last operation of it (nested passes that a
        reentrant checkpoint runs inside it included), whichever unit the loss came from: the backstop that makes
        the module docstring's "when ``loss.backward()`` returns" rules hold. It runs ``self.post_backward`` for
        every unit that still needs it (still unsharded, holding a full gradient, or with an all-gather in flight:
        a unit that Task 6 prefetched and that then did not run), then finishes every reduction in flight
        (``self.wait_for_reductions``), and leaves every unit ready for the next iteration."""
        # Backstop for units whose post-backward autograd never ran: no input required grad, the output was
        # detached, or the unit ran forward but not backward. Reverse module pre-order, roughly backward's order;
        # post_backward may issue reductions, so they are waited on after it.
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
