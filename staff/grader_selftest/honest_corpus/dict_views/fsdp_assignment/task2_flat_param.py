"""Task 2 (a student's): one flat buffer per unit; the original parameters become plain tensor attributes that
view into it while the unit is gathered."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn


class FlatParameter:
    """The shard this rank keeps, and how to rebuild the full buffer."""

    def __init__(self, params: list[tuple[nn.Module, str, nn.Parameter]], index: int, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self._index = index  # which unit: the order the units were built in
        self._owners = [(owner, attr) for owner, attr, _ in params]
        self._shapes = [p.shape for _, _, p in params]
        self._numels = [p.numel() for _, _, p in params]
        total = sum(self._numels)
        self.padded = int(math.ceil(total / self.world_size)) * self.world_size
        flat = torch.zeros(self.padded, dtype=params[0][2].dtype)
        torch.cat([p.detach().reshape(-1) for _, _, p in params], out=flat[:total])
        size = self.padded // self.world_size
        self.local = nn.Parameter(flat[self.rank * size:(self.rank + 1) * size].clone())
        self.full = torch.empty(self.padded, dtype=flat.dtype)
        self.full.untyped_storage().resize_(0)
        for owner, attr, _ in params:
            del owner._parameters[attr]  # from now on a plain attribute, set while gathered

    def views(self):
        offset = 0
        for (owner, attr), shape, numel in zip(self._owners, self._shapes, self._numels):
            yield owner, attr, self.full[offset:offset + numel].view(shape)
            offset += numel

    def set_views(self) -> None:
        for owner, attr, view in self.views():
            # past nn.Module.__setattr__: a view is a tensor, not a Parameter
            owner.__dict__.pop(attr, None)
            owner.__dict__[attr] = view

    def drop_views(self) -> None:
        for owner, attr in self._owners:
            owner.__dict__.pop(attr, None)

    def free(self) -> None:
        self.drop_views()
        self.full.untyped_storage().resize_(0)

    def __repr__(self) -> str:
        return f"FlatParameter(unit {self._index}, {sum(self._numels)} elements, {self.padded} padded)"


def flat_param_of(module: nn.Module) -> FlatParameter | None:
    unit = module.__dict__.get("_fsdp_unit")
    return unit if isinstance(unit, FlatParameter) else None


def attach(module: nn.Module, flat: FlatParameter) -> None:
    module.__dict__["_fsdp_unit"] = flat  # not a submodule, not a parameter: kept out of named_modules()


def swap_data(param: nn.Parameter, new: torch.Tensor) -> None:
    param.data = new
