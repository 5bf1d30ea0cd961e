"""Task 1 (hidden): meta-device init of sharded units replays the RNG exactly; a module without
reset_parameters() is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adapters
from fsdp_assignment.support.models import ToyMLP
from tests.harness import run_ranks
from tests.public.common import describe_flat_params, expected_shard, hand_shard

pytestmark = pytest.mark.task1


class TiedMiddle(nn.Module):
    """A tied weight whose later owner (``proj``) sits in the middle of the init order: the numbers its eager
    init consumed decide the values of every module after it."""

    def __init__(self, vocab: int = 17, dim: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab, bias=False)
        self.proj.weight = self.embed.weight
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 5)

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.embed(idx))))


def _nested_toy_units(model):
    return [m for b in model.blocks for m in (b.inner, b)] + [model]


MODELS = {
    # inside-out: each block's inner Sequential is a unit, then the block, then the root
    "nested_toy": (lambda: ToyMLP(with_unused=True), _nested_toy_units),
    "tied_middle": (TiedMiddle, lambda m: [m.mix, m]),
}


def _materialize(rank, world_size, seed):
    out = {}
    for name, (make, units) in MODELS.items():
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = make()
        hand_shard(model, units(model), backward=False)
        adapters.materialize_meta_module(model, "cpu")
        after = torch.rand(4)  # where the generator ended
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        out[name] = {"flat": describe_flat_params(model), "after": after, "buffers": buffers,
                     "meta_left": [n for n, t in model.state_dict().items() if t.is_meta]}
    return out


@pytest.mark.weight(3)
def test_sharded_meta_init_replays_the_rng_exactly():
    world_size, seed = 3, 4321
    results = run_ranks(_materialize, world_size, seed)
    for name, (make, _) in MODELS.items():
        torch.manual_seed(seed)
        eager = make()
        after = torch.rand(4)
        full = {n: p for n, p in eager.named_parameters(remove_duplicate=False)}
        for rank, got in enumerate(results):
            got = got[name]
            assert not got["meta_left"], f"{name}, rank {rank}: still on meta after materialize: {got['meta_left']}"
            for desc in got["flat"]:
                assert torch.equal(desc["shard"], expected_shard(desc, full)), (
                    f"{name}, rank {rank}: the shard of unit '{desc['prefix'] or '<root>'}' differs from eager "
                    f"init under the same seed: replay every module's reset_parameters() in module pre-order, "
                    f"tied weights' later owners included (they consumed random numbers in eager init too)")
            for k, v in eager.named_buffers():
                assert torch.equal(got["buffers"][k], v), f"{name}, rank {rank}: buffer {k} differs from eager init"
            assert torch.equal(got["after"], after), (
                f"{name}, rank {rank}: the random generator ends in another state than after eager init: the "
                f"replay consumed a different amount of random numbers")


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


class HasNoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.odd = NoReset()


def _no_reset(rank, world_size):
    with torch.device("meta"):
        model = HasNoReset()
    try:
        adapters.materialize_meta_module(model, "cpu")
    except TypeError as e:
        return {"raised": "TypeError", "message": str(e)}
    return {"raised": None, "message": ""}


def test_module_without_reset_parameters_is_rejected():
    (got,) = run_ranks(_no_reset, 1)
    assert got["raised"] == "TypeError", \
        "a module that owns meta parameters but defines no reset_parameters() must raise TypeError"
    assert "NoReset" in got["message"] or "odd" in got["message"], \
        f"the TypeError must name the module (its class or its name); got {got['message']!r}"
