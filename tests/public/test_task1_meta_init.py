"""Task 1: meta-device init (materialize_meta_module)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, GPTConfig, TiedModel, ToyMLP
from tests.harness import run_ranks
from tests.public.common import describe_flat_params, expected_shard, hand_shard_gpt

pytestmark = pytest.mark.task1

MODELS = {"toy_mlp": lambda: ToyMLP(with_unused=True), "tied": TiedModel, "gpt": GPT}


def _materialize_unsharded(rank, world_size, model_name, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = MODELS[model_name]()
    adapters.materialize_meta_module(model, "cpu")
    after = torch.rand(4)  # the generator must end where eager init left it
    tied = model_name == "gpt" and model.lm_head.weight is model.wte.weight
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "after": after, "tied": tied,
            "meta_left": [n for n, t in model.state_dict().items() if t.is_meta]}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_unsharded_module_matches_eager_init_bitwise(model_name):
    (got,) = run_ranks(_materialize_unsharded, 1, model_name, 1234)
    torch.manual_seed(1234)
    eager = MODELS[model_name]()
    after = torch.rand(4)
    assert not got["meta_left"], f"still on meta after materialize_meta_module: {got['meta_left']}"
    expected = eager.state_dict()
    assert got["state"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got["state"][name], tensor), \
            f"{name} differs from eager init under the same seed (the RNG must be consumed in eager order)"
    assert torch.equal(got["after"], after), "the random generator ends in a different state than after eager init"
    if model_name == "gpt":
        assert got["tied"], "lm_head.weight and wte.weight must stay one tied parameter"


def _materialize_sharded(rank, world_size, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(GPTConfig())
    hand_shard_gpt(model, backward=False)
    unit_full_bytes = [4 * sum(fp.padded_numel for fp in m._fsdp_unit.flat_params) for m in [*model.blocks, model]]
    with LiveStorageTracker(device="cpu") as mem:
        adapters.materialize_meta_module(model, "cpu")
    shard_bytes = sum(4 * d["shard_numel"] for d in describe_flat_params(model))
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "_fsdp_flat_param" not in k}
    return {"flat": describe_flat_params(model), "peak": mem.peak_bytes, "shard_bytes": shard_bytes,
            "max_unit_bytes": max(unit_full_bytes), "buffers": buffers}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_units_match_eager_init_one_unit_at_a_time(world_size):
    results = run_ranks(_materialize_sharded, world_size, 99)
    torch.manual_seed(99)
    eager = GPT(GPTConfig())
    full = {n: p for n, p in eager.named_parameters(remove_duplicate=False)}
    for rank, got in enumerate(results):
        for desc in got["flat"]:
            assert torch.equal(desc["shard"], expected_shard(desc, full)), \
                f"rank {rank}: shard of unit '{desc['prefix'] or '<root>'}' differs from eager init"
        # Shards stay; on top of them, at most one unit's full parameters may be alive at any moment.
        bound = got["shard_bytes"] + got["max_unit_bytes"]
        assert got["peak"] <= bound, (
            f"rank {rank}: peak {got['peak']} bytes during materialization > shards ({got['shard_bytes']}) + "
            f"the largest unit's padded full parameters ({got['max_unit_bytes']}): materialize unit by unit, "
            "copy each slice into the shard and drop the full tensor")
