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

from fsdp_assignment.support.models import GPT, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.invariants import check_monitor
from tests.public.common import (
    assert_close, check_flat_params, expected_shard, full_params_of, train_single_process, unit_numels, witness_for,
    WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
)
from tests.hidden.scenarios.task7 import (  # what the ranks run
    ACCUM_INPUTS,
    CFG,
    SGD,
    _accumulate,
    _mixed_precision,
    _no_reshard,
    _ties_across_units,
)

pytestmark = pytest.mark.task7

REDUCTIONS = ("reduce_scatter", "all_reduce", "reduce")


# Gradient accumulation without sync under param_dtype=bf16, reduce_dtype=fp32: the first micro-batch's gradient
# is 1, the others' 2^-10 (exact in bf16). Summed in fp32 they add up to 1 + 4 * 2^-10; summed in bf16 each one
# is lost (the bf16 spacing at 1 is 2^-7), so the sum stays 1.


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
        policy_out = got.pop("output_dtype_policy")
        assert policy_out in ("refused", "torch.float32"), (
            f"rank {rank}: fully_shard with MixedPrecisionPolicy(param_dtype=bf16, output_dtype=float32) gave a "
            f"{policy_out} output: output_dtype was ignored. Either cast the unit's output to output_dtype (as "
            f"FSDP2 does) or raise NotImplementedError naming output_dtype")
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


GPT_UNITS_HIDDEN = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]  # the scenarios shard the blocks, then the root


@pytest.mark.weight(3)
@pytest.mark.evidence("bytes", "memory")
def test_gradient_accumulation_over_two_steps_with_prefetch():
    world_size, steps, micro_batches = 2, 2, 2
    # Every unit gathered twice a micro-batch, reduce-scattered once a step (the synced micro-batch), then gathered
    # once for the values; an SGD state (momentum) on the shards.
    witness = witness_for(lambda: GPT(CFG), GPT_UNITS_HIDDEN, world_size, shard_copies=3,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
                          moved=steps * (2 * micro_batches + 1) + 1)
    results = run_ranks(_accumulate, world_size, steps, micro_batches, witness=witness)
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
        # Every invariant in every micro-batch, with the switches of that micro-batch: prefetching on throughout
        # (it must happen: forward and backward prefetch, reduce-scatters overlapping), gradient sync and each
        # unit's reshard_after_forward flipped between micro-batches (in effect in the very next one).
        check_monitor(got["monitor"], GPT(CFG), world_size, f"rank {rank}")
        assert got["early"] == [], (f"rank {rank}: gradients communicated during backward passes without gradient "
                                    f"sync (step, micro-batch, collective): {got['early']}; with "
                                    f"set_requires_gradient_sync(False) no reduction of any kind may run")
        for name, p in full_params_of(model).items():
            assert_close(got["params"][name], p, (
                f"rank {rank}: {name} after {steps} steps of {micro_batches} accumulated micro-batches (with "
                f"prefetching): each step must apply exactly the sum of its own micro-batches' gradients"))


@pytest.mark.weight(2)
@pytest.mark.evidence("memory")
def test_reshard_after_forward_false_via_fully_shard():
    world_size = 2
    # Blocks stay unsharded from forward to backward: all of them may be alive at once. Each step gathers every
    # unit once (the root again in backward) and reduce-scatters it once; then one gather for the values.
    witness = witness_for(lambda: GPT(CFG), GPT_UNITS_HIDDEN, world_size, shard_copies=3, unsharded=CFG.n_layer + 1,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, moved=2 * 3 + 1)
    results = run_ranks(_no_reshard, world_size, witness=witness)
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


# case -> the classes the ValueError's message must name (both units)
TIE_NAMES = {
    "sibling head, then embed": ("Linear", "Embedding"),
    "child head, then the parent": ("Linear", "TiedModel"),
    "GPT lm_head, then wte": ("Linear", "Embedding"),
}


def test_tie_across_units_is_rejected_in_every_arrangement():
    got = run_ranks(_ties_across_units, 2)
    for rank, messages in enumerate(got):
        assert set(messages) == set(TIE_NAMES), f"rank {rank}: ran {sorted(messages)}"
        for case, message in messages.items():
            assert message is not None, f"rank {rank}, {case}: fully_shard must raise ValueError for a parameter " \
                                        "another unit already flattened (a tie across units)"
            names = TIE_NAMES[case]
            assert all(n in message for n in names), \
                f"rank {rank}, {case}: the ValueError must name both units ({' and '.join(names)}); got: {message}"
