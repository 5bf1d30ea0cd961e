"""Bonus (HSDP): ``fully_shard(module, mesh=init_device_mesh("cpu", (R, K)))`` on a 2-D mesh, FSDP2's convention:
mesh dim 0 replicates, dim 1 shards. Graded as bonus points (tests/points.py, BONUS_POINTS), apart from the 100.

One run per mesh configuration, each rank training torch's FSDP2 on the same mesh first, then yours on counted
collectives that finish late (tests/public/collectives.py), with prefetching on for 2x2 (the asynchronous path)
and off for the degenerate meshes (the synchronous one). The parent checks, against single-process PyTorch:

- training (3 SGD steps with momentum and ``clip_grad_norm_``) gives the single process's parameters within 1e-6,
  and so does FSDP2 on the same mesh; the global gradient norms are the single process's (replicas are not
  counted twice);
- each rank holds the shard of its place in the shard group (shard rank = rank % K): model state per rank is
  that of a K-way shard (parameters and optimizer state), whatever R is;
- parameter traffic per rank and step, exactly: all-gathers and reduce-scatters of K ranks only (each unit's padded
  gradient reduce-scattered once), and one all-reduce per unit across the R replicas of its gradient shard (none
  when R = 1); in bytes, the handout's formulas: all-gathers 2 (K-1)/K P, reduce-scatter (K-1)/K G, all-reduce
  2 (R-1)/R G/K (P = G = the padded parameter bytes). A collective to which each rank contributes at most
  SMALL_COLLECTIVE_NUMEL elements (a norm, a count, a flag: ``clip_grad_norm_``'s norm, all-reduced or all-gathered
  as one number per rank) is not parameter traffic and is not counted;
- ``gather_full_params``, the full model and optimizer state dicts, and loading a full state dict into a fresh
  HSDP model, all across the whole mesh.
"""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from tests.harness import run_ranks
from tests.public.common import WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, own_storage, witness_for
from tests.public.collectives import use_counted_collectives
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard,
                                 full_params_of, local_batch, unit_numels)

pytestmark = pytest.mark.bonus("hsdp")

CFG = GPTConfig()
SGD = dict(lr=0.1, momentum=0.9)
MAX_NORM = 0.5   # far below the gradient norms of these steps (about 7): clipping really scales
STEPS = 3
RTOL = 1e-6
GPT_UNITS = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]
FP32_BYTES = 4
# Parameter traffic only: a collective to which each rank contributes at most this many elements is not counted (a
# norm's one number per rank, all-gathered or all-reduced, or a few: one per unit or per dtype). The smallest
# parameter collective of these tests is a unit's shard at K = 4, over 1,000 elements (the root: 4,370 / 4), so no
# unit's parameters or gradients fit under it.
SMALL_COLLECTIVE_NUMEL = 64
NOT_COUNTED = (f" (collectives to which each rank contributes at most {SMALL_COLLECTIVE_NUMEL} elements, such as "
               f"clip_grad_norm_'s, are not parameter traffic and are not counted)")


def _key(shape) -> str:
    return f"{shape[0]}x{shape[1]}"  # results travel back with str keys


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))  # FSDP2 asks for the names


def _shard_gpt(model, shard, **kwargs):
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _train(model, optim, rank, world_size, clip):
    norms = []
    for step in range(STEPS):
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        norms.append(float(clip(model)))
        optim.step()
    return norms


def _hsdp_runs(rank, world_size, shapes, prefetch):
    """Per mesh shape: FSDP2's HSDP, then ours, trained the same way; what the parent needs to judge ours."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for shape in shapes:  # FSDP2 first, on the plain gloo group (the counted one replaces it below)
        torch.manual_seed(0)
        model = _shard_gpt(GPT(CFG), torch_fully_shard, mesh=_mesh(shape))
        optim = torch.optim.SGD(model.parameters(), **SGD)
        _train(model, optim, rank, world_size,
               lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM).full_tensor())
        out[_key(shape)] = {"fsdp2": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}

    log = use_counted_collectives(late=True)
    for shape in shapes:
        got = out[_key(shape)]
        mesh = _mesh(shape)
        torch.manual_seed(0)
        model = _shard_gpt(GPT(CFG), adapters.fully_shard, mesh=mesh)
        optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
        adapters.set_prefetch(model, prefetch)
        start = log.mark()
        in_flight = [0]

        def count_reductions(call, output, sent):  # before each new reduce-scatter: how many are still not waited on
            if call.kind == "reduce_scatter":
                n = sum(c["kind"] == "reduce_scatter" for c in log.unwaited(start))
                in_flight[0] = max(in_flight[0], n)
        log.listener = count_reductions
        got["norms"] = _train(model, optim, rank, world_size, lambda m: adapters.clip_grad_norm_(m, MAX_NORM))
        log.listener = None
        got["train_calls"] = log.since(start)
        got["reductions_in_flight"] = in_flight[0]
        got["flat"] = describe_flat_params(model)
        got["shard_numels"] = [p.numel() for p in model.parameters()]
        got["optim_state_numels"] = [t.numel() for s in optim.state.values() for t in s.values()
                                     if isinstance(t, torch.Tensor) and t.dim() > 0]
        got["gathered"] = {n: t.detach().cpu() for n, t in adapters.gather_full_params(model).items()}
        model_sd = adapters.get_model_state_dict(model, full=True)
        optim_sd = adapters.get_optimizer_state_dict(model, optim, full=True)
        got["model_sd"] = {k: v.detach().cpu() for k, v in model_sd.items()}
        got["momentum"] = {k: v["momentum_buffer"].detach().cpu() for k, v in optim_sd.get("state", {}).items()
                           if "momentum_buffer" in v}
        # Loading across the mesh: rank 0's full state dict (sent to every rank) into a fresh HSDP model.
        full = [own_storage(model_sd) if rank == 0 else None]  # the test's transfer: each tensor's own bytes
        torch.distributed.broadcast_object_list(full, src=0)
        torch.manual_seed(1)
        fresh = _shard_gpt(GPT(CFG), adapters.fully_shard, mesh=mesh)
        adapters.set_model_state_dict(fresh, full[0], full=True)
        got["reloaded"] = {n: t.detach().cpu() for n, t in adapters.gather_full_params(fresh).items()}
        # Units over two different groups (the blocks on this mesh, the root on the default group): clipping has
        # no one group to all-reduce over and must refuse (clip_grad_norm_'s ValueError). Only with R, K > 1:
        # a degenerate mesh's shard group may be the default group itself.
        if min(shape) == 1:
            continue
        torch.manual_seed(0)
        mixed = GPT(CFG)
        for block in mixed.blocks:
            adapters.fully_shard(block, mesh=mesh)
        adapters.fully_shard(mixed)
        gpt_loss(mixed, *local_batch(CFG, rank, world_size, 0)).backward()
        try:
            adapters.clip_grad_norm_(mixed, MAX_NORM)
            got["clip_over_two_groups"] = None
        except ValueError as e:
            got["clip_over_two_groups"] = str(e)
    return out


def _single_process(world_size):
    torch.manual_seed(0)
    model = GPT(CFG)
    optim = torch.optim.SGD(model.parameters(), **SGD)
    norms = []
    for step in range(STEPS):
        idx, tgt = gpt_batch(CFG, 2 * world_size, seed=step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optim.step()
    return model, optim, norms


def _check_communication(calls, padded, R, K, where):
    """Exactly what HSDP communicates per rank (see the module docstring), and the handout's byte formulas."""
    calls = [c for c in calls if c["numel"] > SMALL_COLLECTIVE_NUMEL]  # parameter traffic only (see its comment)
    grads = [c for c in calls if c["kind"] in ("reduce_scatter", "all_reduce")]
    kinds = sorted({c["kind"] for c in calls} - {"all_gather", "reduce_scatter", "all_reduce", "barrier"})
    assert not kinds, f"{where}: training communicated parameters with {kinds}; HSDP needs all-gathers, " \
                      f"reduce-scatters and all-reduces only" + NOT_COUNTED
    gathers = [c for c in calls if c["kind"] == "all_gather"]
    sizes = sorted({c["group_size"] for c in gathers + [c for c in calls if c["kind"] == "reduce_scatter"]})
    assert sizes == [K], f"{where}: all-gathers and reduce-scatters ran on groups of {sizes} ranks; with mesh " \
                         f"({R}, {K}) they belong in the shard group ({K} ranks, mesh dim 1)"
    rs = sorted(c["numel"] for c in grads if c["kind"] == "reduce_scatter")
    assert rs == sorted(list(padded.values()) * STEPS), (
        f"{where}: reduce-scatters of {rs} elements in {STEPS} steps; expected each unit's padded gradient (padded "
        f"to a multiple of K={K}) once a step: {sorted(padded.values())}")
    ar = sorted((c["group_size"], c["numel"]) for c in grads if c["kind"] == "all_reduce")
    expected_ar = sorted([(R, n // K) for n in padded.values()] * STEPS) if R > 1 else []
    assert ar == expected_ar, (
        f"{where}: gradient all-reduces (group size, elements) {ar}; expected one per unit and step across the "
        f"{R} replicas (mesh dim 0) of the reduced gradient shard: {sorted({(R, n // K) for n in padded.values()})}"
        + (" x steps" if R > 1 else " (none: one replica)"))
    # Bytes per rank per step, as the handout's formulas count a ring collective of N (full) bytes.
    p_bytes = sum(padded.values()) * FP32_BYTES
    ag = sum((K - 1) * c["numel"] * FP32_BYTES for c in gathers) / STEPS
    root = padded.get("", 0) * FP32_BYTES
    allowed = {2 * (K - 1) / K * p_bytes, 2 * (K - 1) / K * p_bytes - (K - 1) / K * root}
    assert any(abs(ag - a) < 1e-6 * max(a, 1) for a in allowed), (
        f"{where}: all-gather bytes per step {ag:.0f}; the formula 2 (K-1)/K P gives {max(allowed):.0f} (every unit "
        f"in forward and again in backward; the root may skip its backward gather: {min(allowed):.0f})" + NOT_COUNTED)
    rs_bytes = sum((K - 1) / K * n * FP32_BYTES for n in rs) / STEPS
    assert abs(rs_bytes - (K - 1) / K * p_bytes) < 1e-6 * max(p_bytes, 1), \
        f"{where}: reduce-scatter bytes per step {rs_bytes:.0f}, the formula (K-1)/K G gives " \
        f"{(K - 1) / K * p_bytes:.0f}" + NOT_COUNTED
    ar_bytes = sum(2 * (g - 1) / g * n * FP32_BYTES for g, n in ar) / STEPS
    assert abs(ar_bytes - 2 * (R - 1) / R * p_bytes / K) < 1e-6 * max(p_bytes, 1), (
        f"{where}: all-reduce bytes per step {ar_bytes:.0f}, the formula 2 (R-1)/R G/K gives "
        f"{2 * (R - 1) / R * p_bytes / K:.0f}" + NOT_COUNTED)


def _check_hsdp(results, shape, expected, optim, norms):
    R, K = shape
    W = R * K
    full = full_params_of(expected)
    padded = {k: -(-n // K) * K for k, n in unit_numels(expected, GPT_UNITS).items() if n}
    state_names = {id(p): n for n, p in expected.named_parameters()}
    for rank, per_shape in enumerate(results):
        got, where = per_shape[_key(shape)], f"HSDP mesh ({R}, {K}), rank {rank}"
        for name, p in expected.named_parameters():
            assert_close(got["fsdp2"][name], p, f"{where}: torch FSDP2 on the same mesh, {name} after {STEPS} steps "
                         f"(vs single process)", rtol=RTOL)
            assert_close(got["gathered"][name], p, f"{where}: gather_full_params()['{name}'] after {STEPS} steps "
                         f"(vs single process)", rtol=RTOL)
            assert_close(got["gathered"][name], got["fsdp2"][name], f"{where}: {name}, yours vs FSDP2's HSDP",
                         rtol=RTOL)
            assert_close(got["reloaded"][name], p, f"{where}: a fresh HSDP model loaded from the full state dict, "
                         f"{name}", rtol=RTOL)
        assert min(shape) == 1 or got["clip_over_two_groups"] is not None, (
            f"{where}: clip_grad_norm_ on a model whose blocks are sharded over the mesh and whose root over the "
            f"default group returned; it must raise ValueError (no single group to all-reduce the norm over)")
        assert got["reductions_in_flight"] <= 1, (
            f"{where}: {got['reductions_in_flight']} earlier reduce-scatters were still in flight (not waited on) "
            f"when a new one was issued; at most one may be (each keeps a full gradient alive)")
        for step, (a, b) in enumerate(zip(got["norms"], norms)):
            assert abs(a - b) <= RTOL * b, (
                f"{where}: clip_grad_norm_ at step {step} returned {a:.7g}, the single process's global norm is "
                f"{b:.7g} (ratio {a / b:.4f}; sqrt(R) = {R ** 0.5:.4f} means every replica was counted)")
        check_flat_params(got["flat"], expected, GPT_UNITS, where)
        for desc in got["flat"]:
            unit = desc["prefix"] or "<root>"
            assert desc["shard_numel"] == padded[desc["prefix"]] // K and \
                desc["shard_offset"] == (rank % K) * desc["shard_numel"], (
                f"{where}: unit {unit} holds {desc['shard_numel']} elements at offset {desc['shard_offset']}; an "
                f"K={K}-way shard (mesh dim 1 shards) holds {padded[desc['prefix']] // K} at offset "
                f"{(rank % K) * (padded[desc['prefix']] // K)} (shard rank = rank % K)")
            assert_close(desc["shard"], expected_shard(desc, full), f"{where}: shard of unit {unit}", rtol=RTOL)
        per_rank = sum(padded.values()) // K
        assert sum(got["shard_numels"]) == per_rank and sum(got["optim_state_numels"]) == per_rank, (
            f"{where}: model state per rank: {sum(got['shard_numels'])} parameter and "
            f"{sum(got['optim_state_numels'])} momentum elements; a K={K}-way shard holds {per_rank} of each "
            f"(W={W} ranks, but replicas keep whole copies of their shard group's shards)")
        _check_communication(got["train_calls"], padded, R, K, where)
        if rank == 0:
            for name, p in expected.named_parameters():
                assert_close(got["model_sd"][name], p, f"{where}: full model state dict['{name}']", rtol=RTOL)
            for p, buf in ((p, s["momentum_buffer"]) for p, s in optim.state.items()):
                name = state_names[id(p)]
                assert name in got["momentum"], f"{where}: full optimizer state dict has no momentum for {name}"
                assert_close(got["momentum"][name], buf, f"{where}: full optimizer state dict, {name} momentum",
                             rtol=RTOL)
        else:
            assert not got["model_sd"], f"{where}: a full state dict lives on rank 0 only; rank {rank} kept one"


def _hsdp_witness(world_size: int, meshes: int):
    """The kernel's bounds on _hsdp_runs, per mesh: FSDP2's model and ours (then a fresh one and a mixed one) built
    whole; STEPS steps of each with every unit gathered twice, reduce-scattered and all-reduced across replicas
    (an all-reduce moves twice a reduce-scatter's bytes; FSDP2's reduce-scatter is one on gloo), state dicts and
    a resumed step: at most 30 moves of every unit's elements a mesh. (_check_communication decides the bytes
    exactly from the counted collectives; this bounds what the kernel saw leave each rank.)"""
    return witness_for(lambda: GPT(CFG), GPT_UNITS, world_size, models=4,
                       overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
                       moved=30 * meshes)


@pytest.mark.weight(4)
@pytest.mark.evidence("bytes")
def test_hsdp_2x2_trains_like_one_process_and_fsdp2():
    shape, world_size = (2, 2), 4
    results = run_ranks(_hsdp_runs, world_size, [shape], True, timeout=180, witness=_hsdp_witness(world_size, 1))
    expected, optim, norms = _single_process(world_size)
    _check_hsdp(results, shape, expected, optim, norms)


@pytest.mark.weight(2)
@pytest.mark.evidence("bytes")
def test_hsdp_degenerate_meshes_4x1_and_1x4():
    """4x1: four replicas of an unsharded model (DDP-like: all-gathers and reduce-scatters of one rank); 1x4:
    one replica sharded four ways (FSDP: no all-reduce at all)."""
    shapes, world_size = [(4, 1), (1, 4)], 4
    results = run_ranks(_hsdp_runs, world_size, shapes, False, timeout=240,
                        witness=_hsdp_witness(world_size, len(shapes)))
    expected, optim, norms = _single_process(world_size)
    for shape in shapes:
        _check_hsdp(results, shape, expected, optim, norms)
