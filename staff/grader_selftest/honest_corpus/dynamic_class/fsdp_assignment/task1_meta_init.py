"""Task 1 (a student's): materialize a meta model one unit at a time, replaying the RNG."""

from __future__ import annotations

import torch
import torch.nn as nn


def _leaf_modules(module: nn.Module):
    for name, sub in module.named_modules():
        if any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False)):
            yield name, sub


def materialize_meta_module(module: nn.Module, device: torch.device | str) -> None:
    for _, sub in _leaf_modules(module):
        sub.to_empty(device=device, recurse=False)
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
        elif hasattr(sub, "_reset_parameters"):
            sub._reset_parameters()
        else:
            raise TypeError(f"{type(sub).__qualname__} has parameters but no reset_parameters()")
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.device != torch.device(device):
                setattr(sub, name, nn.Parameter(p.to(device), requires_grad=p.requires_grad))
        for name, b in list(sub.named_buffers(recurse=False)):
            sub._buffers[name] = b.to(device)


def describe(module: nn.Module) -> str:
    return " > ".join(c.__name__ for c in type(module).__mro__[:-1])
