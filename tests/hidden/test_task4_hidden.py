"""Task 4 (hidden): gradients accumulate over backward passes (no zero_grad in between), with nested units, frozen
parameters, a unit that never runs, and padding on W=3; backward really frees full parameters and gradients; a
forward under torch.no_grad() (evaluation) followed by a training step still gives every parameter its gradient;
a unit whose forward returns several tensors is re-gathered for backward whichever of its outputs the loss uses;
LoRA-style frozen units behind a frozen embedding; a unit run twice and a unit whose output is detached."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, GPTConfig, ScaledResidual, ToyMLP, gpt_batch, gpt_loss
from fsdp_assignment.support.state import fsdp_units
from tests.harness import run_ranks
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard, hand_shard,
                                 hand_shard_gpt, local_batch, unsharded_storage_sizes)
from tests.public.test_task4_backward import check_lora, lora_run

pytestmark = pytest.mark.task4

BATCH = 4  # per rank
CFG = GPTConfig()


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


MULTI_UNITS = ["two.", ""]


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


@pytest.mark.weight(3)
def test_gradients_accumulate_over_backward_passes():
    world_size = 3
    results = run_ranks(_two_backwards, world_size, timeout=30)
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    for step in range(2):
        model(_inputs(world_size, step)).pow(2).mean().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters(remove_duplicate=False)}
    units = [p for i in range(len(model.blocks)) for p in (f"blocks.{i}.inner.", f"blocks.{i}.")] + ["unused.", ""]
    for rank, got in enumerate(results):
        trainable = check_flat_params(got["flat"], model, units, f"rank {rank}")
        for desc, is_trainable in zip(got["flat"], trainable):
            unit = desc["prefix"] or "<root>"
            if not is_trainable:
                assert desc["grad"] is None, f"rank {rank}: frozen parameters of {unit} must get no gradient"
                continue
            expected = expected_shard(desc, grads)
            if unit == "unused.":
                assert desc["grad"] is None or not desc["grad"].any(), \
                    f"rank {rank}: unit {unit} never ran, so it must have no (or a zero) gradient"
                continue
            assert desc["grad"] is not None, f"rank {rank}: unit {unit} has no gradient after two backward passes"
            assert_close(desc["grad"], expected, (
                f"rank {rank}: gradient shard of unit {unit} after two backward passes without zero_grad "
                f"(the second must add to the first, as plain PyTorch does)"))
            pad_from = max(0, desc["numel"] - desc["shard_offset"])
            assert not desc["grad"][pad_from:].any(), f"rank {rank}: gradient padding of {unit} must stay zero"
        assert got["full_grads_alive"] == 0, f"rank {rank}: full (unsharded) gradients alive after backward"
        assert len(got["sizes"]) == len(got["flat"]) and all(s == 0 for s in got["sizes"]), \
            f"rank {rank}: units still unsharded after backward: {got['sizes']}"
    # A unit with several outputs: its pre-backward must run whichever output the loss depends on.
    for use in (0, 1):
        torch.manual_seed(use)
        model = UsesOneOutput(use)
        model(_multi_output_inputs(world_size)).pow(2).mean().backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        for rank, got in enumerate(results):
            got = got["multi_output"][use]
            where = f"rank {rank}, a unit returning (a, b) whose output {'ab'[use]} alone reaches the loss"
            check_flat_params(got["flat"], model, MULTI_UNITS, where)
            for desc in got["flat"]:
                assert desc["grad"] is not None, f"{where}: unit '{desc['prefix'] or '<root>'}' has no gradient"
                assert_close(desc["grad"], expected_shard(desc, grads), (
                    f"{where}: gradient shard of unit '{desc['prefix'] or '<root>'}'. The pre-backward must run when "
                    f"autograd reaches ANY of the unit's output tensors that require grad, not one chosen in advance"))
            assert len(got["sizes"]) == len(got["flat"]) and all(s == 0 for s in got["sizes"]), \
                f"{where}: units still unsharded after backward: {got['sizes']}"


def _backward_memory(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    hand_shard_gpt(model)
    units = fsdp_units(model)
    block_bytes = [sum(fp.padded_numel * fp.unsharded.element_size() for fp in u.flat_params)
                   for u in units if not u.is_root]
    grad_shard_bytes = sum(fp.shard_numel * fp.shard.element_size() for u in units for fp in u.flat_params
                           if fp.shard.requires_grad)
    idx, tgt = local_batch(CFG, rank, world_size, step=0)
    with LiveStorageTracker(device="cpu") as mem:
        mem.track(model)  # the shards (and buffers): counted from the start, so what follows is on top of them
        base = mem.current_bytes
        loss = gpt_loss(model, idx, tgt)
        loss.backward()
        del loss
        after_backward = mem.current_bytes - base
    return {"after_backward": after_backward, "block_bytes": block_bytes, "grad_shard_bytes": grad_shard_bytes}


@pytest.mark.weight(3)
def test_backward_really_frees_full_parameters_and_gradients():
    for rank, got in enumerate(run_ranks(_backward_memory, 2)):
        slack = min(got["block_bytes"]) // 2  # less than one block's full parameters
        bound = got["grad_shard_bytes"] + slack
        assert got["after_backward"] <= bound, (
            f"rank {rank}: {got['after_backward']} bytes alive after backward; expected about the gradient shards "
            f"({got['grad_shard_bytes']}): full parameters or full gradients were not freed")


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


@pytest.mark.weight(3)
def test_eval_under_no_grad_then_train():
    world_size = 2
    results = run_ranks(_eval_then_train, world_size)
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch(CFG, 2 * world_size, seed=0)
    gpt_loss(model, idx, tgt).backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    for rank, got in enumerate(results):
        for reshard_after_forward, descs in got.items():
            check_flat_params(descs, model, [f"blocks.{i}." for i in range(CFG.n_layer)] + [""],
                              f"rank {rank}, reshard_after_forward={reshard_after_forward}")
            for desc in descs:
                where = (f"rank {rank}, reshard_after_forward={reshard_after_forward}, unit "
                         f"'{desc['prefix'] or '<root>'}'")
                assert desc["grad"] is not None, (
                    f"{where}: no gradient after a forward under torch.no_grad() followed by a training step: "
                    f"point the parameters at fresh views in every pre-forward, even when the unit is unsharded "
                    f"already (views made under no_grad have no path to the flat parameter)")
                assert_close(desc["grad"], expected_shard(desc, grads), f"{where}: gradient shard")


@pytest.mark.weight(2)
def test_frozen_embedding_and_a_fully_frozen_unit():
    """LoRA-style blocks behind a frozen embedding (the first block's input needs no gradient, so autograd never
    reaches its inputs) with one block frozen entirely (no gradient at all): nothing hangs, adapter gradients and
    one AdamW step equal one process, one non-root unit unsharded at a time during backward, none after."""
    world_size = 3
    check_lora(run_ranks(lora_run, world_size, 4, False, True, 2), world_size, freeze_embedding=True, frozen_block=2)


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


def test_unit_run_twice_and_detached_output():
    """Neither hangs nor stays unsharded: the unit run twice gets the sum of both runs' gradients, the unit whose
    output was detached gets none (or zeros), and every unit is resharded when backward returns."""
    world_size = 2
    results = run_ranks(_twice_and_detached, world_size, timeout=30)
    torch.manual_seed(0)
    model = TwiceAndDetached()
    model(_inputs(world_size, 0)).pow(2).mean().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters(remove_duplicate=False)}
    for rank, got in enumerate(results):
        for desc in got["flat"]:
            unit = desc["prefix"] or "<root>"
            if not desc["requires_grad"]:
                assert desc["grad"] is None, f"rank {rank}: frozen parameters of {unit} must get no gradient"
            elif unit == "side.":
                assert desc["grad"] is None or not desc["grad"].any(), \
                    f"rank {rank}: unit {unit}'s output was detached, so it must have no (or a zero) gradient"
            else:
                assert desc["grad"] is not None, f"rank {rank}: unit {unit} has no gradient after backward"
                assert_close(desc["grad"], expected_shard(desc, grads), (
                    f"rank {rank}: gradient shard of unit {unit} (the unit run twice must get the sum of both "
                    f"runs' gradients, reduced once per post-backward)"))
        assert got["full_grads_alive"] == 0, f"rank {rank}: full (unsharded) gradients alive after backward"
        assert all(s == 0 for s in got["sizes"]), (
            f"rank {rank}: units still unsharded after backward: {got['sizes']} (a unit run twice, or one whose "
            f"output was detached, must be resharded too: the final callback is the backstop)")
