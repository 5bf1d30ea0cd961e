"""Task 5: sharded optimizer, global-norm clipping, full and sharded checkpoints with resume."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, TiedModel, ToyMLP, gpt_batch, gpt_loss
from tests.harness import Witness, run_ranks
from tests.public.collectives import use_counted_collectives
from tests.public.invariants import check_monitor
from tests.public.monitor import Monitor
from tests.public.common import WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, witness_for
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard, full_params_of,
                                 gpt_sharded_block_by_block, hand_shard, hand_shard_gpt, local_batch,
                                 train_single_process)

pytestmark = pytest.mark.task5

CFG = GPTConfig()
GPT_UNITS = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]  # hand_shard_gpt: the blocks, then the root
# Adam's first step is lr * g / (|g| + eps): for a gradient that is zero in exact arithmetic (the attention
# key bias) it amplifies rounding noise to a full +-lr step, on any two implementations. An eps above that
# noise (about 4e-9 here) keeps the comparison about FSDP, not about the sign of rounding noise.
ADAM_EPS = 1e-4


def _sharded_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    hand_shard_gpt(model)
    return model


def _train(model, optim, rank, world_size, steps, mon=None):
    for step in steps:
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        loss = gpt_loss(model, idx, tgt)
        mon.backward(loss) if mon else loss.backward()
        optim.step()
        if mon:
            mon.after_step()


def _optimizer_state(rank, world_size):
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = GPT(CFG)
    mon = Monitor(model, GPT_UNITS, log)  # the invariant monitor (tests/public/monitor.py)
    hand_shard_gpt(model)
    mon.attach()
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2, eps=ADAM_EPS)
    _train(model, optim, rank, world_size, range(1), mon)
    state_numel = sum(t.numel() for s in optim.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"state_numel": state_numel, "full": adapters.get_model_state_dict(model, full=True),
            "monitor": mon.report()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.evidence("bytes", "memory")
def test_optimizer_state_is_sharded_and_one_adamw_step_matches(world_size):
    # One AdamW step (two states on the shards) and a full state dict gathered on rank 0 (up to a whole model there).
    witness = witness_for(lambda: GPT(CFG), GPT_UNITS, world_size, models=2,
                          overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
                          moved=3 + 1)
    results = run_ranks(_optimizer_state, world_size, witness=witness)
    expected = train_single_process(CFG, world_size, 1, torch.optim.AdamW, lr=1e-2, eps=ADAM_EPS)
    trainable = sum(p.numel() for p in expected.parameters() if p.requires_grad)
    for rank, got in enumerate(results):
        check_monitor(got["monitor"], expected, world_size, f"rank {rank}")
        target = 2 * trainable / world_size  # AdamW keeps exp_avg and exp_avg_sq
        assert abs(got["state_numel"] - target) <= 0.01 * target, \
            f"rank {rank}: optimizer state holds {got['state_numel']} elements, expected about {target:.0f} (1/W)"
    full = results[0]["full"]
    assert all(r["full"] == {} for r in results[1:]), "a full state dict lives on rank 0 only"
    for name, p in full_params_of(expected).items():
        assert_close(full[name], p, f"{name} after one AdamW step")


def _clip(rank, world_size, max_norm):
    model = _sharded_model()
    idx, tgt = local_batch(CFG, rank, world_size, 0)
    gpt_loss(model, idx, tgt).backward()
    norm = adapters.clip_grad_norm_(model, max_norm)
    return {"norm": norm.detach().clone(), "flat": describe_flat_params(model, grads=True)}


def single_process_clip(world_size, max_norm):
    """torch.nn.utils.clip_grad_norm_ on the unsharded model and the global batch: (norm, clipped grads by name)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = gpt_batch(CFG, 2 * world_size, seed=0)
    gpt_loss(model, idx, tgt).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def test_clip_grad_norm_uses_the_global_norm():
    world_size, max_norm = 3, 0.05
    results = run_ranks(_clip, world_size, max_norm)
    norm, grads = single_process_clip(world_size, max_norm)
    assert norm > max_norm, "test set-up: the norm must exceed max_norm so clipping happens"
    for rank, got in enumerate(results):
        assert_close(got["norm"], norm, f"rank {rank}: returned norm (must be the global norm over all ranks)")
        check_flat_params(got["flat"], GPT(CFG), GPT_UNITS, f"rank {rank}")
        for desc in got["flat"]:
            assert_close(desc["grad"], expected_shard(desc, grads), f"rank {rank}: clipped gradient shard")


def _checkpoint(rank, world_size):
    # Uninterrupted: 4 steps.
    model = _sharded_model()
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    _train(model, optim, rank, world_size, range(2))
    saved = {kind: (adapters.get_model_state_dict(model, full=kind == "full"),
                    adapters.get_optimizer_state_dict(model, optim, full=kind == "full"))
             for kind in ("full", "sharded")}
    _train(model, optim, rank, world_size, range(2, 4))
    uninterrupted = [fp.shard.detach().clone() for _, fp in _named(model)]
    # Full checkpoints are made on rank 0; every rank loads the same dict.
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)
    saved["full"] = box[0]
    resumed = {}
    hyper = {}
    for kind in ("full", "sharded"):
        # Another init and other hyperparameters: everything must come from the checkpoint, as with
        # torch.optim's own load_state_dict (param_groups' lr and weight_decay included).
        model = _sharded_model(seed=1)
        optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=0.5, weight_decay=0.0)
        adapters.set_model_state_dict(model, saved[kind][0], full=kind == "full")
        adapters.set_optimizer_state_dict(model, optim, saved[kind][1], full=kind == "full")
        hyper[kind] = [(float(g["lr"]), float(g["weight_decay"])) for g in optim.param_groups]
        _train(model, optim, rank, world_size, range(2, 4))
        resumed[kind] = [fp.shard.detach().clone() for _, fp in _named(model)]
    plain_keys_ok = None
    if rank == 0:
        plain = GPT(CFG)
        missing, unexpected = plain.load_state_dict(saved["full"][0], strict=False)
        plain_keys_ok = [*missing, *unexpected]
    return {"uninterrupted": uninterrupted, "resumed": resumed, "plain": plain_keys_ok, "hyper": hyper,
            "full_keys": sorted(saved["full"][1]["state"]) if saved["full"][1] else []}


def _named(model):
    from fsdp_assignment.support.state import named_flat_params
    return list(named_flat_params(model))


def test_resume_from_full_and_sharded_checkpoints_equals_no_interruption():
    results = run_ranks(_checkpoint, 2, timeout=90)
    for rank, got in enumerate(results):
        for kind in ("full", "sharded"):
            assert got["hyper"][kind] and set(got["hyper"][kind]) == {(1e-2, 0.1)}, (
                f"rank {rank}: after loading a {kind} optimizer checkpoint into an optimizer made with lr=0.5, "
                f"weight_decay=0, its param_groups have (lr, weight_decay) {got['hyper'][kind]}; the checkpoint's "
                f"(1e-2, 0.1) must be restored, as torch.optim.Optimizer.load_state_dict does")
            assert len(got["uninterrupted"]) == len(got["resumed"][kind]) == len(GPT_UNITS), \
                f"rank {rank}: expected one FlatParameter per unit"
            for a, b in zip(got["uninterrupted"], got["resumed"][kind]):
                assert torch.equal(a, b), f"rank {rank}: resuming from a {kind} checkpoint differs from never stopping"
    assert results[0]["plain"] == [], \
        f"the full model state dict must load into a plain GPT (strict); mismatched keys: {results[0]['plain']}"
    names = {n for n, _ in GPT(CFG).named_parameters()}
    assert set(results[0]["full_keys"]) == names, "full optimizer state must be keyed by original parameter names"


def test_clip_grad_norm_never_scales_gradients_up():
    # Below max_norm clipping changes nothing (torch's coefficient is capped at 1), and the norm is still global.
    world_size, max_norm = 2, 1e3
    results = run_ranks(_clip, world_size, max_norm)
    norm, grads = single_process_clip(world_size, max_norm)
    assert norm < max_norm, "test set-up: the norm must be below max_norm"
    for rank, got in enumerate(results):
        assert_close(got["norm"], norm, f"rank {rank}: returned norm (the global norm over all ranks)")
        for desc in got["flat"]:
            assert_close(desc["grad"], expected_shard(desc, grads), (
                f"rank {rank}: gradient shard of unit '{desc['prefix'] or '<root>'}' after clip_grad_norm_ with the "
                f"norm ({float(norm):.3g}) below max_norm ({max_norm:g}): clipping never scales a gradient up"))


TIED_UNITS = ["layers.0.", "layers.1.", ""]  # TiedModel's layers, then the root (embed and head share its weight)


def _tied_model_with_buffers() -> TiedModel:
    """TiedModel (head.weight IS embed.weight) with an integer and a boolean buffer: state dicts keep every buffer,
    whatever its dtype, as nn.Module.state_dict() does."""
    torch.manual_seed(0)
    model = TiedModel()
    model.register_buffer("steps", torch.tensor(3))
    model.layers[1].register_buffer("mask", torch.arange(11) % 3 == 0)
    return model


def _tied_sharded_state(rank, world_size):
    model = _tied_model_with_buffers()
    hand_shard(model, [model.layers[0], model.layers[1], model])
    return {kind: adapters.get_model_state_dict(model, full=kind == "full") for kind in ("sharded", "full")}


def test_state_dicts_name_tied_weights_and_buffers_as_their_formats_say():
    # Sharded: a tied parameter once, under its kept name (the first); full: under both. Both: every buffer.
    world_size = 2
    results = run_ranks(_tied_sharded_state, world_size)
    model = _tied_model_with_buffers()
    kept = dict(model.named_parameters())  # one name per parameter: the first
    every = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    for rank, got in enumerate(results):
        keys = sorted(got["sharded"])
        assert keys == sorted([*kept, *buffers]), (
            f"rank {rank}: the sharded model state dict of TiedModel has keys {keys}; expected {sorted(kept)} and "
            f"the buffers {sorted(buffers)}: a tied parameter once, under its kept name (the first of its names), "
            f"as the module docstring's format says")
    for name, p in kept.items():  # the ranks' pieces, in rank order, are the whole parameter
        pieces = torch.cat([got["sharded"][name].reshape(-1) for got in results])
        assert_close(pieces, p.detach().reshape(-1), f"{name}: the sharded state dict's pieces of all ranks, in order")
    full = results[0]["full"]
    assert sorted(full) == sorted([*every, *buffers]), (
        f"rank 0: the full model state dict has keys {sorted(full)}; expected every name of every parameter, tied "
        f"ones under each of their names: {sorted(every)}, and every buffer, whatever its dtype: {sorted(buffers)}")
    for name, b in buffers.items():
        assert full[name].dtype == b.dtype and torch.equal(full[name], b), \
            f"rank 0: buffer {name} in the full model state dict: {full[name]!r}, expected {b!r}"
    assert all(got["full"] == {} for got in results[1:]), "a full state dict lives on rank 0 only"


# ---- A full state dict on rank 0 only, also while it is made: the kernel's count of each rank's peak -------------
# 24 blocks of about 0.5 M parameters (12.5 M in all, 48 MiB in fp32): the whole model's state stands far above
# what a rank's resident memory varies by from run to run (measured: up to 16 MiB, gloo's threads and glibc's
# arenas), and one unit's state (what a rank other than 0 may hold for a moment while it takes part in the
# gathers) far below it.
RANK0_CFG = GPTConfig(n_layer=24, n_embd=208, n_head=4)


def _save_full_checkpoint(rank, world_size):
    # Built and sharded block by block (the full model never exists in the rank), one AdamW step, then a full
    # checkpoint saved the usual way: both state dicts made and kept together. The step's gradients are set, not
    # computed: a backward's transient memory, freed, would be reused by rank 0's dicts and blur the comparison.
    model = gpt_sharded_block_by_block(RANK0_CFG, lambda module: hand_shard(module, [module]))
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    saved = (adapters.get_model_state_dict(model, full=True),
             adapters.get_optimizer_state_dict(model, optim, full=True))
    return {"model": len(saved[0]), "optim": len(saved[1].get("state", {})) if saved[1] else 0}


def test_full_state_dicts_live_on_rank_0_only_also_while_they_are_made():
    # The peaks are the kernel's (the witness reads each rank's VmHWM from the parent), not what a rank reports.
    world_size = 2
    witness = Witness()  # no bound of its own: the ranks' peaks are compared with each other below
    # Rank 0 holds about 280 MiB at its peak (its shards, gradients and AdamW state, then both full dicts).
    results = run_ranks(_save_full_checkpoint, world_size, witness=witness, memory_limit_bytes=640 << 20)
    with torch.device("meta"):
        model = GPT(RANK0_CFG)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())  # fp32, tied weights once
    optim_bytes = 2 * model_bytes  # AdamW's exp_avg and exp_avg_sq
    assert results[0]["model"] and results[0]["optim"], "rank 0 must return the full state dicts (model, optimizer)"
    assert all(got == {"model": 0, "optim": 0} for got in results[1:]), "a full state dict lives on rank 0 only"
    peaks = [m["peak_bytes"] for m in witness.measured]
    for rank in range(1, world_size):
        # Rank 0 holds both full dicts at once (model + optimizer: 3 models' bytes, 144 MiB); a rank that held the
        # full optimizer state for a moment peaks only about one model's bytes below rank 0. Measured (load 7): the
        # staff's implementation 126-134 MiB below rank 0's peak, the full optimizer state built on every rank (mutant g14)
        # 48 MiB. The bound, 1.75 models' bytes (84 MiB), leaves both more than twice what a rank's peak varies by
        # from run to run (16 MiB), so that load can push neither across it. (The full model state alone built on
        # every rank, mutant g15, peaks 96 MiB below: too close to a correct one's to judge here without a model
        # twice this size; the hidden tests judge it.)
        below = peaks[0] - peaks[rank]
        assert below >= model_bytes + 3 * model_bytes // 4, (
            f"rank {rank}: the kernel saw its resident memory peak {below / 2**20:.1f} MiB below rank 0's "
            f"({peaks[rank] / 2**20:.1f} vs {peaks[0] / 2**20:.1f} MiB above their start), while rank 0 holds the "
            f"full model ({model_bytes / 2**20:.1f} MiB) and optimizer ({optim_bytes / 2**20:.1f} MiB) state dicts: "
            f"a full state dict exists on rank 0 only, and the other ranks must not hold it while it is made either "
            f"(take part in the gathers, keep nothing: about one unit's state at a time)")


# ---- Loaded optimizer state: its padding is zero ----------------------------------------------------------------
def _padding_of(flat_param, t):
    """The elements of ``t`` (laid out like this rank's shard) that lie past the parameters: the padding."""
    first_pad = max(0, min(flat_param.shard_numel, flat_param.numel - flat_param.shard_offset))
    return t.detach().reshape(-1)[first_pad:]


def _load_optimizer_state(rank, world_size):
    model = _sharded_model()
    optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(model, optim, rank, world_size, range(1))
    saved = {"full": adapters.get_optimizer_state_dict(model, optim, full=True),
             "sharded": adapters.get_optimizer_state_dict(model, optim, full=False)}
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)  # the same full dict on every rank
    saved["full"] = box[0]
    out = {}
    for kind, state_dict in saved.items():
        model = _sharded_model(seed=1)
        optim = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-2)
        adapters.set_optimizer_state_dict(model, optim, state_dict, full=kind == "full")
        padding = {}
        for prefix, fp in _named(model):
            for key, value in optim.state.get(fp.shard, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    padding[f"unit '{prefix or '<root>'}' {key}"] = _padding_of(fp, value).clone()
        out[kind] = padding
    return out


def test_loaded_optimizer_state_has_zero_padding():
    world_size = 3  # GPT's units do not divide by 3: the last rank's shards end in padding
    results = run_ranks(_load_optimizer_state, world_size)
    assert any(pad.numel() for got in results for pad in got["full"].values()), \
        "test set-up: some rank's optimizer state must have padding"
    for rank, got in enumerate(results):
        for kind in ("full", "sharded"):
            assert got[kind], f"rank {rank}: after loading a {kind} optimizer state dict the optimizer holds no state"
            bad = {where: pad.tolist()[:4] for where, pad in got[kind].items() if pad.any()}
            assert not bad, (
                f"rank {rank}: right after loading a {kind} optimizer state dict, the padding of the per-element "
                f"state is not zero (where: its first padding values): {bad}. The padding stays zero, in the "
                f"optimizer state too (module docstring): AdamW would turn nonzero padding state into updates of "
                f"the shard's padding (memory that is allocated but never written holds whatever it held before)")


# ---- The full model state dict alone: on rank 0 only, also while it is made (the kernel's peaks) -----------------
# 24 blocks of about 1 M parameters (92 MiB in fp32): one full model's state stands far above what a rank's peak
# varies by from run to run (16 MiB), so the model state dict is judged alone, without the optimizer's.
RANK0_MODEL_CFG = GPTConfig(n_layer=24, n_embd=288, n_head=4)


def _save_full_model_state(rank, world_size):
    model = gpt_sharded_block_by_block(RANK0_MODEL_CFG, lambda module: hand_shard(module, [module]))
    saved = adapters.get_model_state_dict(model, full=True)
    return {"model": len(saved)}


def test_full_model_state_dict_lives_on_rank_0_only_also_while_it_is_made():
    world_size = 2
    witness = Witness()  # no bound of its own: the ranks' peaks are compared with each other below
    results = run_ranks(_save_full_model_state, world_size, witness=witness, memory_limit_bytes=640 << 20)
    with torch.device("meta"):
        model = GPT(RANK0_MODEL_CFG)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())  # fp32, tied weights once
    assert results[0]["model"], "rank 0 must return the full model state dict"
    assert all(got["model"] == 0 for got in results[1:]), "a full state dict lives on rank 0 only ({} elsewhere)"
    peaks = [m["peak_bytes"] for m in witness.measured]
    for rank in range(1, world_size):
        # Rank 0 holds the full model state dict (one model's bytes) on top of what every rank holds (its shards,
        # one unit gathered at a time): a rank that built the whole dict too, then dropped it, peaks as high.
        below = peaks[0] - peaks[rank]
        assert below >= model_bytes // 2, (
            f"rank {rank}: the kernel saw its resident memory peak {below / 2**20:.1f} MiB below rank 0's "
            f"({peaks[rank] / 2**20:.1f} vs {peaks[0] / 2**20:.1f} MiB above their start), while rank 0 holds the "
            f"full model state dict ({model_bytes / 2**20:.1f} MiB): it exists on rank 0 only, and the other ranks "
            f"must not hold it while it is made either (take part in the gathers, keep nothing: about one unit's "
            f"parameters at a time)")


# ---- Loading a model state dict restores the buffers too ----------------------------------------------------------
def _toy(seed):
    torch.manual_seed(seed)
    model = ToyMLP()
    hand_shard(model, [*model.blocks, model])
    return model


def _restore_buffers(rank, world_size):
    model = _toy(0)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.scale.fill_(i + 0.25)  # changed since init: only the state dict can bring these values back
    saved = {kind: adapters.get_model_state_dict(model, full=kind == "full") for kind in ("full", "sharded")}
    box = [saved["full"]]
    dist.broadcast_object_list(box, src=0)  # the same full dict on every rank
    saved["full"] = box[0]
    out = {}
    for kind, state_dict in saved.items():
        fresh = _toy(1)
        adapters.set_model_state_dict(fresh, state_dict, full=kind == "full")
        out[kind] = {n: b.clone() for n, b in fresh.named_buffers()}
    return out


def test_loading_a_model_state_dict_restores_buffers():
    expected = {f"blocks.{i}.scale": torch.full((29,), i + 0.25) for i in range(3)}
    for rank, got in enumerate(run_ranks(_restore_buffers, 2)):
        for kind in ("full", "sharded"):
            wrong = {n: b.tolist()[:3] for n, b in got[kind].items() if n in expected and not torch.equal(b, expected[n])}
            assert got[kind].keys() >= expected.keys() and not wrong, (
                f"rank {rank}: after loading a {kind} model state dict into a fresh model, its buffers (first values) "
                f"{wrong or sorted(got[kind])}; the saved ones were {{blocks.i.scale: i + 0.25}}. Loading restores "
                f"everything the dict holds, buffers included (module docstring)")
