"""Task 7 (hidden): mixed precision gathers in param_dtype and reduces in reduce_dtype (a policy with only
reduce_dtype too), casts positional and keyword inputs unless cast_forward_inputs=False, and sums gradients
accumulated without sync in reduce_dtype; gradient accumulation over two optimizer steps (with prefetching)
communicates no gradient before the synced micro-batch; fully_shard(reshard_after_forward=False) never gathers an
unsharded unit again; gather_full_params on every rank, from the shards; a parameter tied across units (siblings
in either order, a child and its parent, GPT's lm_head and wte) is rejected with a ValueError naming both units."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, TiedModel, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.collectives import use_counted_collectives
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard, full_params_of,
                                 local_batch, train_single_process, unit_numels)

pytestmark = pytest.mark.task7

CFG = GPTConfig()
SGD = dict(lr=0.1, momentum=0.9)
REDUCTIONS = ("reduce_scatter", "all_reduce", "reduce")


def _shard_gpt(model, **kwargs):
    for block in model.blocks:
        adapters.fully_shard(block, **kwargs)
    adapters.fully_shard(model, **kwargs)
    return model


class KwargsNet(nn.Module):
    """Its input arrives as a keyword argument: ``net(x=...)``."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(5, 8)
        self.lin2 = nn.Linear(8, 3)

    def forward(self, *, x):
        return self.lin2(torch.tanh(self.lin1(x)))


class Probe(nn.Module):
    """Records the dtype of the input its forward receives, and computes in its weight's dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[str] = []

    def forward(self, x):
        self.seen.append(str(x.dtype))
        return self.lin(x.to(self.lin.weight.dtype))


# Gradient accumulation without sync under param_dtype=bf16, reduce_dtype=fp32: the first micro-batch's gradient
# is 1, the others' 2^-10 (exact in bf16). Summed in fp32 they add up to 1 + 4 * 2^-10; summed in bf16 each one
# is lost (the bf16 spacing at 1 is 2^-7), so the sum stays 1.
ACCUM_INPUTS = [1.0] + [2.0 ** -10] * 4


def _accumulation_precision(policy):
    torch.manual_seed(0)
    lin = nn.Linear(4, 1, bias=False)
    adapters.fully_shard(lin, mixed_precision=policy)
    for micro, value in enumerate(ACCUM_INPUTS):
        adapters.set_requires_gradient_sync(lin, micro == len(ACCUM_INPUTS) - 1)
        lin(torch.full((1, 4), value)).float().sum().backward()
    return describe_flat_params(lin, grads=True)


def _mixed_precision(rank, world_size):
    log = use_counted_collectives(late=True)  # every collective's dtype, however it is called
    out = {}
    policies = {"bf16_params_fp32_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "bf16_params_default_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                "bf16_reduce_only": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = _shard_gpt(GPT(CFG), mixed_precision=policy)
        idx, tgt = local_batch(CFG, rank, world_size, 0)
        start = log.mark()
        loss = gpt_loss(model, idx, tgt)
        middle = log.mark()
        loss.backward()
        out[name] = {"forward": log.since(start)[:middle - start], "backward": log.since(middle),
                     "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})}
    # Floating-point inputs (GPT's are token ids): the unit casts them to param_dtype (cast_forward_inputs),
    # positional and keyword arguments alike.
    bf16 = policies["bf16_params_fp32_reduce"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    adapters.fully_shard(net[0], mixed_precision=bf16)
    adapters.fully_shard(net, mixed_precision=bf16)
    torch.manual_seed(0)
    kw_net = KwargsNet()
    adapters.fully_shard(kw_net.lin2, mixed_precision=bf16)
    adapters.fully_shard(kw_net, mixed_precision=bf16)  # its own lin1 sees the keyword input first
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    for key, call in (("float_inputs", lambda: net(x)), ("kwarg_inputs", lambda: kw_net(x=x))):
        try:
            y = call()
            y.float().pow(2).mean().backward()
            out[key] = {"error": "", "output_dtype": str(y.dtype)}
        except RuntimeError as e:
            if isinstance(e, NotImplementedError):
                raise
            out[key] = {"error": f"{type(e).__name__}: {e}", "output_dtype": ""}
    # cast_forward_inputs=False: the inputs reach forward as they are.
    seen = {}
    for cast in (True, False):
        probe = Probe()
        adapters.fully_shard(probe, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                         cast_forward_inputs=cast))
        probe(x)
        seen[cast] = probe.seen
    out["cast_forward_inputs"] = seen
    out["accumulation"] = _accumulation_precision(bf16)
    # Meta-device init under mixed precision: the same computation as eager init (gathered in bf16).
    meta = {}
    for on_meta in (True, False):
        torch.manual_seed(0)
        with torch.device("meta" if on_meta else "cpu"):
            model = GPT(CFG)
        _shard_gpt(model, mixed_precision=bf16)
        if on_meta:
            adapters.materialize_meta_module(model, "cpu")
        dtypes = []
        model.blocks[0].mlp.c_fc.register_forward_pre_hook(lambda m, a: dtypes.append(str(m.weight.dtype)))
        idx, tgt = local_batch(CFG, rank, world_size, 0)
        gpt_loss(model, idx, tgt).backward()
        meta[on_meta] = {"dtypes": dtypes, "flat": describe_flat_params(model, grads=True)}
    out["meta_init"] = meta
    return out


@pytest.mark.weight(2)
def test_mixed_precision_gathers_and_reduces_in_the_right_dtypes():
    expected_reduce = {"bf16_params_fp32_reduce": "torch.float32",
                       "bf16_params_default_reduce": "torch.bfloat16"}  # FSDP2: reduce_dtype defaults to param_dtype
    world_size = 2
    results = run_ranks(_mixed_precision, world_size)
    expected_gather = {"bf16_params_fp32_reduce": "torch.bfloat16", "bf16_params_default_reduce": "torch.bfloat16",
                       "bf16_reduce_only": "torch.float32"}  # no param_dtype: parameters stay fp32
    expected_reduce["bf16_reduce_only"] = "torch.bfloat16"
    lin = nn.Linear(4, 1, bias=False)
    summed = sum(torch.full((4,), v, dtype=torch.float64) for v in ACCUM_INPUTS).float()  # same on every rank
    for rank, got in enumerate(results):
        for key, how in (("float_inputs", "positional"), ("kwarg_inputs", "keyword")):
            floats = got.pop(key)
            assert not floats["error"], (
                f"rank {rank}: a model with floating-point {how} inputs fails under param_dtype=bf16: "
                f"{floats['error']}. The pre-forward casts floating-point inputs to param_dtype, in positional and "
                f"keyword arguments alike (MixedPrecisionPolicy.cast_forward_inputs)")
            assert floats["output_dtype"] == "torch.bfloat16", \
                f"rank {rank}: the output of a bf16 unit is {floats['output_dtype']}, expected torch.bfloat16"
        seen = got.pop("cast_forward_inputs")
        assert seen == {True: ["torch.bfloat16"], False: ["torch.float32"]}, (
            f"rank {rank}: dtypes of the fp32 input the unit's forward received with cast_forward_inputs=True/False: "
            f"{seen}; expected bf16 with True, the input untouched (fp32) with False")
        meta = got.pop("meta_init")
        assert meta[True]["dtypes"] == ["torch.bfloat16"], (
            f"rank {rank}: after meta-device init of a model sharded with param_dtype=bf16, forward sees "
            f"{meta[True]['dtypes']} parameters: materialization must keep the unsharded buffers in param_dtype")
        assert len(meta[True]["flat"]) == len(meta[False]["flat"]) == CFG.n_layer + 1, (
            f"rank {rank}: {len(meta[True]['flat'])} and {len(meta[False]['flat'])} FlatParameters with and without "
            f"meta-device init; expected one per unit ({CFG.n_layer + 1}: the blocks and the root)")
        for a, b in zip(meta[True]["flat"], meta[False]["flat"]):
            assert a["grad"] is not None and b["grad"] is not None and torch.equal(a["grad"], b["grad"]), (
                f"rank {rank}: unit '{a['prefix'] or '<root>'}': gradients after meta-device init differ from eager "
                f"init under the same bf16 policy")
        accumulated = got.pop("accumulation")
        check_flat_params(accumulated, lin, [""], f"rank {rank}, accumulation")
        for desc in accumulated:
            assert_close(desc["grad"], expected_shard(desc, {"weight": summed.view(1, 4)}), (
                f"rank {rank}: gradient accumulated over {len(ACCUM_INPUTS)} micro-batches without sync under "
                f"param_dtype=bf16, reduce_dtype=fp32: gradients must be summed in reduce_dtype (fp32), not in the "
                f"bf16 of the parameters (small micro-batch gradients are lost in a bf16 sum)"), rtol=1e-6)
        for name, g in got.items():
            gathers = [c["dtype"] for c in g["forward"] if c["kind"] == "all_gather"]
            reductions = [c["dtype"] for c in g["backward"] if c["kind"] in REDUCTIONS]
            assert gathers and reductions, (
                f"rank {rank}, {name}: no all-gather in forward or no reduction in backward was seen")
            assert set(gathers) == {expected_gather[name]}, (
                f"rank {rank}, {name}: forward all-gathers in {sorted(set(gathers))}, expected "
                f"{expected_gather[name]} (param_dtype; the parameters' own dtype when it is None)")
            assert set(reductions) == {expected_reduce[name]}, (
                f"rank {rank}, {name}: gradients reduced in {sorted(set(reductions))}, expected "
                f"{expected_reduce[name]} (reduce_dtype, which defaults to param_dtype)")
            assert g["shard_dtypes"] == ["torch.float32"] and g["grad_dtypes"] == ["torch.float32"], (
                f"rank {rank}, {name}: sharded parameters {g['shard_dtypes']} and their gradients "
                f"{g['grad_dtypes']} must stay fp32")


def _accumulate(rank, world_size, steps, micro_batches):
    log = use_counted_collectives(late=True)  # every collective, however it is called
    torch.manual_seed(0)
    model = _shard_gpt(GPT(CFG))
    adapters.set_prefetch(model, True)
    optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
    early = []
    for step in range(steps):
        optim.zero_grad()
        for micro in range(micro_batches):
            sync = micro == micro_batches - 1
            adapters.set_requires_gradient_sync(model, sync)
            idx, tgt = local_batch(CFG, rank, world_size, step * micro_batches + micro)
            before = log.mark()
            gpt_loss(model, idx, tgt).backward()
            if not sync:
                # Re-gathering parameters is expected; communicating gradients is not.
                early += [(step, micro, c["kind"]) for c in log.since(before)
                          if c["kind"] not in ("all_gather", "barrier")]
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
        assert got["early"] == [], (f"rank {rank}: gradients communicated during backward passes without gradient "
                                    f"sync (step, micro-batch, collective): {got['early']}; with "
                                    f"set_requires_gradient_sync(False) no reduction of any kind may run")
        for name, p in full_params_of(model).items():
            assert_close(got["params"][name], p, (
                f"rank {rank}: {name} after {steps} steps of {micro_batches} accumulated micro-batches (with "
                f"prefetching): each step must apply exactly the sum of its own micro-batches' gradients"))


def _no_reshard(rank, world_size):
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        adapters.fully_shard(block, reshard_after_forward=False)
    adapters.fully_shard(model)
    units = [b._fsdp_unit for b in model.blocks]
    optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
    sizes, calls = [], []
    for step in range(2):
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        start = log.mark()
        loss = gpt_loss(model, idx, tgt)
        after_forward = [fp.unsharded.untyped_storage().size() for u in units for fp in u.flat_params]
        middle = log.mark()
        loss.backward()
        after_backward = [fp.unsharded.untyped_storage().size() for u in units for fp in u.flat_params]
        sizes.append((after_forward, after_backward))
        calls.append((log.since(start)[:middle - start], log.since(middle)))
        optim.step()
    before_gather = log.mark()
    params = adapters.gather_full_params(model)
    return {"sizes": sizes, "calls": calls, "params": params, "gather_calls": log.since(before_gather),
            "shard_numels": [p.numel() for p in model.parameters()], "flat": describe_flat_params(model)}


@pytest.mark.weight(2)
def test_reshard_after_forward_false_via_fully_shard():
    world_size = 2
    results = run_ranks(_no_reshard, world_size)
    expected = train_single_process(CFG, world_size, 2, torch.optim.SGD, **SGD)
    units = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]
    numels = unit_numels(expected, units)
    shard = {k: -(-n // world_size) for k, n in numels.items()}  # each unit's shard, from the parent's model
    full = full_params_of(expected)
    for rank, got in enumerate(results):
        for step, (after_forward, after_backward) in enumerate(got["sizes"]):
            assert len(after_forward) == len(after_backward) == CFG.n_layer, \
                f"rank {rank}, step {step}: expected one FlatParameter per block, got {len(after_forward)}"
            assert all(s > 0 for s in after_forward), (
                f"rank {rank}, step {step}: blocks made with fully_shard(block, reshard_after_forward=False) must "
                f"stay unsharded after forward (storage sizes {after_forward})")
            assert all(s == 0 for s in after_backward), \
                f"rank {rank}, step {step}: every unit must be resharded after backward ({after_backward})"
            forward, backward = got["calls"][step]
            fwd = sorted(c["numel"] for c in forward if c["kind"] == "all_gather")
            assert fwd == sorted(shard.values()), (
                f"rank {rank}, step {step}: forward all-gathered shards of {fwd} elements; expected every unit once "
                f"({sorted(shard.values())})")
            block_gathers = [c["numel"] for c in backward if c["kind"] == "all_gather" and c["numel"] != shard[""]]
            assert not block_gathers, (
                f"rank {rank}, step {step}: backward all-gathered {block_gathers} elements again although the blocks "
                f"stayed unsharded after forward (reshard_after_forward=False): a unit that is unsharded already "
                f"must not be gathered again")
        check_flat_params(got["flat"], expected, units, f"rank {rank}")
        assert sum(got["shard_numels"]) == sum(shard.values()), (
            f"rank {rank}: this rank's parameters hold {sum(got['shard_numels'])} elements, a shard of every unit "
            f"holds {sum(shard.values())}")
        for desc in got["flat"]:
            assert_close(desc["shard"], expected_shard(desc, full),
                         f"rank {rank}: shard of '{desc['prefix'] or '<root>'}'")
        gathered = [c for c in got["gather_calls"] if c["kind"] != "barrier"]
        assert gathered and all(c["kind"] == "all_gather" for c in gathered) and \
            sum(c["numel"] for c in gathered) == sum(shard.values()), (
            f"rank {rank}: gather_full_params must build the full parameters from every rank's shard (an "
            f"all-gather of this rank's {sum(shard.values())} elements); it communicated {gathered}")
        assert set(got["params"]) == set(full), \
            f"rank {rank}: gather_full_params must give every parameter, under each of its names, on every rank"
        for name, p in full.items():
            assert_close(got["params"][name], p, f"rank {rank}: {name} after 2 SGD steps (reshard_after_forward=False)")


# case -> (model, the units applied first, the unit that must be rejected, the classes its message names)
TIE_CASES = {
    "sibling head, then embed": (TiedModel, lambda m: [m.head], lambda m: m.embed, ("Linear", "Embedding")),
    "child head, then the parent": (TiedModel, lambda m: [m.head], lambda m: m, ("Linear", "TiedModel")),
    "GPT lm_head, then wte": (lambda: GPT(CFG), lambda m: [*m.blocks, m.lm_head], lambda m: m.wte,
                              ("Linear", "Embedding")),
}


def _ties_across_units(rank, world_size):
    out = {}
    for case, (make, firsts, second, _) in TIE_CASES.items():
        model = make()
        for module in firsts(model):
            adapters.fully_shard(module)
        try:
            adapters.fully_shard(second(model))
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


def test_tie_across_units_is_rejected_in_every_arrangement():
    got = run_ranks(_ties_across_units, 2)
    for rank, messages in enumerate(got):
        for case, message in messages.items():
            assert message is not None, f"rank {rank}, {case}: fully_shard must raise ValueError for a parameter " \
                                        "another unit already flattened (a tie across units)"
            names = TIE_CASES[case][3]
            assert all(n in message for n in names), \
                f"rank {rank}, {case}: the ValueError must name both units ({' and '.join(names)}); got: {message}"
