"""Task 5: sharded optimizer, gradient clipping, and checkpoints.

After ``fully_shard`` the module's parameters are this rank's 1-D shards, so any ``torch.optim`` optimizer
built over them keeps state for 1/W of the model: that is all "sharding the optimizer" takes. What needs
care is everything that looks at the model as a whole:

- the gradient norm for clipping is global: sum of squares over every rank's shard, all-reduced once (the
  padding is zero, and a tied parameter is stored once, so nothing is counted twice) over the group the units
  are sharded over (``unit.group``: the default group, or with the HSDP bonus the shard group, since every
  replica holds the same gradient shards and summing over replicas would count each one R times);
- state dicts speak the original parameter names (``blocks.0.attn.c_attn.weight``), never flat shards, so a
  checkpoint loads into a plain model (full) or into the same sharding (sharded), and resuming from one is
  indistinguishable from never stopping.

Formats (``fqn`` = original parameter name relative to the module passed in):
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
(Python numbers, 0-dim tensors such as AdamW's ``step``) is per-parameter scalar state: copied to every name
of the FlatParameter when saving, and back to the shard's state as it is when loading. Tell them apart by
``dim() == 0`` (scalar) on the value you hold: a shard's state is never 0-dim. The one ambiguous case is a
0-dimensional *parameter*, whose full per-element state is 0-dim too: no test uses one (a sharded dict still
works: its pieces are 1-D).
Loading a full state dict: pass the same full dict on every rank. Loading restores everything the dict holds,
buffers and the optimizer's hyperparameters (each param group's lr, weight decay, ...) included, as
``torch.optim.Optimizer.load_state_dict`` does. A full state dict exists on rank 0 only: the other ranks take
part in every gather but keep none of it, so they never hold more than one unit's gathered state at a time.
Gathers run over each unit's own group (``unit.group``; HSDP bonus: the shard group, each replica gathering its
own copy) and on its compute device (``unsharded``'s: with the CPU offload bonus shards live on the CPU).
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from .support.state import fsdp_units, named_flat_params


def get_sharded_optimizer(module: nn.Module, optimizer_cls, **kwargs) -> torch.optim.Optimizer:
    """``optimizer_cls`` over this rank's trainable shards (``module.parameters()`` that require grad)."""
    raise NotImplementedError("Task 5: implement get_sharded_optimizer() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every shard gradient so the global L2 norm is at most ``max_norm``; return the global norm
    (the same on every rank, and equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model).
    The sum of squares is all-reduced once, over the units' group (``unit.group``; ``ValueError`` when the
    units are sharded over different groups), on the units' compute device (``unsharded``'s)."""
    raise NotImplementedError("Task 5: implement clip_grad_norm_() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


@torch.no_grad()
def gather_full(flat_param, local: torch.Tensor | None = None, group=None) -> dict[str, torch.Tensor]:
    """All-gather ``flat_param``'s shards (or ``local``, any tensor laid out like the shard, e.g. optimizer
    state) over ``group`` (None: the default group; pass the unit's ``group``) and split the result into full
    tensors keyed by every name the FlatParameter answers to (tied parameters under each of their names),
    on ``unsharded``'s device. A collective: every rank of ``group`` calls it."""
    raise NotImplementedError("Task 5: implement gather_full() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


def get_model_state_dict(module: nn.Module, *, full: bool) -> dict[str, torch.Tensor]:
    """The model's state dict under original names; ``full``: gathered on rank 0, else this rank's pieces."""
    raise NotImplementedError("Task 5: implement get_model_state_dict() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


@torch.no_grad()
def set_model_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, full: bool) -> None:
    """Load a state dict made by ``get_model_state_dict`` (``full``: the same full dict on every rank)."""
    raise NotImplementedError("Task 5: implement set_model_state_dict() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


def get_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict:
    """The optimizer's state under original parameter names (see the module docstring for the format)."""
    raise NotImplementedError("Task 5: implement get_optimizer_state_dict() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


def set_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict, *,
                             full: bool) -> None:
    """Load an optimizer state dict made by ``get_optimizer_state_dict`` into ``optimizer`` (built over this
    module's shards by ``get_sharded_optimizer``); ``full``: the same full dict on every rank. The saved
    param groups' hyperparameters (lr, weight decay, ...) replace the optimizer's own."""
    raise NotImplementedError("Task 5: implement set_optimizer_state_dict() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")
