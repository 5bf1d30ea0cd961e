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

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ..support.state import FSDPUnit, fsdp_units, init_shared_state, named_flat_params
from .task2_flat_param import FlatParameter
from .task4_backward import accumulate_shard_grad, reduce_scatter_grad
from .task5_optim_ckpt import gather_full
from .task6_prefetch import PrefetchHooks

# Names under which a unit registers its FlatParameters' shards: (trainable, frozen).
FLAT_PARAM_NAMES = ("_fsdp_flat_param", "_fsdp_flat_param_frozen")


class FSDPModule:
    """Every module passed to ``fully_shard`` becomes an instance of this class too, and stays one of its own
    class (as in FSDP2, whose module classes become ``FSDP<Name>``)."""

    @property
    def fsdp_unit(self) -> FSDPUnit:
        """This module's ``FSDPUnit`` (``support/state.py``), stored by ``fully_shard`` as ``self._fsdp_unit``."""
        return self._fsdp_unit

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """See ``set_requires_gradient_sync`` below; applies to every unit in this module's subtree."""
        set_requires_gradient_sync(self, requires_gradient_sync)


# One FSDP subclass per original class, shared by every instance (as FSDP2 does): a cache, not state that
# changes behaviour, so isinstance(module, nn.Linear) and isinstance(module, FSDPModule) both hold.
_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


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
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialized (dist.init_process_group)")
    mp = mixed_precision
    if mp is not None and getattr(mp, "output_dtype", None) is not None:
        raise NotImplementedError("MixedPrecisionPolicy.output_dtype is not supported; cast the output yourself")
    shard_group, replicate_group = _mesh_groups(mesh)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.CPUOffloadPolicy (or OffloadPolicy() "
                        f"for none), not {type(offload_policy).__name__}")
    offload = isinstance(offload_policy, CPUOffloadPolicy)

    # Inside-out ownership: parameters a child unit owns were removed from their modules by that child's
    # FlatParameter (its shard registered under FLAT_PARAM_NAMES), so the
    # remaining named parameters (minus the children's shards) are exactly the ones this unit owns, unless
    # one of them is tied to a parameter another unit (a child, or a sibling: not in this subtree) already
    # flattened. That unit marked the parameter object (below), so the mark is how we find it.
    trainable, frozen = [], []
    for name, param in module.named_parameters(remove_duplicate=False):
        if name.rpartition(".")[2] in FLAT_PARAM_NAMES:
            continue
        owner = getattr(param, "_fsdp_owner", None)
        if owner is not None and owner[0]() is not None:
            raise ValueError(
                f"fully_shard({_class_name(module)}): parameter {name!r} is tied to {owner[1]!r}, which the unit "
                f"{_class_name(owner[0]())} already owns; a parameter tied across units would be sharded twice "
                "and training would untie it. Apply fully_shard once, to a module containing every user of it")
        (trainable if param.requires_grad else frozen).append(name)

    # Mark what this unit flattens: a weak reference (no module kept alive) plus the name, for the message.
    for name in trainable + frozen:
        module.get_parameter(name)._fsdp_owner = (weakref.ref(module), name)
    # The place of this rank in the group the unit is sharded over (the whole world without a mesh).
    rank, world_size = dist.get_rank(shard_group), dist.get_world_size(shard_group)
    param_dtype = mp.param_dtype if mp is not None else None
    flat_params = []
    for names, attr in ((trainable, FLAT_PARAM_NAMES[0]), (frozen, FLAT_PARAM_NAMES[1])):
        if names:
            flat_param = FlatParameter(module, names, rank, world_size, unsharded_dtype=param_dtype)
            if offload:
                _offload_shard(flat_param, offload_policy.pin_memory)
            module.register_parameter(attr, flat_param.shard)
            flat_params.append(flat_param)

    unit = FSDPUnit(module=module, flat_params=flat_params, group=shard_group, replicate_group=replicate_group,
                    reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                    reduce_dtype=(mp.reduce_dtype or param_dtype) if mp is not None else None,
                    cast_forward_inputs=mp.cast_forward_inputs if mp is not None else True)
    module._fsdp_unit = unit
    # The class swap FSDP2 does: a subclass of (FSDPModule, original class), one per class.
    module.__class__ = _fsdp_class(type(module))
    # Lazy root init: registered first, so it runs before the life cycle's pre-forward hook; the unit whose
    # forward runs first becomes the root (only then is the tree complete).
    module.register_forward_pre_hook(_lazy_init_hook)
    (PrefetchHooks() if replicate_group is None else _HybridHooks()).register(unit)
    return module


def _class_name(module: nn.Module) -> str:
    """The class name the user knows: ``Embedding`` for a unit whose class became ``FSDPEmbedding``."""
    cls = type(module)
    return cls.__bases__[-1].__name__ if issubclass(cls, FSDPModule) else cls.__name__


# ---- Bonus: HSDP on a 2-D mesh, and CPU offload ----------------------------------------------------------------
def _mesh_groups(mesh) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group) of ``mesh``: FSDP2's convention, dim 0 replicates and dim 1 shards. A
    replicate group of one rank is no replication (None): there is nothing to all-reduce across."""
    if mesh is None:
        return None, None
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (init_device_mesh), not "
                        f"{type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim != 2:
        raise ValueError(f"mesh has {mesh.ndim} dimensions; use a 1-D mesh (shard) or a 2-D mesh (replicate, shard)")
    replicate_group = mesh.get_group(0)
    return mesh.get_group(1), (replicate_group if dist.get_world_size(replicate_group) > 1 else None)


def _offload_shard(flat_param: FlatParameter, pin_memory: bool) -> None:
    """Move ``flat_param``'s shard to the CPU (pinned when asked and possible); ``unsharded`` stays put."""
    if flat_param.shard.is_meta:
        raise NotImplementedError("CPU offload of a module on the meta device: materialize it "
                                  "(materialize_meta_module) before fully_shard(..., offload_policy=...)")
    shard = flat_param.shard.detach().to("cpu")
    if pin_memory and torch.cuda.is_available():  # pinned: the host-to-device copies can be non-blocking
        shard = shard.pin_memory()
    flat_param.shard = nn.Parameter(shard, requires_grad=flat_param.requires_grad)


class _ReplicaReduction:
    """The work handle of one HSDP gradient reduction: ``wait()`` waits for the reduce-scatter in the shard
    group, then all-reduces the gradient shard across the replicate group (sum, then / R: with the
    reduce-scatter's mean over K, the mean over all R x K ranks). Task 6 keeps it among its pending
    reduce-scatters and calls ``wait()`` before it reads the shard, so the all-reduce always follows."""

    def __init__(self, work, grad_shard: torch.Tensor, replicate_group: dist.ProcessGroup):
        self.work, self.grad_shard, self.replicate_group = work, grad_shard, replicate_group

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            dist.all_reduce(self.grad_shard, op=dist.ReduceOp.SUM, group=self.replicate_group)
            self.grad_shard.div_(dist.get_world_size(self.replicate_group))
        return True


class _HybridHooks(PrefetchHooks):
    """Task 6's life cycle for a unit replicated over a 2-D mesh (HSDP bonus): each reduce-scatter (in the
    shard group, ``unit.group``) is followed by an all-reduce of the gradient shard across
    ``unit.replicate_group``. Everything else is Task 6's: with prefetching on, the reduction is asynchronous
    and at most one is in flight."""

    def reduce_scatter(self, unit: FSDPUnit, flat_param: FlatParameter, grad: torch.Tensor) -> None:
        shared = unit.shared
        work, grad_shard = reduce_scatter_grad(flat_param, grad, unit.group, async_op=True)
        reduction = _ReplicaReduction(work, grad_shard, unit.replicate_group)
        if not shared.prefetch:
            reduction.wait()
            accumulate_shard_grad(flat_param, grad_shard)
            return
        shared.pending_reduce_scatters.append((reduction, flat_param, grad_shard, grad))
        while len(shared.pending_reduce_scatters) > 1:
            older, older_flat_param, older_shard, _ = shared.pending_reduce_scatters.pop(0)
            older.wait()
            accumulate_shard_grad(older_flat_param, older_shard)


def _lazy_init_hook(module: nn.Module, args) -> None:
    # The first unit to run forward is the root of every unit below it (FSDP2's lazy init).
    if module._fsdp_unit.shared is None:
        lazy_init(module._fsdp_unit)


def lazy_init(root: FSDPUnit) -> None:
    """Suggested helper (the tests do not call it): make ``root`` the root of every unit in its module's
    subtree, all sharing one ``SharedState`` (``init_shared_state`` is provided). ``root`` is the unit whose
    forward runs first; ``set_prefetch`` (Task 6) may have created the state earlier."""
    init_shared_state(root)


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """With False, backward keeps accumulating full (unsharded) gradients and communicates no gradient at all
    (no reduce-scatter, no all-reduce), for gradient accumulation over micro-batches; the next backward with
    True reduces the sum of the micro-batches since the last backward with True, summed in ``reduce_dtype``."""
    for unit in fsdp_units(module):
        unit.requires_gradient_sync = requires_gradient_sync


def gather_full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Original parameter names (relative to ``module``; a tied parameter under each of its names) -> full
    tensors in the parameters' own dtype (the shards', also under mixed precision), on every rank. A collective
    over each unit's ``group`` that communicates only all-gathers, each rank's shard of every FlatParameter
    once."""
    out = {}
    groups = {id(fp): unit.group for unit in fsdp_units(module) for fp in unit.flat_params}
    for prefix, flat_param in named_flat_params(module):
        # Over the unit's shard group: with HSDP each replica gathers its own (identical) copy.
        for name, tensor in gather_full(flat_param, group=groups[id(flat_param)]).items():
            out[prefix + name] = tensor
    return out
