"""Task 7 (a student's): fully_shard swaps each module's class for a dynamic subclass that mixes FSDP's methods
in, the way FSDP2 does."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .task1_meta_init import materialize_meta_module

_SUBCLASSES: dict[type, type] = {}


class FSDPMixin:
    """Methods every fully_shard-ed module gains."""

    def reshard(self) -> None:
        for flat in self._fsdp_state.flats:
            flat.free()

    def unshard(self) -> None:
        for flat in self._fsdp_state.flats:
            flat.gather()

    def set_requires_gradient_sync(self, value: bool) -> None:
        self._fsdp_state.sync = value

    def __repr__(self) -> str:
        return f"FSDP({user_class(type(self)).__name__})"


def user_class(cls: type) -> type:
    """The user's class behind a dynamic FSDP subclass (its name goes in error messages)."""
    for base in cls.__mro__:
        if base is not cls and base is not FSDPMixin and issubclass(base, nn.Module) and \
                not base.__name__.startswith("FSDP"):
            return base
    return cls


def fsdp_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        name = f"FSDP{cls.__name__}"
        _SUBCLASSES[cls] = type(name, (FSDPMixin, cls), {"__module__": cls.__module__})
    return _SUBCLASSES[cls]


class _State:
    __slots__ = ("flats", "sync", "_root", "_mp")

    def __init__(self, flats, mixed_precision):
        self.flats = flats
        self.sync = True
        self._root = None
        self._mp = mixed_precision


def fully_shard(module: nn.Module, *, reshard_after_forward: bool = True, mixed_precision=None, mesh=None,
                offload_policy=None) -> nn.Module:
    if isinstance(module, FSDPMixin):
        raise ValueError(f"{user_class(type(module)).__name__} is already fully_shard-ed")
    if any(p.is_meta for p in module.parameters()):
        materialize_meta_module(module, torch.device("cpu"))
    owned = [(name, p) for name, p in module.named_parameters() if not hasattr(p, "_fsdp_owner")]
    for name, p in owned:
        p._fsdp_owner = module  # a tensor attribute of the student's own: which unit owns it
    flats = [_Flat(module, [n for n, _ in owned])] if owned else []
    # object.__setattr__: a plain attribute that nn.Module would otherwise register or refuse
    object.__setattr__(module, "_fsdp_state", _State(flats, mixed_precision))
    module.__class__ = fsdp_class(type(module))
    module.register_forward_pre_hook(functools.partial(_pre_forward, reshard_after_forward), with_kwargs=True)
    return module


class _Flat:
    def __init__(self, module: nn.Module, names: list[str]):
        self.module = module
        self.names = names
        self.params = [module.get_parameter(n) for n in names]
        self.shard = torch.cat([p.detach().reshape(-1) for p in self.params])

    def gather(self) -> None:
        full = torch.empty(self.shard.numel() * dist.get_world_size(), dtype=self.shard.dtype)
        dist.all_gather_into_tensor(full, self.shard)
        offset = 0
        for name, p in zip(self.names, self.params):
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            view = full[offset:offset + p.numel()].view_as(p)
            nn.Module.__setattr__(owner, attr, nn.Parameter(view, requires_grad=p.requires_grad))
            offset += p.numel()

    def free(self) -> None:
        for name, p in zip(self.names, self.params):
            owner_name, _, attr = name.rpartition(".")
            setattr(self.module.get_submodule(owner_name), attr, p)


def _pre_forward(reshard_after_forward: bool, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
    module.unshard()
    return args, kwargs


def swap_into(param: nn.Parameter, new: torch.Tensor) -> None:
    """Replace a parameter's tensor in place, keeping every reference to it (the optimizer's) valid."""
    torch.utils.swap_tensors(param, nn.Parameter(new, requires_grad=param.requires_grad))


def attributes(module: nn.Module) -> list[str]:
    return sorted(k for k in vars(module) if not k.startswith("_"))


def gather_full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    module.unshard()
    try:
        return {name: p.detach().clone() for name, p in module.named_parameters()}
    finally:
        module.reshard()
