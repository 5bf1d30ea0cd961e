"""Task 4 (a student's): gather again for backward, reduce-scatter the gradients, free everything."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from .task2_flat_param import FlatParameter, flat_param_of
from .task3_forward import ForwardHooks, reshard, unshard


def reduce_scatter_grad(flat: FlatParameter, full_grad: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(flat.local)
    dist.reduce_scatter_tensor(out, full_grad / flat.world_size, group=flat.group)
    return out


class BackwardHooks(ForwardHooks):
    def __init__(self, units, reshard_after_forward=True):
        super().__init__(units, reshard_after_forward)
        self._queued = False
        self._done: set[int] = set()

    def post_forward(self, module, args, output):
        output = super().post_forward(module, args, output)
        flat = flat_param_of(module)
        if flat is None or not torch.is_grad_enabled():
            return output
        tensors = [t for t in (output if isinstance(output, tuple) else (output,)) if torch.is_tensor(t)
                   and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, m=module: self.pre_backward(m),
                                                          mode="any")
        return output

    def pre_backward(self, module: nn.Module) -> None:
        flat = flat_param_of(module)
        if flat.full.untyped_storage().size() == 0:
            unshard(flat)
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        for unit in self.units:
            flat = flat_param_of(unit)
            if flat is not None and flat._index not in self._done:
                grads = [getattr(owner, attr).grad for owner, attr, _ in flat.views()]
                if any(g is not None for g in grads):
                    full = torch.cat([g.reshape(-1) if g is not None else torch.zeros(n)
                                      for g, n in zip(grads, flat._numels)])
                    full = torch.nn.functional.pad(full, (0, flat.padded - full.numel()))
                    shard = reduce_scatter_grad(flat, full)
                    flat.local.grad = shard if flat.local.grad is None else flat.local.grad + shard
                reshard(flat)
        self._done.clear()
        self._queued = False
