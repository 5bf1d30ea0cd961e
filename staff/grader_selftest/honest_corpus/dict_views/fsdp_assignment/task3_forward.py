"""Task 3 (a student's): gather before a unit's forward, free after it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .task2_flat_param import FlatParameter, flat_param_of


def unshard(flat: FlatParameter, group=None) -> None:
    flat.full.untyped_storage().resize_(flat.padded * flat.full.element_size())
    dist.all_gather_into_tensor(flat.full, flat.local.detach(), group=group or flat.group)
    flat.set_views()


def reshard(flat: FlatParameter) -> None:
    flat.free()


class ForwardHooks:
    def __init__(self, units: list[nn.Module], reshard_after_forward: bool = True):
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.order: list[int] = []
        self.handles = []
        for unit in units:
            self.handles.append(unit.register_forward_pre_hook(self.pre_forward))
            self.handles.append(unit.register_forward_hook(self.post_forward))

    def pre_forward(self, module: nn.Module, args):
        flat = flat_param_of(module)
        if flat is None:
            return None
        self.order.append(flat._index)
        unshard(flat)
        return None

    def post_forward(self, module: nn.Module, args, output):
        flat = flat_param_of(module)
        if flat is not None and self.reshard_after_forward:
            reshard(flat)
        return output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def describe(self) -> str:
        names = {id(m): type(m).__name__ for m in self.units}
        return ", ".join(f"{names[id(u)]}#{flat_param_of(u)._index}" for u in self.units if flat_param_of(u))
