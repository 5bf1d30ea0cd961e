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

from __future__ import annotations

import torch
import torch.nn as nn


def _materialize_flat_param(flat_param, device: torch.device) -> None:
    # swap_tensors keeps the Python objects (the shard is registered on its module, and may already be in an
    # optimizer) while replacing what they hold: a meta tensor cannot simply take real data via ``.data``.
    shard = nn.Parameter(torch.zeros(flat_param.shard_numel, dtype=flat_param.shard.dtype, device=device),
                         requires_grad=flat_param.shard.requires_grad)
    torch.utils.swap_tensors(flat_param.shard, shard)
    unsharded = torch.empty(flat_param.padded_numel, dtype=flat_param.unsharded.dtype, device=device)
    unsharded.untyped_storage().resize_(0)
    torch.utils.swap_tensors(flat_param.unsharded, unsharded.requires_grad_(flat_param.unsharded.requires_grad))
    flat_param.device = device


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
    device = torch.device(device)
    # Parameters that fully_shard moved into FlatParameters: (owner module) -> [(flat_param, alias, attr)].
    sharded_owned: dict[int, list[tuple[object, str, str]]] = {}
    for sub in module.modules():
        unit = getattr(sub, "_fsdp_unit", None)
        if unit is None:
            continue
        for flat_param in unit.flat_params:
            if flat_param.shard.is_meta:
                _materialize_flat_param(flat_param, device)
                for alias in flat_param.aliases:
                    owner_path, _, attr = alias.rpartition(".")
                    owner = sub.get_submodule(owner_path) if owner_path else sub
                    sharded_owned.setdefault(id(owner), []).append((flat_param, alias, attr))

    materialized: dict[int, torch.Tensor] = {}   # id(meta parameter) -> its materialized replacement
    initialized: set[tuple[int, str]] = set()    # (id(flat_param), unique name) already copied into a shard
    for sub in module.modules():
        own_params = [(n, p) for n, p in sub._parameters.items() if p is not None and p.is_meta]
        own_buffers = [(n, b) for n, b in sub._buffers.items() if b is not None and b.is_meta]
        owned = sharded_owned.get(id(sub), [])
        if not (own_params or own_buffers or owned):
            continue
        if not hasattr(sub, "reset_parameters"):
            raise TypeError(f"{type(sub).__name__} owns meta parameters/buffers but defines no reset_parameters(); "
                            "give it one that initializes exactly its own parameters and buffers")
        restore = []  # (name, real parameter) to put back after a tied parameter's scratch init
        for name, p in own_params:
            fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            if id(p) in materialized:  # tied, its first owner already initialized it
                restore.append((name, materialized[id(p)]))
            else:
                materialized[id(p)] = fresh
            sub._parameters[name] = fresh
        for name, b in own_buffers:
            sub._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        for flat_param, alias, attr in owned:
            i = flat_param.param_names.index(flat_param.aliases[alias])
            setattr(sub, attr, torch.empty(flat_param.shapes[i], dtype=flat_param.shard.dtype, device=device))

        sub.reset_parameters()

        for name, real in restore:
            sub._parameters[name] = real
        for flat_param, alias, attr in owned:
            key = (id(flat_param), flat_param.aliases[alias])
            if key not in initialized:  # a tied alias seen again only consumed random numbers
                flat_param.copy_into_shard(alias, getattr(sub, attr))
                initialized.add(key)
            delattr(sub, attr)  # the full tensor is freed here
