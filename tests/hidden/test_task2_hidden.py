"""Task 2 (hidden): padding and shard boundaries in the corner cases: W divides numel, W exceeds numel (whole
shards of padding), a tied weight across shard boundaries, a rank outside [0, W); shard_range for every
parameter. Task 1's meta-device init of sharded units (it needs FlatParameters) replays the RNG exactly, keeps
frozen shards frozen and materializes modules that own only buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.public.common import check_flat_params, expected_shard
from tests.hidden.scenarios.task2 import (  # what the ranks run
    MODELS,
    MODULES,
    WORLD_SIZES,
    _layouts,
    _materialize,
)

pytestmark = pytest.mark.task2


def _expected_range(offset: int, numel: int, shard_offset: int, shard_numel: int) -> list[int]:
    lo, hi = max(offset, shard_offset), min(offset + numel, shard_offset + shard_numel)
    return [lo - offset, hi - offset, lo - shard_offset] if hi > lo else None


@pytest.mark.weight(3)
def test_padding_edge_cases():
    (layouts,) = run_ranks(_layouts, 1)
    for d in [d for d in layouts if d["module"] == "<rank outside [0, W)>"]:
        assert d["error"] is not None, (
            f"a FlatParameter built with rank={d['r']} and world_size=2 was accepted; a rank outside [0, world_size) "
            f"must raise ValueError (a negative rank would otherwise select a shard by Python's negative indexing)")
    layouts = [d for d in layouts if d["module"] != "<rank outside [0, W)>"]
    for name, make in MODULES.items():
        module = make()
        unique = dict(module.named_parameters())  # tied weights once, in registration order
        aliases = {n: next(u for u, q in unique.items() if q is p)
                   for n, p in module.named_parameters(remove_duplicate=False)}
        flat = torch.cat([p.detach().reshape(-1) for p in unique.values()])
        for w in WORLD_SIZES:
            shards = sorted((d for d in layouts if d["module"] == name and d["W"] == w), key=lambda d: d["r"])
            padded = -(-flat.numel() // w) * w
            where = f"{name} ({flat.numel()} elements) with W={w}"
            for d in shards:
                assert d["numel"] == flat.numel(), f"{where}: numel {d['numel']}, expected {flat.numel()}"
                assert d["padded_numel"] == padded, (
                    f"{where}: padded_numel {d['padded_numel']}, expected {padded} (the smallest multiple of W "
                    f"that holds numel: no padding when W divides numel)")
                assert (d["shard_numel"], d["shard_offset"]) == (padded // w, d["r"] * (padded // w)), \
                    f"{where}, rank {d['r']}: shard_numel/shard_offset {d['shard_numel']}/{d['shard_offset']}"
                assert sorted(d["param_names"]) == sorted(unique), \
                    f"{where}: param_names {d['param_names']} (a tied weight is listed once)"
            joined = torch.cat([d["shard"] for d in shards])
            assert torch.equal(joined, F.pad(flat, (0, padded - flat.numel()))), \
                f"{where}: the shards in rank order must be the flattened parameters and zero padding"
            offsets, at = {}, 0
            for u, p in unique.items():
                offsets[u] = (at, p.numel())
                at += p.numel()
            for d in shards:
                for n, got in d["ranges"].items():
                    off, numel = offsets[aliases[n]]
                    expected = _expected_range(off, numel, d["shard_offset"], d["shard_numel"])
                    if expected is None:
                        assert got[0] == got[1], f"{where}, rank {d['r']}: shard_range({n!r}) must be empty"
                    else:
                        assert got == expected, (f"{where}, rank {d['r']}: shard_range({n!r}) = {tuple(got)}, "
                                                 f"expected {tuple(expected)} (start, end in the parameter; "
                                                 f"where that piece starts in the shard)")


# ---- meta-device init of sharded units (Task 1's materialize_meta_module over Task 2's FlatParameters) ----


# The same units by name, for the parent's own model (children first, the root "" last).
UNIT_PREFIXES = {
    "nested_toy": [p for i in range(3) for p in (f"blocks.{i}.inner.", f"blocks.{i}.")] + [""],
    "tied_middle": ["mix.", ""],
    "buffer_only": ["out.", ""],
}


@pytest.mark.weight(3)
def test_sharded_meta_init_replays_the_rng_exactly():
    """Task 1's materialize_meta_module on units made of Task 2's FlatParameters (needs Tasks 1 and 2)."""
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
            # Not only values: frozen shards (ToyMLP's gates) stay frozen, decided from the parent's own model.
            check_flat_params(got["flat"], eager, UNIT_PREFIXES[name], f"{name}, rank {rank}, after materialize")
            assert set(got["buffers"]) == {k for k, _ in eager.named_buffers()}, \
                f"{name}, rank {rank}: buffers {sorted(got['buffers'])} after materialize"
            for desc in got["flat"]:
                assert torch.equal(desc["shard"], expected_shard(desc, full)), (
                    f"{name}, rank {rank}: the shard of unit '{desc['prefix'] or '<root>'}' differs from eager "
                    f"init under the same seed: values must equal eager init's, tied weights' later owners included "
                    f"(they consumed random numbers in eager init too; Task 1's contract, hints/task1/01-replay-order)")
            for k, v in eager.named_buffers():
                assert torch.equal(got["buffers"][k], v), f"{name}, rank {rank}: buffer {k} differs from eager init"
            assert torch.equal(got["after"], after), (
                f"{name}, rank {rank}: the random generator ends in another state than after eager init: the "
                f"replay consumed a different amount of random numbers")
