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

from __future__ import annotations

import torch
import torch.nn as nn


def _resolve(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """'blocks.0.attn.c_attn.weight' -> (the c_attn module, 'weight')."""
    module_path, _, attr = name.rpartition(".")
    return (root.get_submodule(module_path) if module_path else root), attr


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
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if not param_names:
            raise ValueError("a FlatParameter needs at least one parameter")
        self.module = module
        self.rank, self.world_size = rank, world_size

        # Deduplicate by identity: tied parameters are flattened (and updated) once.
        self.param_names: list[str] = []
        self.aliases: dict[str, str] = {}
        unique: dict[int, tuple[str, nn.Parameter]] = {}
        for name in param_names:
            param = module.get_parameter(name)
            if id(param) not in unique:
                unique[id(param)] = (name, param)
                self.param_names.append(name)
            self.aliases[name] = unique[id(param)][0]
        params = [p for _, p in unique.values()]
        first = params[0]
        for name, p in unique.values():
            if (p.dtype, p.device, p.requires_grad) != (first.dtype, first.device, first.requires_grad):
                raise ValueError(f"parameter {name!r} differs in dtype/device/requires_grad from the rest; "
                                 "one FlatParameter holds parameters that agree on all three")

        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.param_offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded_numel = -(-self.numel // world_size) * world_size
        self.shard_numel = self.padded_numel // world_size
        self.shard_offset = rank * self.shard_numel
        self.dtype, self.device, self.requires_grad = first.dtype, first.device, first.requires_grad

        # The shard starts as zeros, so the padding (if this rank holds any) is zero.
        self.shard = nn.Parameter(torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device),
                                  requires_grad=self.requires_grad)
        for name, param in zip(self.param_names, params):
            self.copy_into_shard(name, param.detach())

        # Remove the originals: from now on the unit owns its parameters only through ``shard``.
        for name in self.aliases:
            owner, attr = _resolve(module, name)
            if attr in owner._parameters:
                del owner._parameters[attr]
        # A leaf that requires grad (when trainable): autograd accumulates every view's gradient into its
        # ``.grad``, one padded flat gradient, which is exactly what the reduce-scatter needs. (So a parameter
        # unused in forward gets zeros there, not None as in plain PyTorch: see Task 4's module docstring.) The tensor
        # object lives as long as the FlatParameter (hooks are registered on it); only its storage comes
        # and goes.
        self.unsharded = torch.empty(self.padded_numel, dtype=unsharded_dtype or self.dtype, device=self.device)
        self.unsharded.untyped_storage().resize_(0)
        self.unsharded.requires_grad_(self.requires_grad)
        # Full gradient summed over backward passes run without gradient sync (Task 7), else None.
        self.unsynced_grad: torch.Tensor | None = None

    # ---- memory ------------------------------------------------------------------------------------------
    def is_unsharded(self) -> bool:
        """True while the unsharded buffer has storage (holds, or is about to hold, every rank's data)."""
        return self.unsharded.untyped_storage().size() > 0

    def alloc_unsharded(self) -> None:
        """Give ``unsharded`` storage for exactly ``padded_numel`` elements of its own dtype (``param_dtype``
        under mixed precision), no more: the tests measure its bytes. Contents undefined until filled."""
        if not self.is_unsharded():
            self.unsharded.untyped_storage().resize_(self.padded_numel * self.unsharded.element_size())

    def free_unsharded(self) -> None:
        """Free the unsharded buffer's memory: storage size 0, the bytes really returned although views of
        it are alive (module docstring). The shard is untouched."""
        # Resizing the storage (not dropping the tensor) returns the memory while every view stays valid.
        self.unsharded.untyped_storage().resize_(0)

    # ---- views -------------------------------------------------------------------------------------------
    def unsharded_views(self) -> list[torch.Tensor]:
        """One view of ``unsharded`` per unique parameter, in ``param_names`` order, with the parameter's
        shape, covering its elements ``[param_offsets[i], param_offsets[i] + numels[i])``. Views, not copies:
        they share ``unsharded``'s storage, so what is written into one shows in the other.
        """
        # One torch.split rather than a slice per parameter: autograd then has one node that concatenates all the
        # parameters' gradients into the flat gradient, instead of one node per slice each allocating (and
        # zero-filling) a gradient the size of the whole buffer.
        pieces = torch.split(self.unsharded, self.numels + [self.padded_numel - self.numel])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def use_unsharded_views(self) -> None:
        """Point every original parameter name (aliases included) at its view of the unsharded buffer, as a
        plain tensor attribute; a tied parameter's names get the same view. Gradients of a loss computed with
        them reach ``unsharded.grad``, also after a forward under ``torch.no_grad()``."""
        # Fresh views, made now with autograd recording: views made under torch.no_grad() (an evaluation
        # forward) would not connect to ``unsharded`` in the graph, and gradients would silently stop.
        views = dict(zip(self.param_names, self.unsharded_views()))
        for name, unique_name in self.aliases.items():
            owner, attr = _resolve(self.module, name)
            setattr(owner, attr, views[unique_name])

    # ---- shard I/O ---------------------------------------------------------------------------------------
    def shard_range(self, name: str) -> tuple[int, int, int]:
        """For parameter ``name`` (any of its aliases): ``(start, end, at)``, where ``[start, end)`` are the
        indices of its flattened elements that lie in this rank's shard and ``at`` is where that piece starts
        inside the shard. ``(0, 0, 0)`` when no element of it lies here."""
        i = self.param_names.index(self.aliases[name])
        lo = max(self.param_offsets[i], self.shard_offset)
        hi = min(self.param_offsets[i] + self.numels[i], self.shard_offset + self.shard_numel)
        if hi <= lo:
            return 0, 0, 0
        return lo - self.param_offsets[i], hi - self.param_offsets[i], lo - self.shard_offset

    def copy_into_shard(self, name: str, full: torch.Tensor) -> None:
        """Copy the part of the full parameter ``name`` that lies in this rank's shard into ``shard``."""
        start, end, at = self.shard_range(name)
        if end > start:
            with torch.no_grad():
                self.shard[at:at + end - start].copy_(full.reshape(-1)[start:end])
