"""Task 1: meta-device init.

A model too big for one device cannot be built eagerly and then sharded. Instead it is built on the
``meta`` device (shapes and dtypes, no memory), optionally sharded with ``fully_shard`` (still on meta),
and then materialized here: module by module, in the order eager init ran, so that

- every parameter and buffer is bitwise identical to eager init under the same seed: the random number
  generator is *replayed*, consuming exactly the numbers eager init consumed, in the same order (modules
  that own only buffers included); and
- everything else stays as it was: a parameter's ``requires_grad`` (frozen stays frozen, sharded or not),
  an FSDP unit's unsharded buffer's dtype (``param_dtype`` under mixed precision); and
- for sharded units, each module's full parameters exist only while that module is initialized: its
  slice is copied into the unit's shard and the full tensor is dropped. So at most one unit's full
  parameters (in fact one module's) exist at any time.

The contract with the model (``fsdp_assignment/support/models.py`` follows it, as do torch's layers): a
module that owns parameters or buffers directly defines ``reset_parameters()`` initializing exactly those,
and eager ``__init__`` ran those inits in module pre-order (``module.modules()``). A tied parameter takes
the value given by its first owner in pre-order; the later owner's init still consumed random numbers in
eager mode (it initialized its own weight before being tied), so the replay runs it on a scratch tensor.
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

    Walk ``module.modules()`` in pre-order. For each module that owns meta parameters or buffers (directly,
    or through a FlatParameter of its FSDP unit), give them storage on ``device`` in their own dtype (a bf16
    or fp64 model stays bf16 or fp64; integer and boolean buffers stay integer and boolean), call the module's
    ``reset_parameters()``, and, for parameters of a sharded unit, copy this rank's slice into the unit's
    shard and drop the full tensor. Raise a ``TypeError`` naming the module when it owns meta state but has
    no ``reset_parameters()``. Call it with the same seed on every rank. Parameters and buffers that are
    already off ``meta`` keep their values, and ``None`` buffers stay ``None``.

    A FlatParameter on ``meta`` (Task 2) is materialized whole: its ``shard`` becomes a zero-filled
    ``nn.Parameter`` on ``device`` and its ``unsharded`` an empty (storage size 0) tensor on ``device``, each
    keeping its dtype and ``requires_grad``; replace them in place (``torch.utils.swap_tensors``), so the
    Python objects a module or an optimizer already holds stay the ones in use.
    """
    raise NotImplementedError("Task 1: implement materialize_meta_module() in fsdp_assignment/task1_meta_init.py (see its docstring)")
