"""Task 7 (hidden): mixed precision gathers in param_dtype and reduces in reduce_dtype; gradient accumulation over
two optimizer steps (with prefetching); fully_shard(reshard_after_forward=False); gather_full_params on every
rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.common import assert_close, full_params_of, local_batch, train_single_process

pytestmark = pytest.mark.task7

CFG = GPTConfig()
SGD = dict(lr=0.1, momentum=0.9)
ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
REDUCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter",
              "all_reduce")


def _shard_gpt(model, **kwargs):
    for block in model.blocks:
        adapters.fully_shard(block, **kwargs)
    adapters.fully_shard(model, **kwargs)
    return model


def _record_collectives(log):
    """Wrap torch.distributed's gathers and reductions (in this rank) to log (kind, dtype) of each call."""
    def wrap(name, kind):
        real = getattr(dist, name)

        def patched(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)] or \
                [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            # the output of a gather (what the forward computes with), the input of a reduction (what is summed)
            tensor = tensors[0] if kind == "gather" else tensors[-1]
            log.append((kind, str(tensor.dtype)))
            return real(*args, **kwargs)
        return patched

    for names, kind in ((ALL_GATHERS, "gather"), (REDUCTIONS, "reduce")):
        for name in names:
            if hasattr(dist, name):
                setattr(dist, name, wrap(name, kind))


def _mixed_precision(rank, world_size):
    out = {}
    policies = {"bf16_params_fp32_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "bf16_params_default_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    log: list = []
    _record_collectives(log)
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = _shard_gpt(GPT(CFG), mixed_precision=policy)
        idx, tgt = local_batch(CFG, rank, world_size, 0)
        log.clear()
        loss = gpt_loss(model, idx, tgt)
        forward = list(log)
        log.clear()
        loss.backward()
        backward = list(log)
        out[name] = {"forward": forward, "backward": backward,
                     "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})}
    # Floating-point inputs (GPT's are token ids): the unit casts them to param_dtype (cast_forward_inputs).
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    adapters.fully_shard(net[0], mixed_precision=policies["bf16_params_fp32_reduce"])
    adapters.fully_shard(net, mixed_precision=policies["bf16_params_fp32_reduce"])
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    try:
        y = net(x)
        y.float().pow(2).mean().backward()
        out["float_inputs"] = {"error": "", "output_dtype": str(y.dtype)}
    except RuntimeError as e:
        if isinstance(e, NotImplementedError):
            raise
        out["float_inputs"] = {"error": f"{type(e).__name__}: {e}", "output_dtype": ""}
    return out


@pytest.mark.weight(2)
def test_mixed_precision_gathers_and_reduces_in_the_right_dtypes():
    expected_reduce = {"bf16_params_fp32_reduce": "torch.float32",
                       "bf16_params_default_reduce": "torch.bfloat16"}  # FSDP2: reduce_dtype defaults to param_dtype
    for rank, got in enumerate(run_ranks(_mixed_precision, 2)):
        floats = got.pop("float_inputs")
        assert not floats["error"], (
            f"rank {rank}: a model with floating-point inputs fails under param_dtype=bf16: {floats['error']}. "
            f"The pre-forward casts floating-point inputs to param_dtype (MixedPrecisionPolicy.cast_forward_inputs)")
        assert floats["output_dtype"] == "torch.bfloat16", \
            f"rank {rank}: the output of a bf16 unit is {floats['output_dtype']}, expected torch.bfloat16"
        for name, g in got.items():
            gathers = [d for k, d in g["forward"] if k == "gather"]
            reductions = [d for k, d in g["backward"] if k == "reduce"]
            assert gathers and reductions, (
                f"rank {rank}, {name}: no all-gather in forward or no reduction in backward was seen: call the "
                f"collectives through the module (dist.all_gather_into_tensor(...), dist.reduce_scatter_tensor(...))")
            assert set(gathers) == {"torch.bfloat16"}, \
                f"rank {rank}, {name}: forward all-gathers in {sorted(set(gathers))}; param_dtype is bf16"
            assert set(reductions) == {expected_reduce[name]}, (
                f"rank {rank}, {name}: gradients reduced in {sorted(set(reductions))}, expected "
                f"{expected_reduce[name]} (reduce_dtype, which defaults to param_dtype)")
            assert g["shard_dtypes"] == ["torch.float32"] and g["grad_dtypes"] == ["torch.float32"], (
                f"rank {rank}, {name}: sharded parameters {g['shard_dtypes']} and their gradients "
                f"{g['grad_dtypes']} must stay fp32")


def _accumulate(rank, world_size, steps, micro_batches):
    torch.manual_seed(0)
    model = _shard_gpt(GPT(CFG))
    adapters.set_prefetch(model, True)
    optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
    calls = []
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        if hasattr(dist, name):
            real = getattr(dist, name)
            setattr(dist, name, lambda *a, real=real, **k: (calls.append(1), real(*a, **k))[1])
    early = []
    for step in range(steps):
        optim.zero_grad()
        for micro in range(micro_batches):
            sync = micro == micro_batches - 1
            adapters.set_requires_gradient_sync(model, sync)
            idx, tgt = local_batch(CFG, rank, world_size, step * micro_batches + micro)
            before = len(calls)
            gpt_loss(model, idx, tgt).backward()
            if not sync and len(calls) != before:
                early.append((step, micro, len(calls) - before))
        optim.step()
    return {"params": adapters.gather_full_params(model), "early": early}


@pytest.mark.weight(3)
def test_gradient_accumulation_over_two_steps_with_prefetch():
    world_size, steps, micro_batches = 2, 2, 2
    results = run_ranks(_accumulate, world_size, steps, micro_batches)
    torch.manual_seed(0)
    model = GPT(CFG)
    optim = torch.optim.SGD(model.parameters(), **SGD)
    for step in range(steps):
        optim.zero_grad()
        for micro in range(micro_batches):
            idx, tgt = gpt_batch(CFG, 2 * world_size, seed=step * micro_batches + micro)
            gpt_loss(model, idx, tgt).backward()
        optim.step()
    for rank, got in enumerate(results):
        assert got["early"] == [], (f"rank {rank}: reduce-scatters during backward passes without gradient sync "
                                    f"(step, micro-batch, count): {got['early']}")
        for name, p in full_params_of(model).items():
            assert_close(got["params"][name], p, (
                f"rank {rank}: {name} after {steps} steps of {micro_batches} accumulated micro-batches (with "
                f"prefetching): each step must apply exactly the sum of its own micro-batches' gradients"))


def _no_reshard(rank, world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        adapters.fully_shard(block, reshard_after_forward=False)
    adapters.fully_shard(model)
    units = [b._fsdp_unit for b in model.blocks]
    optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
    sizes = []
    for step in range(2):
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        loss = gpt_loss(model, idx, tgt)
        after_forward = [fp.unsharded.untyped_storage().size() for u in units for fp in u.flat_params]
        loss.backward()
        after_backward = [fp.unsharded.untyped_storage().size() for u in units for fp in u.flat_params]
        sizes.append((after_forward, after_backward))
        optim.step()
    return {"sizes": sizes, "params": adapters.gather_full_params(model)}


@pytest.mark.weight(2)
def test_reshard_after_forward_false_via_fully_shard():
    world_size = 2
    results = run_ranks(_no_reshard, world_size)
    expected = train_single_process(CFG, world_size, 2, torch.optim.SGD, **SGD)
    for rank, got in enumerate(results):
        for step, (after_forward, after_backward) in enumerate(got["sizes"]):
            assert all(s > 0 for s in after_forward), (
                f"rank {rank}, step {step}: blocks made with fully_shard(block, reshard_after_forward=False) must "
                f"stay unsharded after forward (storage sizes {after_forward})")
            assert all(s == 0 for s in after_backward), \
                f"rank {rank}, step {step}: every unit must be resharded after backward ({after_backward})"
        assert set(got["params"]) == set(full_params_of(expected)), \
            f"rank {rank}: gather_full_params must give every parameter, under each of its names, on every rank"
        for name, p in full_params_of(expected).items():
            assert_close(got["params"][name], p, f"rank {rank}: {name} after 2 SGD steps (reshard_after_forward=False)")
