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

    # The replay: module pre-order (module.modules()) is the order eager construction ran the inits, so calling
    # each module's reset_parameters() in that order consumes the generator exactly as eager init did. A tied
    # parameter's later owner still runs its init (on a scratch tensor) for the numbers it consumed.
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
