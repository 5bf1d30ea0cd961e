"""Task 4 (a student's): hooks on parameters and tensors, a callback at the end of backward, weak references to
modules so that hooks keep nothing alive."""

from __future__ import annotations

import contextlib
import enum
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable


class Phase(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD = enum.auto()


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UnitState:
    def __init__(self, module: nn.Module, flat: torch.Tensor, group=None):
        self._module = weakref.ref(module)
        self._flat = flat
        self._group = group
        self._phase = Phase.IDLE
        self._grads_ready = 0
        self._handles: list = []
        _STATES[module] = self

    @property
    def module(self) -> nn.Module | None:
        return self._module()

    def install(self) -> None:
        module = self.module
        self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(module.register_full_backward_pre_hook(self._pre_backward))
        for p in module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _pre_forward(self, module, args, kwargs):
        self._phase = Phase.FORWARD
        return args, kwargs

    def _pre_backward(self, module, grad_output):
        self._phase = Phase.BACKWARD
        Variable._execution_engine.queue_callback(self._finish)
        return None

    def _grad_ready(self, param: torch.Tensor) -> None:
        self._grads_ready += 1

    def _finish(self) -> None:
        if self._phase is Phase.BACKWARD:
            grad = self._flat.grad if self._flat.grad is not None else torch.zeros_like(self._flat)
            out = torch.empty(grad.numel() // dist.get_world_size(self._group), dtype=grad.dtype)
            dist.reduce_scatter_tensor(out, grad, group=self._group)
            self._flat.untyped_storage().resize_(0)
        self._phase = Phase.IDLE
        self._grads_ready = 0

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def state_of(module: nn.Module) -> UnitState | None:
    return _STATES.get(module)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    state = state_of(module)
    saved, state._group = state._group, None
    try:
        yield
    finally:
        state._group = saved


def watch_tensor(t: torch.Tensor, seen: list) -> torch.Tensor:
    if t.requires_grad:
        t.register_hook(lambda g: seen.append(g.shape) or g)
    return t


def backward_is_running() -> bool:
    return torch._C._current_graph_task_id() != -1
