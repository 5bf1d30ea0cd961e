"""Task 4 (hidden): gradients accumulate over backward passes (no zero_grad in between), with nested units, frozen
parameters, a unit that never runs, and padding on W=3; backward really frees full parameters and gradients; a
forward under torch.no_grad() (evaluation) followed by a training step still gives every parameter its gradient;
a unit whose forward returns several tensors is re-gathered for backward whichever of its outputs the loss uses;
LoRA-style frozen units behind a frozen embedding; a unit run twice and a unit whose output is detached."""

from __future__ import annotations

import pytest
import torch

from fsdp_assignment.support.models import GPT, ToyMLP, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.common import assert_close, check_flat_params, expected_shard, witness_for
from tests.public.test_task4_backward import check_lora, lora_run, lora_witness
from tests.hidden.scenarios.task4 import (  # what the ranks run
    CFG,
    MEMORY_CFG,
    TwiceAndDetached,
    UsesOneOutput,
    _backward_memory,
    _eval_then_train,
    _inputs,
    _multi_output_inputs,
    _twice_and_detached,
    _two_backwards,
)

pytestmark = pytest.mark.task4


MULTI_UNITS = ["two.", ""]


@pytest.mark.weight(3)
@pytest.mark.evidence("memory")
def test_gradients_accumulate_over_backward_passes():
    world_size = 3
    # Two backwards: nested units (an inner unit alive inside its block's), each gathered twice and reduce-scattered
    # once a backward.
    units = [p for i in range(3) for p in (f"blocks.{i}.inner.", f"blocks.{i}.")] + ["unused.", ""]
    witness = witness_for(lambda: ToyMLP(with_unused=True), units, world_size, unsharded=3, full_grads=2, moved=8)
    results = run_ranks(_two_backwards, world_size, timeout=30, witness=witness)
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


@pytest.mark.weight(3)
@pytest.mark.evidence("memory")
def test_backward_really_frees_full_parameters_and_gradients():
    # One backward, the model built unit by unit: the root and the unit computing, its full gradient and the
    # reduce-scatter's input and output at most; every unit gathered twice and reduce-scattered once (gloo's own
    # reduce-scatter, which moves an all-reduce's bytes: twice).
    witness = witness_for(lambda: GPT(MEMORY_CFG), [f"blocks.{i}." for i in range(MEMORY_CFG.n_layer)] + [""], 2,
                          built=0, unsharded=2, full_grads=3, moved=4)
    for rank, got in enumerate(run_ranks(_backward_memory, 2, witness=witness)):
        slack = min(got["block_bytes"]) // 2  # less than one block's full parameters
        bound = got["grad_shard_bytes"] + slack
        assert got["after_backward"] <= bound, (
            f"rank {rank}: {got['after_backward']} bytes alive after backward; expected about the gradient shards "
            f"({got['grad_shard_bytes']}): full parameters or full gradients were not freed")


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
@pytest.mark.evidence("memory")
def test_frozen_embedding_and_a_fully_frozen_unit():
    """LoRA-style blocks behind a frozen embedding (the first block's input needs no gradient, so autograd never
    reaches its inputs) with one block frozen entirely (no gradient at all): nothing hangs, adapter gradients and
    one AdamW step equal one process, one non-root unit unsharded at a time during backward, none after."""
    world_size = 3
    witness = lora_witness(world_size, freeze_embedding=True, frozen_block=2)
    check_lora(run_ranks(lora_run, world_size, 4, False, True, 2, witness=witness), world_size, freeze_embedding=True,
               frozen_block=2)


@pytest.mark.evidence("memory")
def test_unit_run_twice_and_detached_output():
    """Neither hangs nor stays unsharded: the unit run twice gets the sum of both runs' gradients, the unit whose
    output was detached gets none (or zeros), and every unit is resharded when backward returns."""
    world_size = 2
    # A unit run twice (gathered up to twice more in backward) and one whose output is detached.
    witness = witness_for(TwiceAndDetached, ["shared.", "side.", ""], world_size, unsharded=3, moved=6)
    results = run_ranks(_twice_and_detached, world_size, timeout=30, witness=witness)
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
            f"output was detached, must be resharded too, by the time loss.backward() returns)")
