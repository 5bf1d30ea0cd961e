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
    """Scale every gradient shard so that the global L2 norm (the norm of the whole model's gradient, over
    every rank's shards) is at most ``max_norm``, by the coefficient ``torch.nn.utils.clip_grad_norm_`` uses;
    return the global norm, the same on every rank and equal to that function's on the unsharded model.
    ``ValueError`` when the units are sharded over different groups (meshes)."""
    raise NotImplementedError("Task 5: implement clip_grad_norm_() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


@torch.no_grad()
def gather_full(flat_param, local: torch.Tensor | None = None, group=None) -> dict[str, torch.Tensor]:
    """All-gather ``flat_param``'s shards (or ``local``, any tensor laid out like the shard, e.g. optimizer
    state) over ``group`` (None: the default group; pass the unit's ``group``) and split the result into full
    tensors keyed by every name the FlatParameter answers to (tied parameters under each of their names),
    on ``unsharded``'s device. A collective: every rank of ``group`` calls it."""
    raise NotImplementedError("Task 5: implement gather_full() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


def get_model_state_dict(module: nn.Module, *, full: bool) -> dict[str, torch.Tensor]:
    """The model's state dict under original names, parameters and persistent buffers (see the module
    docstring's formats); ``full``: whole tensors on rank 0 ({} elsewhere), else this rank's pieces."""
    raise NotImplementedError("Task 5: implement get_model_state_dict() in fsdp_assignment/task5_optim_ckpt.py (see its docstring)")


@torch.no_grad()
def set_model_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, full: bool) -> None:
    """Load a state dict made by ``get_model_state_dict`` (``full``: the same full dict on every rank) into
    this rank's shards and the module's buffers; the padding stays zero."""
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
