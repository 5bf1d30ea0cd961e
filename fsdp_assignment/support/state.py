"""The state FSDP keeps per unit and per tree (provided code, not a task).

A *unit* is one module passed to ``fully_shard``: its parameters (those no child unit owns) are flattened
into at most two FlatParameters (Task 2): one for trainable parameters and one for frozen ones, because a
FlatParameter has one ``requires_grad``. All units under one root share one ``SharedState``.

The enums make the life cycle explicit, as in PyTorch's FSDP2 (``TrainingState``, ``ShardedState``):

    SHARDED --pre_forward/unshard--> UNSHARDED --post_forward (reshard_after_forward)--> SHARDED
    SHARDED --pre_backward--> UNSHARDED --post_backward--> SHARDED

What is fixed, and what is a suggestion. The tests build units by hand (``tests/public/common.py``,
``hand_shard``): they construct ``FSDPUnit(module=..., flat_params=..., reshard_after_forward=...)``, set
``module._fsdp_unit`` to it, call ``init_shared_state(root)``, and then use only these names, which you must keep
with their meaning:

- ``FSDPUnit.module``, ``.flat_params`` (the trainable FlatParameter, if any, first), ``.is_root``, ``.shared``;
- ``FSDPUnit.reshard_after_forward``: the tests change it between iterations, so read it at every forward;
- ``SharedState.prefetch``: Task 6's switch, which the tests flip on the root's ``shared``;
- ``fsdp_units``, ``named_flat_params`` and ``init_shared_state``.

Everything else here is a *suggested decomposition*, the staff's own: the two enums and every other field of
``FSDPUnit`` and ``SharedState`` are never read by a test, and the configuration fields (``group``, ``param_dtype``, ``cast_forward_inputs``, ``reduce_dtype``,
``requires_gradient_sync``, ``replicate_group``) are set by your own Task 7 and read by your own Tasks 3 to 6.
Use them, ignore them, or replace them with a design of your own; you may add fields to these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


class TrainingState(Enum):
    """Where a unit is in its life cycle (a suggested decomposition: no test reads it)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedState(Enum):
    """Whether a unit's full parameters exist (a suggested decomposition: the tests observe storage sizes)."""

    SHARDED = auto()    # only the local shard exists; the unsharded buffer has storage of size 0
    UNSHARDED = auto()  # the unsharded buffer holds every rank's data; module attributes are its views


@dataclass(eq=False)  # compared with `is`, not field by field: units are kept in lists and looked up with `in`
class FSDPUnit:
    """One FSDP unit: a module and the FlatParameters of the parameters it owns (module docstring: which fields
    the tests use)."""

    module: nn.Module
    flat_params: list  # list[FlatParameter]; the trainable one (if any) first
    group: dist.ProcessGroup | None = None  # the group the unit is sharded over (None: the default group)
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None   # mixed precision: dtype of the unsharded parameters
    cast_forward_inputs: bool = True         # mixed precision: cast floating inputs to param_dtype
    reduce_dtype: torch.dtype | None = None  # mixed precision: dtype of the gradient reduce-scatter
    sharded_state: ShardedState = ShardedState.SHARDED
    training_state: TrainingState = TrainingState.IDLE
    is_root: bool = False
    shared: SharedState | None = None  # set when the tree is initialized (Task 7's lazy root init)
    requires_gradient_sync: bool = True
    # Handles of all-gathers issued for this unit but not yet waited on (Task 6's prefetch).
    pending_unshard: list = field(default_factory=list)
    # HSDP bonus: the group across which the unit is replicated (a 2-D mesh's dim 0); each reduced gradient
    # shard is all-reduced across it. None: no replication (plain FSDP), the required tasks' case.
    replicate_group: dist.ProcessGroup | None = None

    def __repr__(self) -> str:
        return f"FSDPUnit({type(self.module).__name__}, {self.sharded_state.name}, {self.training_state.name})"


@dataclass(eq=False)
class SharedState:
    """One per tree of units (per root); of its fields the tests use only ``prefetch`` (module docstring)."""

    units: list[FSDPUnit]                 # every unit in the tree, parents before their children (root first)
    prefetch: bool = False                # Task 6: forward/backward prefetch and async reduce-scatter
    forward_order: list[FSDPUnit] = field(default_factory=list)  # units in the order the last forward ran them
    recording_order: list[FSDPUnit] = field(default_factory=list)  # the order of the forward in progress
    # Reduce-scatters issued but not yet waited on: (work, flat_param, output shard, input kept alive).
    pending_reduce_scatters: list[tuple[Any, Any, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    backward_callback_queued: bool = False


def fsdp_units(module: nn.Module) -> list[FSDPUnit]:
    """Every FSDPUnit in ``module``'s subtree, parents before their children (a root comes first).

    A module is a unit when it carries a ``_fsdp_unit`` attribute (``fully_shard`` sets it)."""
    units = (getattr(m, "_fsdp_unit", None) for m in module.modules())
    return [u for u in units if isinstance(u, FSDPUnit)]


def named_flat_params(module: nn.Module):
    """Yield ``(prefix, flat_param)`` for every FlatParameter of every unit in ``module``'s subtree; ``prefix``
    is the unit module's name relative to ``module`` plus a dot ('' for ``module`` itself), so
    ``prefix + name`` is a parameter's original name relative to ``module``."""
    for name, sub in module.named_modules():
        unit = getattr(sub, "_fsdp_unit", None)
        if isinstance(unit, FSDPUnit):
            for flat_param in unit.flat_params:
                yield (name + "." if name else ""), flat_param


def init_shared_state(root: FSDPUnit) -> SharedState:
    """Make ``root`` the root of every unit in its module's subtree: they all get one SharedState."""
    units = fsdp_units(root.module)
    shared = SharedState(units=units)
    for unit in units:
        unit.is_root = unit is root
        unit.shared = shared
    return shared
