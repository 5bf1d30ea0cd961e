"""Task 1: meta-device init.

A model too big for one device cannot be built eagerly and then sharded. It is built on the ``meta`` device
(shapes and dtypes, no memory), optionally sharded there (Task 2's FlatParameters, Task 7's
``fully_shard``), and then materialized here. Afterwards:

- every parameter and buffer is bitwise identical to eager init under the same seed, and the global random
  generator is in the state eager init left it in (the same numbers consumed, no more, no fewer);
- nothing else changed: the state dict's names, every parameter still an ``nn.Parameter`` with its
  ``requires_grad`` (frozen stays frozen), tied parameters still one object, every dtype (a unit's
  unsharded buffer keeps its ``param_dtype``);
- memory: during materialization, at most one unit's padded full parameters exist on top of the shards.

The model's contract (``fsdp_assignment/support/models.py`` follows it, as do torch's layers): a module that
owns parameters or buffers directly defines ``reset_parameters()`` initializing exactly those (not its
children's), and its eager ``__init__`` calls it right after creating them, before creating any child module;
children are created in the order they are assigned. A tied parameter keeps the value its first
initializer gave it, but every owner's init consumed random numbers.

Problems to solve: in which order did eager construction consume the generator, and how do you replay
exactly that? What does a tied parameter's second owner do in the replay? How do you keep a sharded unit's
full parameters from piling up?
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def materialize_meta_module(module: nn.Module, device: torch.device | str) -> None:
    """Materialize every meta parameter and buffer of ``module`` on ``device``, with eager-identical values.

    ``module`` may hold meta state directly or in the FlatParameters (Task 2) of FSDP units (a unit's module
    carries ``_fsdp_unit``; ``support/state.py``). Afterwards nothing in it is on ``meta`` and the module
    docstring's rules hold. Called with the same seed on every rank.

    - Dtypes stay: a bf16 or fp64 model stays bf16 or fp64; integer and boolean buffers stay so.
    - A module owning meta parameters or buffers (directly, or through its unit's FlatParameter) without a
      ``reset_parameters()``: ``TypeError`` naming the module (its class or its name).
    - Parameters and buffers already off ``meta`` are left in place with their values, and a module with no
      meta state of its own is not re-initialized (its ``reset_parameters()`` is not called); a module that
      still holds meta state has its ``reset_parameters()`` run, which writes what it writes, real tensors
      included, as in eager init. ``None`` buffers stay ``None``.
    - A sharded unit: each FlatParameter's ``shard`` holds this rank's slice of the eager values (padding
      zero), its ``unsharded`` has storage size 0 on ``device``; both keep dtype and ``requires_grad`` and
      stay the *same Python objects* (the shard may be registered on its module or held by an optimizer).
    """
    raise NotImplementedError("Task 1: implement materialize_meta_module() in fsdp_assignment/task1_meta_init.py (see its docstring)")
