"""Task 4: backward (re-gather, reduce-scatter gradients, free, finish before backward returns)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, ToyMLP, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard,
                                 hand_shard, hand_shard_gpt, local_batch, rank_device, unsharded_storage_sizes)

pytestmark = pytest.mark.task4


def _gpt_backward(rank, world_size, reshard_after_forward):
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg).to(rank_device())
    hand_shard_gpt(model, reshard_after_forward=reshard_after_forward)
    idx, tgt = local_batch(cfg, rank, world_size, step=0, device=rank_device())
    gpt_loss(model, idx, tgt).backward()
    full_grads_alive = [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                        for fp in u.flat_params if fp.unsharded.grad is not None]
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": full_grads_alive}


def _single_process_grads(model, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in
            model.named_parameters(remove_duplicate=False)}


def _check_grad_shards(results, model, unit_prefixes, expected_grads):
    """Every rank's gradient shards against single-process PyTorch. Which units exist, what each owns and
    which of its FlatParameters are trainable is decided from the parent's own ``model``."""
    for rank, got in enumerate(results):
        trainable = check_flat_params(got["flat"], model, unit_prefixes, f"rank {rank}")
        for desc, is_trainable in zip(got["flat"], trainable):
            unit = desc["prefix"] or "<root>"
            if not is_trainable:
                assert desc["grad"] is None, f"rank {rank}: frozen parameters of {unit} must get no gradient"
                continue
            assert desc["grad"] is not None, f"rank {rank}: unit {unit} has no gradient on its shard after backward"
            expected = expected_shard(desc, expected_grads)
            assert_close(desc["grad"], expected, f"rank {rank}: gradient shard of unit {unit}")
            pad_from = max(0, desc["numel"] - desc["shard_offset"])
            assert torch.all(desc["grad"][pad_from:] == 0), f"rank {rank}: gradient padding of {unit} must be zero"
        assert got["full_grads_alive"] == [], f"rank {rank}: full gradients still alive after backward: {got['full_grads_alive']}"
        assert len(got["sizes"]) == len(got["flat"]) and all(s == 0 for s in got["sizes"]), \
            f"rank {rank}: units still unsharded after backward: {got['sizes']}"


GPT_UNITS = [f"blocks.{i}." for i in range(GPTConfig().n_layer)] + [""]  # hand_shard_gpt: blocks, then the root


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gradient_shards_match_single_process(backend, world_size):
    results = run_ranks(_gpt_backward, world_size, True, backend=backend)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = gpt_batch(cfg, 2 * world_size, seed=0)
    _check_grad_shards(results, model, GPT_UNITS, _single_process_grads(model, gpt_loss(model, idx, tgt)))


def test_gradients_without_reshard_after_forward():
    results = run_ranks(_gpt_backward, 2, False)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = gpt_batch(cfg, 4, seed=0)
    _check_grad_shards(results, model, GPT_UNITS, _single_process_grads(model, gpt_loss(model, idx, tgt)))


def _toy_backward(rank, world_size):
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    units = [m for b in model.blocks for m in (b.inner, b)] + [model]  # nested: inner, then its block
    hand_shard(model, units)
    x = torch.randn(4 * world_size, 13, generator=torch.Generator().manual_seed(1))[4 * rank:4 * (rank + 1)]
    model(x).pow(2).mean().backward()
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": []}


def test_nested_frozen_and_unused_parameters():
    world_size = 3
    results = run_ranks(_toy_backward, world_size, timeout=30)
    torch.manual_seed(0)
    model = ToyMLP(with_unused=True)
    x = torch.randn(4 * world_size, 13, generator=torch.Generator().manual_seed(1))
    units = [p for i in range(len(model.blocks)) for p in (f"blocks.{i}.inner.", f"blocks.{i}.")] + [""]
    _check_grad_shards(results, model, units, _single_process_grads(model, model(x).pow(2).mean()))


def _reduce_scatter(rank, world_size):
    torch.manual_seed(0)
    block = ToyMLP().blocks[0]
    fp = adapters.make_flat_param(block, [n for n, p in block.named_parameters() if p.requires_grad], rank, world_size)
    grad = torch.arange(fp.padded_numel, dtype=torch.float32) * (rank + 1)
    return {"shard": adapters.reduce_scatter_grad(fp, grad), "shard_offset": fp.shard_offset,
            "shard_numel": fp.shard_numel, "padded_numel": fp.padded_numel}


def test_reduce_scatter_averages_over_ranks():
    world_size = 3
    results = run_ranks(_reduce_scatter, world_size)
    mean_factor = sum(r + 1 for r in range(world_size)) / world_size
    for rank, got in enumerate(results):
        full = torch.arange(got["padded_numel"], dtype=torch.float32) * mean_factor
        expected = full[got["shard_offset"]:got["shard_offset"] + got["shard_numel"]]
        assert torch.allclose(got["shard"], expected), \
            f"rank {rank}: reduce_scatter_grad must return this rank's slice of the MEAN over ranks (not the sum)"
