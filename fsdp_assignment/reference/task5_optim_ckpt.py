"""Task 5: sharded optimizer, gradient clipping, and checkpoints.

After ``fully_shard`` the module's parameters are this rank's 1-D shards. What needs care is everything that
looks at the model as a whole. The tests observe:

- the optimizer: with AdamW, each rank's optimizer state holds about 2 x (trainable numel) / W elements (within
  1%), and its steps equal single-process training;
- clipping: ``clip_grad_norm_`` returns the norm of the whole model's gradient, the same on every rank and equal
  to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model and the global batch, and leaves every gradient
  shard scaled as that function scales it (never up: below ``max_norm`` nothing changes);
- checkpoints: state dicts speak the original parameter names (``blocks.0.attn.c_attn.weight``), never flat
  shards, in the formats below; a full model state dict loads into a plain, unsharded model (strict); resuming
  from a full or a sharded checkpoint (model and optimizer, into a fresh model and an optimizer made with other
  hyperparameters) gives bitwise the parameters of training straight through, on W = 2 and 3 (padding included,
  which stays zero, in the optimizer state too), with buffers and hyperparameters restored;
- memory: a full state dict, the model's and the optimizer's alike, exists on rank 0 only, and the other ranks
  never hold it, not even while it is made: their peak stays far below rank 0's (about one unit's gathered
  parameters or optimizer state at a time).

Formats (``fqn`` = original parameter name relative to the module passed in; every parameter tensor in the
parameter's own dtype, the shard's, also under mixed precision):
- model, full:      {fqn: full tensor, buffer name: tensor} on rank 0; {} on other ranks. Tied parameters
                    appear under each of their names, as in ``nn.Module.state_dict()``.
- model, sharded:   {fqn: 1-D tensor, the elements of that parameter that lie in this rank's shard (may be
                    empty)} plus buffers, on every rank; a tied parameter once, under its kept name (the
                    first of its names, see FlatParameter).
- optimizer, full:  {"state": {fqn: {key: full tensor or scalar}}, "param_groups": [{..., "params": [fqn]}]}
                    on rank 0, {} elsewhere. A tied parameter is one optimizer parameter: once, under its
                    kept name.
- optimizer, sharded: same layout, tensors as this rank's 1-D pieces, on every rank.
Per-element state and scalars: an optimizer state value is *per-element* (AdamW's ``exp_avg``,
``exp_avg_sq``) when it is a tensor laid out like the parameter: in the live optimizer a 1-D tensor shaped like
the shard; in a saved dict the parameter's full shape (full) or its 1-D piece (sharded). Everything else
(Python numbers, 0-dim tensors such as AdamW's ``step``) is per-parameter scalar state: the same value under
every name of the FlatParameter when saving, and back to the shard's state as it is when loading. No test uses a
0-dimensional *parameter* (whose full per-element state is 0-dim too).
Loading a full state dict: the same full dict is passed on every rank. Loading restores everything the dict
holds, buffers and the optimizer's hyperparameters (each param group's lr, weight decay, ...) included, as
``torch.optim.Optimizer.load_state_dict`` does.

Bonus rules (HSDP, CPU offload): every collective here runs over each unit's own group (``unit.group``: with
HSDP the shard group, each replica working on its own identical copy; summing a norm over replicas would count
each shard R times) and on the units' compute device (``unsharded``'s: with CPU offload the shards live on the
CPU).

Stuck? ``hints/task5/`` has, per topic, a question, a mechanism and a recipe (one file each).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..support.state import fsdp_units, named_flat_params
from .task3_forward import _all_gather_single


def get_sharded_optimizer(module: nn.Module, optimizer_cls, **kwargs) -> torch.optim.Optimizer:
    """``optimizer_cls`` over this rank's trainable shards (``module.parameters()`` that require grad)."""
    return optimizer_cls([p for p in module.parameters() if p.requires_grad], **kwargs)


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient shard so that the global L2 norm (the norm of the whole model's gradient, over
    every rank's shards) is at most ``max_norm``, by the coefficient ``torch.nn.utils.clip_grad_norm_`` uses;
    return the global norm, the same on every rank and equal to that function's on the unsharded model.
    ``ValueError`` when the units are sharded over different groups (meshes)."""
    # The sum of squares of the local shards, all-reduced once over the units' group (unit.group; HSDP: the shard
    # group), on the units' compute device (unsharded's). Nothing counts twice: padding is zero, a tied
    # parameter is stored once, frozen shards have no gradient.
    units = fsdp_units(module)
    groups = list({id(u.group): u.group for u in units}.values())
    if len(groups) > 1:
        raise ValueError("clip_grad_norm_: the units are sharded over different process groups (meshes); "
                         "shard every unit of the model over the same mesh")
    flat_params = [fp for _, fp in named_flat_params(module)]
    grads = [fp.shard.grad for fp in flat_params if fp.shard.grad is not None]
    device = next((fp.unsharded.device for fp in flat_params), torch.device("cpu"))
    local_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local_sq += g.float().pow(2).sum().to(device)
    # Sum of squares over the ranks of the shard group: the global squared norm.
    dist.all_reduce(local_sq, group=groups[0] if groups else None)
    total_norm = local_sq.sqrt()
    # Same formula as torch.nn.utils.clip_grad_norm_, so the results match it.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total_norm


@torch.no_grad()
def gather_full(flat_param, local: torch.Tensor | None = None, group=None) -> dict[str, torch.Tensor]:
    """All-gather ``flat_param``'s shards (or ``local``, any tensor laid out like the shard, e.g. optimizer
    state) over ``group`` (None: the default group; pass the unit's ``group``) and split the result into full
    tensors keyed by every name the FlatParameter answers to (tied parameters under each of their names),
    on ``unsharded``'s device. A collective: every rank of ``group`` calls it."""
    local = (flat_param.shard if local is None else local).detach().to(flat_param.unsharded.device)
    full = torch.empty(flat_param.padded_numel, dtype=local.dtype, device=local.device)
    _all_gather_single(full, local, group, False)
    unique = {name: full[off:off + n].view(shape).clone() for name, off, n, shape in
              zip(flat_param.param_names, flat_param.param_offsets, flat_param.numels, flat_param.shapes)}
    return {alias: unique[name] for alias, name in flat_param.aliases.items()}


def _groups(module: nn.Module) -> dict[int, object]:
    """id(flat_param) -> the group its unit is sharded over (what its gathers run on)."""
    return {id(fp): unit.group for unit in fsdp_units(module) for fp in unit.flat_params}


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    # state_dict() minus the flat shards = the persistent buffers. The shards are exactly the module's
    # parameters (FSDP owns them all), so filter by identity rather than by name.
    shards = {id(fp.shard) for _, fp in named_flat_params(module)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) not in shards}


def get_model_state_dict(module: nn.Module, *, full: bool) -> dict[str, torch.Tensor]:
    """The model's state dict under original names, parameters and persistent buffers (see the module
    docstring's formats); ``full``: whole tensors on rank 0 ({} elsewhere), else this rank's pieces."""
    # Full: one unit at a time, every rank joins the gather, only rank 0 keeps it (the others would otherwise
    # hold the whole model at once).
    out: dict[str, torch.Tensor] = {}
    keep = not full or dist.get_rank() == 0  # other ranks join every gather but keep nothing: rank 0's state
    unit_groups = _groups(module)
    for prefix, flat_param in named_flat_params(module):
        if full:
            gathered = gather_full(flat_param, group=unit_groups[id(flat_param)])
            if keep:
                out.update({prefix + name: t for name, t in gathered.items()})
        else:
            for name in flat_param.param_names:
                start, end, at = flat_param.shard_range(name)
                out[prefix + name] = flat_param.shard.detach()[at:at + end - start].clone()
    out.update({k: v.detach().clone() for k, v in _buffers(module).items()})
    return out if not full or dist.get_rank() == 0 else {}


@torch.no_grad()
def set_model_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, full: bool) -> None:
    """Load a state dict made by ``get_model_state_dict`` (``full``: the same full dict on every rank) into
    this rank's shards and the module's buffers; the padding stays zero."""
    for prefix, flat_param in named_flat_params(module):
        for name in flat_param.param_names:
            if full:
                flat_param.copy_into_shard(name, state_dict[prefix + name])
            else:
                start, end, at = flat_param.shard_range(name)
                flat_param.shard[at:at + end - start].copy_(state_dict[prefix + name])
    for k, v in _buffers(module).items():
        v.copy_(state_dict[k])


def _flat_param_of_shards(module: nn.Module) -> dict[int, tuple[str, object]]:
    return {id(fp.shard): (prefix, fp) for prefix, fp in named_flat_params(module)}


def get_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict:
    """The optimizer's state under original parameter names (see the module docstring for the format)."""
    owners = _flat_param_of_shards(module)
    unit_groups = _groups(module)
    state: dict[str, dict] = {}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for shard in group["params"]:
            prefix, flat_param = owners[id(shard)]
            names += [prefix + n for n in flat_param.param_names]
            for key, value in optimizer.state.get(shard, {}).items():
                for name in flat_param.param_names:
                    state.setdefault(prefix + name, {})
                if not isinstance(value, torch.Tensor) or value.dim() == 0:  # scalar, e.g. "step"
                    for name in flat_param.param_names:
                        state[prefix + name][key] = value.clone() if isinstance(value, torch.Tensor) else value
                elif full:
                    # Optimizer state is laid out like the shard, so it gathers and splits like the parameters.
                    # Only rank 0 keeps it: the others would otherwise hold the whole model's state at once.
                    gathered = gather_full(flat_param, value, unit_groups[id(flat_param)])
                    if dist.get_rank() == 0:
                        for name in flat_param.param_names:
                            state[prefix + name][key] = gathered[name]
                else:
                    for name in flat_param.param_names:
                        start, end, at = flat_param.shard_range(name)
                        state[prefix + name][key] = value[at:at + end - start].clone()
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    out = {"state": state, "param_groups": groups}
    return out if not full or dist.get_rank() == 0 else {}


def set_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict, *,
                             full: bool) -> None:
    """Load an optimizer state dict made by ``get_optimizer_state_dict`` into ``optimizer`` (built over this
    module's shards by ``get_sharded_optimizer``); ``full``: the same full dict on every rank. The saved
    param groups' hyperparameters (lr, weight decay, ...) replace the optimizer's own."""
    owners = _flat_param_of_shards(module)
    torch_state, torch_groups, index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        ids = []
        for shard in group["params"]:
            prefix, flat_param = owners[id(shard)]
            per_name = {n: state_dict["state"].get(prefix + n, {}) for n in flat_param.param_names}
            keys = next(iter(per_name.values())).keys()
            shard_state = {}
            for key in keys:
                first = per_name[flat_param.param_names[0]][key]
                if not isinstance(first, torch.Tensor) or first.dim() == 0:
                    shard_state[key] = first.clone() if isinstance(first, torch.Tensor) else first
                    continue
                t = torch.zeros_like(shard)  # padding stays zero
                for name in flat_param.param_names:
                    start, end, at = flat_param.shard_range(name)
                    value = per_name[name][key]
                    t[at:at + end - start] = value.reshape(-1)[start:end] if full else value
                shard_state[key] = t
            if shard_state:
                torch_state[index] = shard_state
            ids.append(index)
            index += 1
        torch_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})
