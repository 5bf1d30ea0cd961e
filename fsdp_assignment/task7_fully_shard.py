"""Task 7: fully_shard, the FSDP2-style API that ties Tasks 1-6 together.

    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)          # inside-out: children first
    fully_shard(model)              # the root owns what no child unit owns (embeddings, ln_f, tied head)
    optim = torch.optim.AdamW(model.parameters())   # parameters() now yields this rank's shards

``fully_shard`` works in place: the unit's own parameters become FlatParameters (Task 2), the unit runs the
whole life cycle of Tasks 3, 4 and 6 (Task 6's ``PrefetchHooks``), and the module becomes an ``FSDPModule`` too,
as with PyTorch's FSDP2 (``isinstance`` holds for both its own class and ``FSDPModule``), with FSDP's methods. The
unit whose forward runs first is the root of every unit in its subtree: only then is the tree complete.

Every rule of Tasks 3 to 6 holds on ``fully_shard``'s units. The problems to solve: which parameters a unit owns
when its children are units already; a weight tied across two units, which no single call sees whole; which unit
is the root. Stuck? ``hints/task7/`` has, per topic, a question, a mechanism and a recipe (one file each).

Two bonus keywords, spelled as FSDP2 spells them (the required tasks never pass them):

- ``mesh``: a ``DeviceMesh``. 1-D: shard over its ranks. 2-D ``(R, K)`` (HSDP, hybrid sharding): dim 0
  replicates and dim 1 shards, as in FSDP2. Each unit is sharded K ways over its shard group (all-gathers
  and reduce-scatters of K ranks) and replicated over its replicate group of R ranks, across which each
  reduced gradient shard is all-reduced once per unit and step: the gradient is the mean over all R x K
  ranks, and every replica keeps identical shards. The collectives counted here are parameter traffic: one to
  which each rank contributes at most 64 elements, such as the norm of ``clip_grad_norm_``, is not counted.
- ``offload_policy``: ``torch.distributed.fsdp.CPUOffloadPolicy`` keeps the shards, their gradients and so
  the optimizer state on the CPU (pinned where the device allows); a unit's unsharded buffer, its full
  gradient and its collectives stay on the compute device. The copies are Tasks 3 and 4's: ``unshard``
  copies the shard to the device before the all-gather, ``accumulate_shard_grad`` the gradient shard back.
"""
# This file is generated from the staff reference by staff/make_stubs.py: the signatures and
# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may
# add private helpers (names starting with `_`).

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from .support.state import FSDPUnit, fsdp_units, init_shared_state, named_flat_params
from .task2_flat_param import FlatParameter
from .task4_backward import accumulate_shard_grad, reduce_scatter_grad
from .task5_optim_ckpt import gather_full
from .task6_prefetch import PrefetchHooks
FLAT_PARAM_NAMES = ("_fsdp_flat_param", "_fsdp_flat_param_frozen")


class FSDPModule:
    """Every module passed to ``fully_shard`` becomes an instance of this class too, and stays one of its own
    class (as in FSDP2, whose module classes become ``FSDP<Name>``)."""

    @property
    def fsdp_unit(self) -> FSDPUnit:
        """This module's ``FSDPUnit`` (``support/state.py``), stored by ``fully_shard`` as ``self._fsdp_unit``."""
        raise NotImplementedError("Task 7: implement FSDPModule.fsdp_unit() in fsdp_assignment/task7_fully_shard.py (see its docstring)")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """See ``set_requires_gradient_sync`` below; applies to every unit in this module's subtree."""
        raise NotImplementedError("Task 7: implement FSDPModule.set_requires_gradient_sync() in fsdp_assignment/task7_fully_shard.py (see its docstring)")


def fully_shard(module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision=None, mesh=None,
                offload_policy=None) -> nn.Module:
    """Make ``module`` one FSDP unit, in place, and return it.

    The unit owns every parameter in ``module``'s subtree that no child unit owns (call ``fully_shard`` on
    children first). Trainable and frozen parameters go into separate FlatParameters, whose shards are
    registered on ``module`` as ``_fsdp_flat_param`` / ``_fsdp_flat_param_frozen``: afterwards
    ``module.parameters()`` yields shards only (about 1/W of the model), and no original parameter stays alive.
    Sets ``module._fsdp_unit`` to the new ``FSDPUnit``: that attribute is what makes a module a unit for
    ``support.state.fsdp_units`` and ``named_flat_params`` (and what the tests read to find a unit), so use
    exactly this name. The unit runs Task 6's life cycle (``PrefetchHooks``, not Task 4's: the tests check that
    prefetching happens on this path), and its tree is ready (``is_root``, one ``SharedState``) by the time the
    root's first forward runs. The switches are read where they are used, never cached: ``set_prefetch``,
    ``set_requires_gradient_sync`` and each unit's ``unit.reshard_after_forward`` may be changed between two
    iterations and are in effect in the very next one.

    ``mixed_precision`` is a ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``param_dtype`` is the dtype
    parameters are gathered and computed in (floating-point inputs, positional and keyword, are cast to it
    unless its ``cast_forward_inputs`` is False), ``reduce_dtype`` the dtype gradients are reduced and summed
    in (default: ``param_dtype``; also when ``param_dtype`` is None); shards and their gradients keep the parameters' dtype, and buffers are
    never cast (a floating-point buffer keeps its dtype, in forward and in the state dicts, as with FSDP2). Its
    ``output_dtype`` (FSDP2 casts each unit's forward output to it) is not part of the assignment: raise
    ``NotImplementedError`` naming ``output_dtype`` when it is set, or implement it as FSDP2 does; never ignore it
    (a policy field that silently does nothing).

    Errors: ``RuntimeError`` when the default process group is not initialized. ``ValueError`` when ``module``
    is already a unit, or when one of its parameters, trainable or frozen, was already flattened by another unit,
    a child or a sibling, in either order (a parameter tied across units, e.g. ``fully_shard(m.embed);
    fully_shard(m.head)`` with ``head.weight is embed.weight``): sharding it twice would give it two independent
    copies that training silently unties. The message names both units (their classes as the user knows them,
    e.g. ``Embedding`` and ``Linear``); the fix is to apply ``fully_shard`` once, to a module that contains every
    user of the tied parameter. A sibling is not in ``module``'s subtree. A tie inside one unit is fine: the tied
    parameter is kept under the first of its names in ``module.named_parameters(remove_duplicate=False)`` order.

    Bonus keywords (see the module docstring): ``mesh``, a 1-D or 2-D ``DeviceMesh`` (None: the default
    group); with a 2-D mesh ``(R, K)`` the FlatParameters are built for the rank's place in its shard group
    (``rank = dist.get_rank(shard_group)``, ``world_size = K``), ``unit.group`` is the shard group and
    ``unit.replicate_group`` the replicate group (``TypeError`` for anything but a DeviceMesh, ``ValueError``
    for more than 2 dimensions). ``offload_policy``: None or ``OffloadPolicy()`` (no offload) or
    ``CPUOffloadPolicy(pin_memory=...)``: each shard is moved to the CPU (pinned when asked and a GPU is
    there) while ``unsharded`` stays on the module's device; a module on ``meta`` cannot be offloaded
    (``NotImplementedError``: materialize it first). Every unit of one model takes the same ``mesh``.
    """
    # Bonus guards: delete them when you implement the bonus (handout, Bonus).
    if mesh is not None and (mesh.ndim != 1 or mesh.size() != dist.get_world_size()):
        raise NotImplementedError("Bonus (HSDP): fully_shard(mesh=<2-D DeviceMesh>) is not implemented")
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("Bonus (CPU offload): fully_shard(offload_policy=CPUOffloadPolicy()) is not "
                                  "implemented")
    raise NotImplementedError("Task 7: implement fully_shard() in fsdp_assignment/task7_fully_shard.py (see its docstring)")


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """With False, backward keeps accumulating full (unsharded) gradients and communicates no gradient at all
    (no reduce-scatter, no all-reduce), for gradient accumulation over micro-batches; the next backward with
    True reduces the sum of the micro-batches since the last backward with True, summed in ``reduce_dtype``."""
    raise NotImplementedError("Task 7: implement set_requires_gradient_sync() in fsdp_assignment/task7_fully_shard.py (see its docstring)")


def gather_full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Original parameter names (relative to ``module``; a tied parameter under each of its names) -> full
    tensors in the parameters' own dtype (the shards', also under mixed precision), on every rank. A collective
    over each unit's ``group`` that communicates only all-gathers, each rank's shard of every FlatParameter
    once."""
    raise NotImplementedError("Task 7: implement gather_full_params() in fsdp_assignment/task7_fully_shard.py (see its docstring)")
