"""Task 2: FlatParameter.

A FlatParameter turns a unit's parameters into one 1-D buffer so that one collective moves them all:

    unsharded (padded_numel):  | p0 ... | p1 ...... | p2 .. | pad |
    rank r keeps shard r:      |<- shard_numel ->|<- shard_numel ->| ...   (shard_offset = r * shard_numel)

``padded_numel`` is ``numel`` rounded up to a multiple of the world size W, so every rank holds a shard of
the same size (collectives need equal sizes); the padding is zero and must stay zero. Between uses the
unsharded buffer keeps its tensor object but its storage is resized to 0 bytes: the memory is really freed,
while views of it (which autograd may have saved for backward) stay valid and see the data again once the
storage is re-allocated and refilled.
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.nn as nn


class FlatParameter:
    """The flattened, padded, sharded parameters of one unit, and the views that stand in for them.

    Attributes (the tests read them):
        param_names:   the unique parameters' names, relative to ``module``, in flattening order
        aliases:       every name in ``param_names`` given to the constructor -> the unique name it shares
                       storage with (a tied parameter appears once in ``param_names``, twice here)
        shapes, numels, param_offsets: per unique parameter, its shape, numel, and offset in the flat buffer
        numel:         sum of ``numels`` (no padding)
        padded_numel:  ``numel`` rounded up to a multiple of ``world_size``
        shard_numel:   ``padded_numel // world_size``
        shard_offset:  ``rank * shard_numel``, where this rank's shard starts in the flat buffer
        shard:         ``nn.Parameter`` of shape ``[shard_numel]``: this rank's shard (what the optimizer sees)
        unsharded:     1-D tensor of ``padded_numel`` elements whose storage has size 0 while sharded. A
                       *leaf* (made with ``torch.empty``, never the result of an op) whose ``requires_grad`` is
                       the parameters': autograd then accumulates every view's gradient into ``unsharded.grad``,
                       one padded flat gradient, which Task 4 reduce-scatters. So a trainable parameter unused
                       in forward gets zeros there when another parameter of this FlatParameter got a
                       gradient (plain PyTorch leaves its ``.grad`` at None; Task 4's module docstring).
        unsynced_grad: None here. Task 4 (``BackwardHooks.reduce_grad``) keeps in it the full flat gradient
                       summed over backward passes run without gradient sync (Task 7's
                       ``set_requires_gradient_sync(False)``), in ``reduce_dtype``, until a synced backward
                       reduces it.
        module, rank, world_size, dtype, device, requires_grad: as given, or the parameters' (all agree)
    """

    def __init__(self, module: nn.Module, param_names: list[str], rank: int, world_size: int,
                 unsharded_dtype: torch.dtype | None = None):
        """Flatten ``module``'s parameters ``param_names`` and keep only ``rank``'s shard.

        All parameters must share dtype, device and ``requires_grad``, else ``ValueError`` (as for an empty
        ``param_names`` or a rank outside ``[0, world_size)``). A parameter reachable under several names (tied
        weights) is stored once, under the first of its names in ``param_names``; ``aliases`` maps every name
        to that one. The original ``nn.Parameter``s are removed from their modules
        (so ``module.parameters()`` no longer yields them); ``use_unsharded_views()`` puts views back as plain
        tensor attributes. Works on the ``meta`` device too (then the shard is on ``meta`` as well).
        ``unsharded_dtype`` (mixed precision) is the dtype of ``unsharded``; by default the parameters'.
        Memory: never materializes the full flat buffer; each parameter's slice that falls in this rank's
        shard is copied straight into the shard.
        """
        raise NotImplementedError("Task 2: implement FlatParameter.__init__() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def is_unsharded(self) -> bool:
        """True while the unsharded buffer has storage (holds, or is about to hold, every rank's data)."""
        raise NotImplementedError("Task 2: implement FlatParameter.is_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def alloc_unsharded(self) -> None:
        """Give ``unsharded`` storage for ``padded_numel`` elements (contents undefined until filled)."""
        raise NotImplementedError("Task 2: implement FlatParameter.alloc_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def free_unsharded(self) -> None:
        """Free the unsharded buffer's memory by resizing its storage to 0 bytes (views stay valid objects)."""
        raise NotImplementedError("Task 2: implement FlatParameter.free_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def unsharded_views(self) -> list[torch.Tensor]:
        """One view of ``unsharded`` per unique parameter, with the parameter's shape (no copies).

        Made with one ``torch.split`` rather than a slice per parameter: autograd then has one node that
        concatenates all the parameters' gradients into the flat gradient, instead of one node per slice
        each allocating (and zero-filling) a gradient the size of the whole buffer.
        """
        raise NotImplementedError("Task 2: implement FlatParameter.unsharded_views() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def use_unsharded_views(self) -> None:
        """Point every original parameter name (aliases included) at its view of the unsharded buffer.

        The views are made now, with autograd recording, so that gradients flow into ``unsharded.grad``.
        """
        raise NotImplementedError("Task 2: implement FlatParameter.use_unsharded_views() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def shard_range(self, name: str) -> tuple[int, int, int]:
        """For parameter ``name`` (any of its aliases): ``(start, end, at)``, where ``[start, end)`` are the
        indices of its flattened elements that lie in this rank's shard and ``at`` is where that piece starts
        inside the shard. ``(0, 0, 0)`` when no element of it lies here."""
        raise NotImplementedError("Task 2: implement FlatParameter.shard_range() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def copy_into_shard(self, name: str, full: torch.Tensor) -> None:
        """Copy the part of the full parameter ``name`` that lies in this rank's shard into ``shard``."""
        raise NotImplementedError("Task 2: implement FlatParameter.copy_into_shard() in fsdp_assignment/task2_flat_param.py (see its docstring)")
