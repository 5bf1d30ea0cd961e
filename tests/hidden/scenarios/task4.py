"""Task 4 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, Block, GPTConfig, ScaledResidual, ToyMLP, gpt_loss
from fsdp_assignment.support.state import fsdp_units
from tests.public.common import (describe_flat_params, hand_shard, hand_shard_as_built, hand_shard_gpt, local_batch,
                                 unsharded_storage_sizes)


BATCH = 4  # per rank


CFG = GPTConfig()
# The really-frees body's model: wide blocks (12.6 MiB each), built and sharded one at a time, so that a backward
# that frees nothing holds blocks far above what the witness allows (the kernel's noise is 1-2 MiB).
MEMORY_CFG = GPTConfig(n_layer=6, n_embd=512, n_head=4)


def _inputs(world_size: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH * world_size, 13, generator=torch.Generator().manual_seed(10 + step))


class TwoOutputs(nn.Module):
    """A unit whose forward returns two tensors (and a non-tensor); the caller decides which one it uses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.a(x), self.b(x), "tag"


class UsesOneOutput(nn.Module):
    def __init__(self, use: int):
        super().__init__()
        self.use = use
        self.pre = nn.Linear(5, 6)
        self.two = TwoOutputs()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        outputs = self.two(torch.tanh(self.pre(x)))
        return self.head(outputs[self.use])  # the loss depends on this output only


def _multi_output_inputs(world_size: int) -> torch.Tensor:
    return torch.randn(BATCH * world_size, 5, generator=torch.Generator().manual_seed(5))


def _multi_output(rank, world_size):
    out = {}
    for use in (0, 1):
        torch.manual_seed(use)
        model = UsesOneOutput(use)
        hand_shard(model, [model.two, model])
        x = _multi_output_inputs(world_size)[BATCH * rank:BATCH * (rank + 1)]
        model(x).pow(2).mean().backward()
        out[use] = {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model)}
    return out


def _two_backwards(rank, world_size):
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    # Nested units (inner, then its block), the never-used head `unused` as a unit of its own, then the root.
    units = [m for b in model.blocks for m in (b.inner, b)] + [model.unused, model]
    hand_shard(model, units)
    for step in range(2):  # no zero_grad: the second backward adds to the first one's gradients
        x = _inputs(world_size, step)[BATCH * rank:BATCH * (rank + 1)]
        model(x).pow(2).mean().backward()
    full_grads_alive = sum(fp.unsharded.grad is not None for u in adapters.fsdp_units(model) for fp in u.flat_params)
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": full_grads_alive, "multi_output": _multi_output(rank, world_size)}


class _CollectiveBuffers(TorchDispatchMode):
    """Weak references to the buffers the collectives read (their read-only tensor arguments), but the ones in
    ``keep`` (the model's own shards).

    gloo's worker thread holds a collective's buffers until it has finished with its request, a moment after the
    caller's wait() returns; under load that moment came after the measurement, and a correct implementation was
    measured with the last unit's full gradient still alive (issue 25: one unit's full buffer over the bound, 2 of
    10 runs at load 8)."""

    def __init__(self, keep):
        super().__init__()
        self.keep = {id(st) for st in keep}
        self.read: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                    for t in tree_leaves(value):
                        if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.keep:
                            self.read.append(weakref.ref(t.untyped_storage()))
        return func(*args, **kwargs)

    def wait_until_released(self, kept: list[torch.UntypedStorage], timeout_s: float = 5.0) -> None:
        """Until every buffer a collective read is freed (or resized to 0), but those in ``kept`` (what the
        implementation must keep: the shards' gradients): then no thread of the communication library holds one,
        and what is alive is what the implementation keeps. One that keeps a full gradient never gets there, and
        is measured after ``timeout_s`` with it. (Without ``kept`` a correct implementation, whose gradient shards
        a collective wrote, waited the whole ``timeout_s`` every run.)"""
        kept_ptrs = {st.data_ptr() for st in kept if st.nbytes()}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            gc.collect()
            if all(_released(ref, kept_ptrs) for ref in self.read):
                return
            time.sleep(0.01)  # (releases the GIL, which the worker thread needs to free a buffer Python knows)


def _released(ref: weakref.ref, kept_ptrs: set[int]) -> bool:
    storage = ref()
    return storage is None or storage.nbytes() == 0 or storage.data_ptr() in kept_ptrs


def _backward_memory(rank, world_size):
    from fsdp_assignment.support.memory import storages_of
    torch.manual_seed(0)
    model = hand_shard_as_built(lambda: GPT(MEMORY_CFG), Block)
    units = fsdp_units(model)
    block_bytes = [sum(fp.padded_numel * fp.unsharded.element_size() for fp in u.flat_params)
                   for u in units if not u.is_root]
    grad_shard_bytes = sum(fp.shard_numel * fp.shard.element_size() for u in units for fp in u.flat_params
                           if fp.shard.requires_grad)
    idx, tgt = local_batch(MEMORY_CFG, rank, world_size, step=0)
    with LiveStorageTracker(device="cpu") as mem:
        mem.track(model)  # the shards (and buffers): counted from the start, so what follows is on top of them
        base = mem.current_bytes
        with _CollectiveBuffers(keep=storages_of(model)) as collectives:
            loss = gpt_loss(model, idx, tgt)
            loss.backward()
            del loss
        collectives.wait_until_released(kept=storages_of([p.grad for p in model.parameters() if p.grad is not None]))
        after_backward = mem.current_bytes - base
    return {"after_backward": after_backward, "block_bytes": block_bytes, "grad_shard_bytes": grad_shard_bytes}


def _eval_then_train(rank, world_size):
    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        hand_shard_gpt(model, reshard_after_forward=reshard_after_forward)  # Task 4's hooks
        idx, tgt = local_batch(CFG, rank, world_size, step=0)
        with torch.no_grad():
            model(idx)  # evaluation: views made now carry no autograd history
        gpt_loss(model, idx, tgt).backward()
        out[reshard_after_forward] = describe_flat_params(model, grads=True)
    return out


class TwiceAndDetached(nn.Module):
    """A unit run twice in one forward (``shared``) and a unit whose output is detached (``side``: it runs forward
    but autograd never reaches it)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(13, 29)
        self.shared = ScaledResidual(29, 37)
        self.side = nn.Linear(29, 29)
        self.head = nn.Linear(29, 7)

    def forward(self, x):
        h = self.shared(self.shared(self.embed(x)))
        return self.head(h + self.side(h).detach())


def _twice_and_detached(rank, world_size):
    torch.manual_seed(0)
    model = TwiceAndDetached()
    hand_shard(model, [model.shared, model.side, model])
    x = _inputs(world_size, 0)[BATCH * rank:BATCH * (rank + 1)]
    model(x).pow(2).mean().backward()
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": sum(fp.unsharded.grad is not None for u in adapters.fsdp_units(model)
                                    for fp in u.flat_params)}
