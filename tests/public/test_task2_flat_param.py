"""Task 2: FlatParameter (flatten, pad, shard, views, free)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adapters
from fsdp_assignment.support.memory import LiveStorageTracker
from fsdp_assignment.support.models import GPT, GPTConfig, TiedModel, ToyMLP
from tests.harness import run_ranks
from tests.public.common import check_flat_params, describe_flat_params, expected_shard, hand_shard_gpt, witness_for

pytestmark = pytest.mark.task2


def _block():
    torch.manual_seed(0)
    return ToyMLP().blocks[0]


def _attr(module, name):
    """The tensor a module attribute holds now, by dotted name (views are plain attributes, not parameters)."""
    path, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(path), attr)


def _trainable_names(module):
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _layouts(rank, world_size):
    """Every (W, r) for W = 1..4 in one process: Task 2 needs no communication."""
    out = []
    for w in range(1, 5):
        for r in range(w):
            block = _block()
            names = _trainable_names(block)
            fp = adapters.make_flat_param(block, names, r, w)
            out.append({"W": w, "r": r, "numel": fp.numel, "padded_numel": fp.padded_numel,
                        "shard_numel": fp.shard_numel, "shard_offset": fp.shard_offset,
                        "shard": fp.shard.detach().clone(), "is_param": isinstance(fp.shard, torch.nn.Parameter),
                        "names": list(fp.param_names), "storage": fp.unsharded.untyped_storage().size(),
                        "left_in_module": [n for n, _ in block.named_parameters() if n in names]})
    return out


def test_shard_boundaries_and_padding_for_every_world_size():
    (layouts,) = run_ranks(_layouts, 1)
    block = _block()
    names = _trainable_names(block)
    flat = torch.cat([block.get_parameter(n).detach().reshape(-1) for n in names])
    for w in range(1, 5):
        shards = [d for d in layouts if d["W"] == w]
        d0 = shards[0]
        padded = -(-flat.numel() // w) * w
        assert d0["numel"] == flat.numel(), f"W={w}: numel {d0['numel']}, expected {flat.numel()}"
        assert d0["padded_numel"] == padded, f"W={w}: padded_numel {d0['padded_numel']}, expected {padded}"
        for d in shards:
            assert d["is_param"], "FlatParameter.shard must be an nn.Parameter (the optimizer steps it)"
            assert d["shard_numel"] == padded // w and d["shard_offset"] == d["r"] * (padded // w), \
                f"W={w} r={d['r']}: shard_numel/shard_offset wrong"
            assert d["storage"] == 0, f"W={w} r={d['r']}: a new FlatParameter must start sharded (storage size 0)"
            assert d["left_in_module"] == [], \
                f"W={w}: original parameters still registered on the module: {d['left_in_module']}"
        joined = torch.cat([d["shard"] for d in shards])
        assert torch.equal(joined, F.pad(flat, (0, padded - flat.numel()))), \
            f"W={w}: the shards, concatenated in rank order, must be the flattened parameters plus zero padding"


def _views_and_free(rank, world_size):
    block = _block()
    names = _trainable_names(block)
    fp = adapters.make_flat_param(block, names, 1, 3)
    fp.alloc_unsharded()
    allocated = fp.unsharded.untyped_storage().size()
    with torch.no_grad():
        fp.unsharded.data.copy_(torch.arange(fp.padded_numel, dtype=fp.unsharded.dtype))
    views = fp.unsharded_views()
    base = fp.unsharded.untyped_storage().data_ptr()
    aliases = [v.untyped_storage().data_ptr() == base for v in views]
    fp.use_unsharded_views()
    attrs = {n: _attr(block, n).detach().clone() for n in names}
    is_unsharded_before = fp.is_unsharded()
    views = [v.detach().clone() for v in views]  # before the free: afterwards they point at no memory
    fp.free_unsharded()
    return {"allocated": allocated, "itemsize": fp.unsharded.element_size(), "padded_numel": fp.padded_numel,
            "views": views, "aliases": aliases, "attrs": attrs,
            "shapes": [list(s) for s in fp.shapes], "names": list(fp.param_names),
            "offsets": list(fp.param_offsets), "before": is_unsharded_before, "after": fp.is_unsharded(),
            "freed": fp.unsharded.untyped_storage().size()}


@pytest.mark.evidence("memory")
def test_views_alias_the_flat_buffer_and_free_releases_storage():
    # One block built, its shard and one unsharded buffer; nothing sent (one rank).
    witness = witness_for(_block, [""], 1, shard_copies=1, unsharded=1, full_grads=0)
    (got,) = run_ranks(_views_and_free, 1, witness=witness)
    assert got["allocated"] == got["padded_numel"] * got["itemsize"], "alloc_unsharded must allocate padded_numel elements"
    block = _block()
    assert got["names"] == _trainable_names(block), \
        f"param_names {got['names']}: expected the parameters given to the constructor, in order"
    assert len(got["views"]) == len(got["names"]) == len(got["aliases"]), \
        "unsharded_views() must return one view per parameter"
    assert all(got["aliases"]), "unsharded_views() must be views of `unsharded` (same storage), not copies"
    offset = 0
    for name, shape, view in zip(got["names"], got["shapes"], got["views"]):
        n = int(torch.tensor(shape).prod()) if shape else 1
        expected = torch.arange(offset, offset + n, dtype=view.dtype).view(shape)
        assert torch.equal(view, expected), f"view of {name} does not cover elements [{offset}, {offset + n})"
        assert torch.equal(got["attrs"][name], expected), f"use_unsharded_views(): module attribute {name} is not its view"
        offset += n
    assert got["before"] and not got["after"], "is_unsharded() must follow alloc_unsharded()/free_unsharded()"
    assert got["freed"] == 0, "free_unsharded() must resize the storage to 0 bytes (really freeing it)"


def _tied(rank, world_size):
    torch.manual_seed(0)
    model = TiedModel()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    fp = adapters.make_flat_param(model, names, 0, 2)
    fp.alloc_unsharded()
    fp.use_unsharded_views()
    same = model.head.weight.untyped_storage().data_ptr() == model.embed.weight.untyped_storage().data_ptr() \
        and model.head.weight.storage_offset() == model.embed.weight.storage_offset()
    return {"numel": fp.numel, "names": list(fp.param_names), "same": same,
            "expected_numel": sum(p.numel() for p in TiedModel().parameters())}


def test_tied_parameters_are_stored_once():
    (got,) = run_ranks(_tied, 1)
    assert got["numel"] == got["expected_numel"], f"numel {got['numel']}: a tied weight must be flattened once"
    assert not ("embed.weight" in got["names"] and "head.weight" in got["names"]), \
        "param_names must list a tied parameter once"
    assert got["same"], "both names of a tied parameter must be the same view"


def _mixed_requires_grad(rank, world_size):
    block = _block()
    try:
        adapters.make_flat_param(block, [n for n, _ in block.named_parameters()], 0, 1)
    except ValueError as e:
        return str(e)
    return None


def test_mixed_requires_grad_is_rejected():
    (message,) = run_ranks(_mixed_requires_grad, 1)
    assert message is not None, "a FlatParameter over trainable and frozen parameters must raise ValueError"


def _meta(rank, world_size):
    with torch.device("meta"):
        block = ToyMLP().blocks[0]
    fp = adapters.make_flat_param(block, _trainable_names(block), 1, 2)
    return {"meta": fp.shard.is_meta, "numel": fp.shard_numel}


def test_meta_parameters_give_a_meta_shard():
    (got,) = run_ranks(_meta, 1)
    assert got["meta"], "a FlatParameter over meta parameters must keep its shard on meta (Task 1 materializes it)"


# ---- meta-device init of sharded units (Task 1's materialize_meta_module over Task 2's FlatParameters) ----
def _materialize_sharded(rank, world_size, seed):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(GPTConfig())
    hand_shard_gpt(model, hooks=None)  # FlatParameters only (Task 2)
    unit_full_bytes = [4 * sum(fp.padded_numel for fp in m._fsdp_unit.flat_params) for m in [*model.blocks, model]]
    with LiveStorageTracker(device="cpu") as mem:
        adapters.materialize_meta_module(model, "cpu")
    shard_bytes = sum(4 * d["shard_numel"] for d in describe_flat_params(model))
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "_fsdp_flat_param" not in k}
    return {"flat": describe_flat_params(model), "peak": mem.peak_bytes, "shard_bytes": shard_bytes,
            "max_unit_bytes": max(unit_full_bytes), "buffers": buffers}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_meta_init_matches_eager_init_one_unit_at_a_time(world_size):
    """Task 1's materialize_meta_module on units made of Task 2's FlatParameters (needs Tasks 1 and 2)."""
    results = run_ranks(_materialize_sharded, world_size, 99)
    torch.manual_seed(99)
    eager = GPT(GPTConfig())
    full = {n: p for n, p in eager.named_parameters(remove_duplicate=False)}
    units = [f"blocks.{i}." for i in range(eager.cfg.n_layer)] + [""]  # hand_shard_gpt: blocks, then the root
    for rank, got in enumerate(results):
        check_flat_params(got["flat"], eager, units, f"rank {rank}")  # every unit there, owning what it should
        for desc in got["flat"]:
            assert torch.equal(desc["shard"], expected_shard(desc, full)), \
                f"rank {rank}: shard of unit '{desc['prefix'] or '<root>'}' differs from eager init"
        # Shards stay; on top of them, at most one unit's full parameters may be alive at any moment.
        bound = got["shard_bytes"] + got["max_unit_bytes"]
        assert got["peak"] <= bound, (
            f"rank {rank}: peak {got['peak']} bytes during materialization > shards ({got['shard_bytes']}) + "
            f"the largest unit's padded full parameters ({got['max_unit_bytes']}): at most one unit's "
            "full parameters may be alive at a time, besides the shards (Task 1's contract; hints/task1/)")


# ---- Through meta-device init a frozen shard stays frozen, an fp64 one fp64, and the RNG ends where eager init left it
def _materialize_frozen(rank, world_size):
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2))
    for p in [*model.wte.parameters(), *model.wpe.parameters(), *model.blocks[0].parameters()]:
        p.requires_grad_(False)  # the root's embeddings (tied to lm_head) and all of block 0 frozen
    hand_shard_gpt(model, hooks=None)  # FlatParameters only: a trainable and a frozen one per unit where both occur
    adapters.materialize_meta_module(model, "cpu")
    after = torch.rand(4)  # the generator must end where eager init left it (a tied weight's later owner included)
    registered = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.device("meta"):
        wide = GPT(GPTConfig(n_layer=2)).to(torch.float64)  # built on meta in fp64; the default dtype stays fp32
    hand_shard_gpt(wide, hooks=None)
    adapters.materialize_meta_module(wide, "cpu")
    wide_dtypes = {n: str(p.dtype) for n, p in wide.named_parameters()}
    return {"flat": describe_flat_params(model), "registered": registered, "fp64_dtypes": wide_dtypes, "after": after}


def test_sharded_meta_init_keeps_each_shards_requires_grad_and_dtype():
    """Task 1's materialize_meta_module on units with frozen FlatParameters (needs Tasks 1 and 2)."""
    torch.manual_seed(5)
    eager = GPT(GPTConfig(n_layer=2))
    after = torch.rand(4)
    full = {n: p for n, p in eager.named_parameters(remove_duplicate=False)}
    frozen = {n for n in full if n.startswith(("wte.", "wpe.", "lm_head.", "blocks.0."))}
    for rank, got in enumerate(run_ranks(_materialize_frozen, 2)):
        assert any(d["prefix"] + n in frozen for d in got["flat"] for n in d["param_names"]), \
            f"rank {rank}: no FlatParameter holds the frozen parameters"
        for desc in got["flat"]:
            names = [desc["prefix"] + n for n in desc["param_names"]]
            should = not any(n in frozen for n in names)
            assert desc["requires_grad"] == should, (
                f"rank {rank}: after materialize_meta_module the shard of unit '{desc['prefix'] or '<root>'}' over "
                f"{names[:3]}... has requires_grad={desc['requires_grad']}; its parameters are "
                f"{'trainable' if should else 'frozen'}: a materialized shard keeps its FlatParameter's "
                f"requires_grad (Task 1: frozen stays frozen), or the optimizer trains what the user froze")
            assert torch.equal(desc["shard"], expected_shard(desc, full)), \
                f"rank {rank}: shard of unit '{desc['prefix'] or '<root>'}' differs from eager init"
        wrong = {n: rg for n, rg in got["registered"].items() if rg != ("frozen" not in n.rpartition(".")[2])}
        assert not wrong, (
            f"rank {rank}: parameters registered on the modules after materialize_meta_module with the wrong "
            f"requires_grad: {wrong} (a frozen FlatParameter's shard is registered as _fsdp_flat_param_frozen)")
        assert torch.equal(got["after"], after), (
            f"rank {rank}: after materialize_meta_module of the sharded GPT the random generator is in another state "
            f"than after eager init: every owner's init consumes random numbers, a tied weight's later owner "
            f"(lm_head, tied to wte) included, although the tied weight keeps its first initializer's value")
        not_fp64 = {n: d for n, d in got["fp64_dtypes"].items() if d != "torch.float64"}
        assert not not_fp64, (
            f"rank {rank}: a GPT built on meta in fp64 and sharded comes back with shards of other dtypes: "
            f"{not_fp64}: a materialized shard keeps its FlatParameter's dtype (Task 1: dtypes stay)")
