"""Task 2: FlatParameter.

A FlatParameter turns a unit's parameters into one 1-D buffer so that one collective moves them all:

    unsharded (padded_numel):  | p0 ... | p1 ...... | p2 .. | pad |
    rank r keeps shard r:      |<- shard_numel ->|<- shard_numel ->| ...   (shard_offset = r * shard_numel)

``padded_numel`` is the smallest multiple of the world size W that holds ``numel``, so every rank holds a
shard of the same size; the padding is zero and stays zero. While sharded, only the shard exists: the
unsharded buffer's storage has size 0 (``unsharded.untyped_storage().size() == 0``).

The problem to solve: the module's parameters are views of the unsharded buffer, which autograd may keep
(saved for backward) after the buffer is freed. Freeing must return the memory all the same, and those view
objects must see the data again once the buffer is re-allocated and refilled.
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
        shard:         ``nn.Parameter`` of shape ``[shard_numel]``: this rank's shard (what the optimizer
                       sees), with storage of its own
        unsharded:     1-D tensor of ``padded_numel`` elements, storage size 0 while sharded; one tensor
                       object for the FlatParameter's whole life. A *leaf* whose ``requires_grad`` is the
                       parameters': the gradients of all its views accumulate in ``unsharded.grad``, one padded
                       flat gradient (Task 4 reduce-scatters it; a trainable parameter unused in forward gets
                       zeros there, not None)
        unsynced_grad: None here; Task 4 keeps in it the full flat gradient (in ``reduce_dtype``) summed over
                       backward passes without gradient sync (Task 7), until a synced backward reduces it
        module, rank, world_size, dtype, device, requires_grad: as given, or the parameters' (all agree)

    The tests call the constructor and the methods below.
    """

    def __init__(self, module: nn.Module, param_names: list[str], rank: int, world_size: int,
                 unsharded_dtype: torch.dtype | None = None):
        """Flatten ``module``'s parameters ``param_names`` and keep only ``rank``'s shard.

        ``ValueError`` when the parameters differ in dtype, device or ``requires_grad``, when ``param_names``
        is empty, or when ``rank`` is outside ``[0, world_size)``. A parameter reachable under several names
        (tied weights) is stored once, under the first of its names in ``param_names``; ``aliases`` maps every
        name to that one. Afterwards:

        - the shards of ranks ``0..W-1``, concatenated, are the parameters flattened in ``param_names`` order
          followed by zeros;
        - the original ``nn.Parameter``s are no longer registered on their modules (``module.parameters()``
          does not yield them); ``use_unsharded_views()`` puts views back as plain tensor attributes;
        - the FlatParameter starts sharded: ``unsharded``'s storage has size 0.

        On ``meta`` parameters ``shard`` and ``unsharded`` are on ``meta`` too (Task 1 materializes both, and
        they stay the same Python objects).
        ``unsharded_dtype`` (mixed precision) is the dtype of ``unsharded``; by default the parameters'.
        Memory: never allocates a full flat buffer; at most the shard and the parameters already there.
        """
        raise NotImplementedError("Task 2: implement FlatParameter.__init__() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def is_unsharded(self) -> bool:
        """True while the unsharded buffer has storage (holds, or is about to hold, every rank's data)."""
        raise NotImplementedError("Task 2: implement FlatParameter.is_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def alloc_unsharded(self) -> None:
        """Give ``unsharded`` storage for exactly ``padded_numel`` elements of its own dtype (``param_dtype``
        under mixed precision), no more: the tests measure its bytes. Contents undefined until filled."""
        raise NotImplementedError("Task 2: implement FlatParameter.alloc_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def free_unsharded(self) -> None:
        """Free the unsharded buffer's memory: storage size 0, the bytes really returned although views of
        it are alive (module docstring). The shard is untouched."""
        raise NotImplementedError("Task 2: implement FlatParameter.free_unsharded() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def unsharded_views(self) -> list[torch.Tensor]:
        """One view of ``unsharded`` per unique parameter, in ``param_names`` order, with the parameter's
        shape, covering its elements ``[param_offsets[i], param_offsets[i] + numels[i])``. Views, not copies:
        they share ``unsharded``'s storage, so what is written into one shows in the other.
        """
        raise NotImplementedError("Task 2: implement FlatParameter.unsharded_views() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def use_unsharded_views(self) -> None:
        """Point every original parameter name (aliases included) at its view of the unsharded buffer, as a
        plain tensor attribute; a tied parameter's names get the same view. Gradients of a loss computed with
        them reach ``unsharded.grad``, also after a forward under ``torch.no_grad()``."""
        raise NotImplementedError("Task 2: implement FlatParameter.use_unsharded_views() in fsdp_assignment/task2_flat_param.py (see its docstring)")

    def shard_range(self, name: str) -> tuple[int, int, int]:
        """For parameter ``name`` (any of its aliases): ``(start, end, at)``, where ``[start, end)`` are the
        indices of its flattened elements that lie in this rank's shard and ``at`` is where that piece starts
        inside the shard. ``(0, 0, 0)`` when no element of it lies here."""
        raise NotImplementedError("Task 2: implement FlatParameter.shard_range() in fsdp_assignment/task2_flat_param.py (see its docstring)")
