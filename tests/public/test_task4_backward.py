"""Task 4: backward (re-gather, reduce-scatter gradients, free, finish before backward returns; frozen units and
activation checkpointing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import adapters
from fsdp_assignment.support.models import (GPT, GPTConfig, LoRABlock, LoRAConfig, LoRAModel, ScaledResidual, ToyMLP,
                                           gpt_batch, gpt_loss)
from tests.harness import run_ranks
from tests.public.collectives import gathered_unit, use_counted_collectives
from tests.public.invariants import check_monitor
from tests.public.monitor import Monitor
from tests.public.common import (assert_close, check_flat_params, describe_flat_params, expected_shard,
                                 full_params_of, hand_shard, hand_shard_as_built, hand_shard_gpt, local_batch,
                                 rank_device,
                                 unsharded_storage_sizes, witness_for, WITNESS_PEAK_OVERHEAD_HEAVY_BYTES)

pytestmark = pytest.mark.task4


def _gpt_backward(rank, world_size, reshard_after_forward):
    cfg = WIDE_CFG
    log = use_counted_collectives(late=True)  # None under NCCL
    torch.manual_seed(0)
    model = GPT(cfg).to(rank_device())
    mon = Monitor(model, GPT_UNITS, log)  # the invariant monitor (tests/public/monitor.py)
    hand_shard_gpt(model, reshard_after_forward=reshard_after_forward)
    mon.attach().setting(reshard_after_forward=reshard_after_forward)
    idx, tgt = local_batch(cfg, rank, world_size, step=0, device=rank_device())
    mon.backward(gpt_loss(model, idx, tgt))
    full_grads_alive = [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                        for fp in u.flat_params if fp.unsharded.grad is not None]
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": full_grads_alive, "monitor": mon.report()}


def _single_process_grads(model, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in
            model.named_parameters(remove_duplicate=False)}


def _check_grad_shards(results, model, unit_prefixes, expected_grads, rtol=1e-5):
    """Every rank's gradient shards against single-process PyTorch. Which units exist, what each owns and
    which of its FlatParameters are trainable is decided from the parent's own ``model``."""
    for rank, got in enumerate(results):
        if "monitor" in got:
            check_monitor(got["monitor"], model, len(results), f"rank {rank}")
        trainable = check_flat_params(got["flat"], model, unit_prefixes, f"rank {rank}")
        for desc, is_trainable in zip(got["flat"], trainable):
            unit = desc["prefix"] or "<root>"
            if not is_trainable:
                assert desc["grad"] is None, f"rank {rank}: frozen parameters of {unit} must get no gradient"
                continue
            assert desc["grad"] is not None, f"rank {rank}: unit {unit} has no gradient on its shard after backward"
            expected = expected_shard(desc, expected_grads)
            assert_close(desc["grad"], expected, f"rank {rank}: gradient shard of unit {unit}", rtol=rtol)
            pad_from = max(0, desc["numel"] - desc["shard_offset"])
            assert torch.all(desc["grad"][pad_from:] == 0), f"rank {rank}: gradient padding of {unit} must be zero"
        assert got["full_grads_alive"] == [], f"rank {rank}: full gradients still alive after backward: {got['full_grads_alive']}"
        assert len(got["sizes"]) == len(got["flat"]) and all(s == 0 for s in got["sizes"]), \
            f"rank {rank}: units still unsharded after backward: {got['sizes']}"


GPT_UNITS = [f"blocks.{i}." for i in range(GPTConfig().n_layer)] + [""]  # hand_shard_gpt: blocks, then the root
# _gpt_backward's model, wide enough (Σ 5.2 MiB, a block 1.7 MiB) that a reading after backward could tell a rank
# that frees its units from one that keeps them (common.py's held bounds, issue 40). Those bounds are not applied:
# graded as the rank user on the staff's image, the staff's solution held up to 1.2 MiB over them.
WIDE_CFG = GPTConfig(n_embd=192)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.evidence("bytes", "memory")
def test_gradient_shards_match_single_process(backend, world_size):
    # One backward: every unit gathered in forward and again in backward, its full gradient reduce-scattered once.
    witness = witness_for(lambda: GPT(WIDE_CFG), GPT_UNITS, world_size, moved=3)
    results = run_ranks(_gpt_backward, world_size, True, backend=backend, witness=witness)
    cfg = WIDE_CFG
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = gpt_batch(cfg, 2 * world_size, seed=0)
    _check_grad_shards(results, model, GPT_UNITS, _single_process_grads(model, gpt_loss(model, idx, tgt)))


@pytest.mark.evidence("bytes", "memory")
def test_gradients_without_reshard_after_forward():
    # Units stay unsharded from forward to backward (all of them at once); each gathered once, reduce-scattered once.
    witness = witness_for(lambda: GPT(WIDE_CFG), GPT_UNITS, 2, unsharded=len(GPT_UNITS), moved=2)
    results = run_ranks(_gpt_backward, 2, False, witness=witness)
    cfg = WIDE_CFG
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


@pytest.mark.evidence("memory")
def test_nested_frozen_and_unused_parameters():
    world_size = 3
    units = [p for i in range(3) for p in (f"blocks.{i}.inner.", f"blocks.{i}.")] + [""]
    # Nested units: a block's inner unit is alive inside its block's; each gathered twice, reduce-scattered once.
    witness = witness_for(lambda: ToyMLP(with_unused=True), units, world_size, unsharded=3, full_grads=2, moved=3)
    results = run_ranks(_toy_backward, world_size, timeout=30, witness=witness)
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


# ---- Frozen units (LoRA) and activation checkpointing: each unit is resharded when its own backward is done --
# These bodies also serve Task 6's tests (hooks=6, prefetching on) and the hidden variants.
LORA = LoRAConfig()
# Non-root units unsharded at any moment of backward: the one computing, plus the one prefetched (Task 6).
MAX_UNSHARDED = {False: 1, True: 2}  # by prefetch
# AdamW's first step is about lr * g / (|g| + eps): an eps above fp32 rounding noise keeps the comparison about
# FSDP, not about the sign of noise in near-zero gradients (see ADAM_EPS in test_task5_optim_ckpt.py).
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-4)


def _count_unsharded(units) -> int:
    return sum(any(fp.is_unsharded() for fp in u.flat_params) for u in units if not u.is_root)


def _sample_in_every_unit(model, probes, counts: list) -> None:
    """Record the number of unsharded non-root units in the middle of every unit's forward and backward:
    when each probe module (one inside each unit) runs forward, recomputation included, and when the
    gradient of its output arrives."""
    units = adapters.fsdp_units(model)

    def grad_hook(grad):
        counts.append(_count_unsharded(units))

    def forward_hook(module, args, output):
        counts.append(_count_unsharded(units))
        if output.requires_grad:
            output.register_hook(grad_hook)

    for probe in probes:
        probe.register_forward_hook(forward_hook)


# The LoRA model stays small (a block is 0.1 MiB): widened to 8.4 MiB a block (n_embd=512, hidden=2048) so that the
# kernel's witness would resolve one unit, the adapters' gradients differ from one process by 1.2e-6 relative (the
# tests allow 1e-6) and each test takes 2-3 times as long. Its witness bounds gross excess only.
def _lora_config(freeze_embedding: bool) -> LoRAConfig:
    return LoRAConfig(freeze_embedding=freeze_embedding)


def _lora_model(freeze_embedding: bool, frozen_block: int | None) -> tuple[LoRAConfig, LoRAModel]:
    cfg = _lora_config(freeze_embedding)
    torch.manual_seed(0)
    model = LoRAModel(cfg)
    if frozen_block is not None:  # a unit with no trainable parameter at all
        model.blocks[frozen_block].requires_grad_(False)
    return cfg, model


def _lora_sharded_as_built(freeze_embedding: bool, frozen_block: int | None, hooks: int):
    """_lora_model's model (the same values), each block frozen as _lora_model does and made a unit as soon as it
    is built, then the root: the whole model never exists in the rank."""
    cfg = _lora_config(freeze_embedding)
    torch.manual_seed(0)

    def freeze(block, i):
        if i == frozen_block:
            block.requires_grad_(False)
    return cfg, hand_shard_as_built(lambda: LoRAModel(cfg), LoRABlock, before_shard=freeze, hooks=hooks)


def lora_run(rank, world_size, hooks=4, prefetch=False, freeze_embedding=False, frozen_block=None):
    """One LoRA training step on hand-made units (each block, then the root): gradient shards, the unsharded
    counts sampled at every unit's backward, what is unsharded after backward, and the shards after AdamW."""
    cfg, model = _lora_sharded_as_built(freeze_embedding, frozen_block, hooks)
    model._fsdp_unit.shared.prefetch = prefetch
    counts: list[int] = []
    _sample_in_every_unit(model, [b.fc for b in model.blocks], counts)
    optim = torch.optim.AdamW(model.parameters(), **ADAMW)
    idx, tgt = local_batch(cfg, rank, world_size, step=0)
    gpt_loss(model, idx, tgt).backward()
    out = {"flat": describe_flat_params(model, grads=True), "counts": counts,
           "sizes": unsharded_storage_sizes(model),
           "full_grads_alive": [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                                for fp in u.flat_params if fp.unsharded.grad is not None]}
    optim.step()
    out["after_step"] = describe_flat_params(model)
    return out


def lora_witness(world_size: int, prefetch: bool = False, freeze_embedding: bool = False,
                 frozen_block: int | None = None):
    """lora_run's bounds: its model built whole, AdamW's two states on the shards (4 shard copies), the units the
    property allows unsharded (MAX_UNSHARDED non-root units and the root); one step moves each unit three times."""
    cfg = _lora_config(freeze_embedding)
    return witness_for(lambda: LoRAModel(cfg), [f"blocks.{i}." for i in range(cfg.n_layer)] + [""], world_size,
                       built=0, shard_copies=2, unsharded=MAX_UNSHARDED[prefetch] + 1, full_grads=1,
                       overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES, moved=3)


def check_lora(results, world_size, prefetch=False, freeze_embedding=False, frozen_block=None):
    cfg, model = _lora_model(freeze_embedding, frozen_block)
    optim = torch.optim.AdamW(model.parameters(), **ADAMW)
    idx, tgt = gpt_batch(cfg, 2 * world_size, seed=0)
    grads = _single_process_grads(model, gpt_loss(model, idx, tgt))
    optim.step()
    params = full_params_of(model)
    _check_grad_shards(results, model, [f"blocks.{i}." for i in range(cfg.n_layer)] + [""], grads, rtol=1e-6)
    for rank, got in enumerate(results):
        bound = MAX_UNSHARDED[prefetch]
        assert max(got["counts"]) <= bound, (
            f"rank {rank}: up to {max(got['counts'])} non-root units were unsharded at once during backward "
            f"(sampled inside every unit: {got['counts']}); at most {bound} (prefetch={prefetch}): reshard each unit, frozen "
            f"parameters included, as soon as its own backward is done, not when the whole backward ends")
        for desc in got["after_step"]:
            assert_close(desc["shard"], expected_shard(desc, params),
                         f"rank {rank}: shard of unit {desc['prefix'] or '<root>'} after one AdamW step", rtol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.evidence("memory")
def test_frozen_base_weights_are_resharded_at_each_units_backward(world_size):
    """LoRA-style blocks (frozen base + trainable adapter): adapter gradients equal one process, one non-root
    unit unsharded at any sampled moment of backward (the one computing), none after it, one AdamW step matches."""
    check_lora(run_ranks(lora_run, world_size, witness=lora_witness(world_size)), world_size)


AC_VARIANTS = [  # (where, reentrant, early_stop): see GPTConfig.checkpoint
    ("block", False, True), ("mlp", False, True), ("block", False, False), ("block", True, True), ("mlp", True, True)]
AC_CFG = GPTConfig(n_layer=3)
GPT_AC_UNITS = [f"blocks.{i}." for i in range(AC_CFG.n_layer)] + [""]


def _name_gathered_buffers(model, log) -> list[str]:
    """A list that receives, for every all-gather from now on, the name of the unit it gathers ("blocks.1." or
    "" for the root; "?" for none), identified by the shard it sends (``gathered_unit``), not by where it
    writes: an implementation may gather into any buffer it likes."""
    units = {name: unit for name, unit in zip(GPT_AC_UNITS, [*(b._fsdp_unit for b in model.blocks),
                                                             model._fsdp_unit])}
    names: list[str] = []

    def on_collective(call, output, sent):
        if call.kind == "all_gather":
            who = gathered_unit(sent, units)
            names.append("?" if who is None else who)
    log.listener = on_collective
    return names


def _per_unit(gathers: list[str]) -> dict[str, int]:
    return {name or "<root>": gathers.count(name) for name in dict.fromkeys(GPT_AC_UNITS + gathers)}


def checkpointing_run(rank, world_size, hooks=4, prefetch=False):
    """For every variant of AC_VARIANTS: one backward (and a second one, to exercise the recorded order with
    prefetching) under activation checkpointing; gradient shards, unsharded counts, and the all-gathers of each
    backward (per unit: which buffer each gather filled)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    log = use_counted_collectives()
    out = {}
    for i, (where, reentrant, early_stop) in enumerate(AC_VARIANTS):
        cfg = GPTConfig(**{**AC_CFG.__dict__, "checkpoint": where, "checkpoint_reentrant": reentrant})
        torch.manual_seed(0)
        model = GPT(cfg)
        root = hand_shard_gpt(model, hooks=hooks)
        root.shared.prefetch = prefetch
        counts: list[int] = []
        _sample_in_every_unit(model, [b.attn.c_attn for b in model.blocks], counts)
        gathered = _name_gathered_buffers(model, log)
        backward_gathers = []
        with set_checkpoint_early_stop(early_stop):
            for step in range(2):
                for p in model.parameters():
                    p.grad = None
                idx, tgt = local_batch(cfg, rank, world_size, step=step)
                loss = gpt_loss(model, idx, tgt)
                gathered.clear()
                loss.backward()
                backward_gathers.append(sorted(gathered))
        out[i] = {"backward_gathers": backward_gathers,
            "flat": describe_flat_params(model, grads=True), "counts": counts,
            "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                                 for fp in u.flat_params if fp.unsharded.grad is not None]}
    return out


def checkpointing_witness(world_size: int, prefetch: bool = False):
    """checkpointing_run's bounds: a model built whole for each variant (the last one's still alive when the next is
    built), MAX_UNSHARDED non-root units and the root unsharded; each of its two backwards per variant gathers
    every unit up to three times (forward, backward, recomputation) and reduce-scatters it once."""
    return witness_for(lambda: GPT(AC_CFG), GPT_AC_UNITS, world_size, models=2,
                       unsharded=MAX_UNSHARDED[prefetch] + 1, overhead_bytes=WITNESS_PEAK_OVERHEAD_HEAVY_BYTES,
                       moved=len(AC_VARIANTS) * 2 * 4)


def check_checkpointing(results, world_size, prefetch=False):
    torch.manual_seed(0)
    model = GPT(AC_CFG)
    idx, tgt = gpt_batch(AC_CFG, 2 * world_size, seed=1)  # the second step's batch (no optimizer step between)
    grads = _single_process_grads(model, gpt_loss(model, idx, tgt))
    for i, (where, reentrant, early_stop) in enumerate(AC_VARIANTS):
        what = (f"activation checkpointing around each {'unit (block)' if where == 'block' else 'MLP inside a unit'}"
                f", use_reentrant={reentrant}, early_stop={early_stop}")
        per_rank = [got[i] for got in results]
        try:
            _check_grad_shards(per_rank, model, GPT_AC_UNITS, grads, rtol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
        for rank, got in enumerate(per_rank):
            bound = MAX_UNSHARDED[prefetch]
            assert max(got["counts"]) <= bound, (
                f"{what}, rank {rank}: up to {max(got['counts'])} non-root units unsharded at once (sampled in every "
                f"unit's forward, recomputation and backward: {got['counts']}); at most {bound} (prefetch={prefetch}). A forward "
                f"that recomputes a checkpointed unit during its backward must not reshard it nor prefetch")
            for step, gathers in enumerate(got["backward_gathers"]):
                assert gathers == sorted(GPT_AC_UNITS), (
                    f"{what}, rank {rank}, backward {step + 1}: all-gathers per unit {_per_unit(gathers)}; each "
                    f"unit (all resharded after forward) must be all-gathered exactly once per backward. Under "
                    f"use_reentrant=True the recomputation is an ordinary forward run during backward: resharding "
                    f"after it costs a second all-gather of the same unit (Task 4's module docstring, the hard cases)")


@pytest.mark.evidence("memory")
def test_activation_checkpointing_matches_single_process():
    """torch.utils.checkpoint around each unit and around a block inside a unit (reentrant or not, with and
    without early stop): gradients equal one process, units unsharded stay bounded during recomputation, each unit
    all-gathered once per backward."""
    check_checkpointing(run_ranks(checkpointing_run, 2, timeout=90, witness=checkpointing_witness(2)), 2)


# ---- A loss made from a block's output that the root does not return (a hard case of the module docstring): the
# root's output never gets a gradient, so nothing of the root's runs in backward before the end, and yet every rule
# holds when loss.backward() returns.
def _block_output_loss(rank, world_size):
    cfg = WIDE_CFG
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    mon = Monitor(model, GPT_UNITS, log)
    hand_shard_gpt(model)
    mon.attach()
    seen = []
    model.blocks[1].register_forward_hook(lambda module, args, output: seen.append(output))
    idx, _ = local_batch(cfg, rank, world_size, step=0)
    model(idx)  # the logits are dropped: the loss below never reaches the root's output
    mon.backward(seen[-1].square().mean())
    full_grads_alive = [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                        for fp in u.flat_params if fp.unsharded.grad is not None]
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": full_grads_alive, "mon": mon.report()}


@pytest.mark.evidence("memory")
def test_loss_from_a_block_output_the_root_does_not_return():
    world_size = 2
    # Memory only (no byte count is decided here): the units a loss that skips some of them gathers are each design's.
    witness = witness_for(lambda: GPT(WIDE_CFG), GPT_UNITS, world_size)
    witness.sent_bytes = None
    results = run_ranks(_block_output_loss, world_size, witness=witness)
    cfg = WIDE_CFG
    torch.manual_seed(0)
    model = GPT(cfg)
    seen = []
    model.blocks[1].register_forward_hook(lambda module, args, output: seen.append(output))
    idx, _ = gpt_batch(cfg, 2 * world_size, seed=0)
    model(idx)
    expected = _single_process_grads(model, seen[-1].square().mean())
    for rank, got in enumerate(results):
        # Which units a loss that skips some of them gathers again or reduces is each design's own: the order
        # and collective invariants are left out; what must hold when backward returns is not.
        check_monitor(got["mon"], model, world_size, f"rank {rank} (loss from blocks.1's output)", collectives=False)
        for desc in got["flat"]:  # a unit the loss never reaches gets no gradient or zeros (the docstring's rule)
            if desc["grad"] is None and desc["requires_grad"] and not expected_shard(desc, expected).any():
                desc["grad"] = torch.zeros(desc["shard_numel"])
    _check_grad_shards(results, model, GPT_UNITS, expected)


# ---- A unit whose input an earlier unit also reads (both blocks read the embedding's output), and a unit whose only
# input that carries a gradient is a keyword argument. Wide enough (103K elements) that an all-reduce in place of
# the reduce-scatters sends about 400 KiB more than the kernel's byte bound allows a rank: the witness decides the
# bytes, not only the counter in the rank.
class SharedInput(nn.Module):
    def __init__(self, d_in: int = 13, dim: int = 129, hidden: int = 191, d_out: int = 7):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.first = ScaledResidual(dim, hidden)
        self.second = ScaledResidual(dim, hidden)
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.first(h) + self.second(h))


class GatedResidual(ScaledResidual):
    def forward(self, gate: torch.Tensor, *, h: torch.Tensor) -> torch.Tensor:
        return super().forward(gate * h)


class KeywordInput(SharedInput):
    """``second`` gets a gate without gradient positionally and its activation as the keyword ``h``."""

    def __init__(self, d_in: int = 13, dim: int = 129, hidden: int = 191, d_out: int = 7):
        super().__init__(d_in, dim, hidden, d_out)
        self.second = GatedResidual(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(self.embed(x))
        return self.head(self.second(torch.full_like(h, 0.5), h=h))


SHARED_UNITS = ["first.", "second.", ""]
INPUT_CASES = {"a unit whose input an earlier unit also reads": SharedInput,
               "a unit whose activation comes as a keyword argument": KeywordInput}


def _shared_and_keyword_inputs(rank, world_size):
    log = use_counted_collectives(late=True)
    out = {}
    for name, make in INPUT_CASES.items():
        torch.manual_seed(0)
        model = make()
        mon = Monitor(model, SHARED_UNITS, log)
        hand_shard(model, [model.first, model.second, model])
        mon.attach()
        x = torch.randn(3 * world_size, 13, generator=torch.Generator().manual_seed(1))[3 * rank:3 * (rank + 1)]
        mon.backward(model(x).pow(2).mean())
        full_grads_alive = [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                            for fp in u.flat_params if fp.unsharded.grad is not None]
        out[name] = {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
                     "full_grads_alive": full_grads_alive, "monitor": mon.report()}
    return out


@pytest.mark.evidence("bytes", "memory")
def test_units_reading_a_shared_input_or_a_keyword_input():
    # Each unit is resharded as soon as its own backward is done (the monitor's unsharded-bound: one non-root unit
    # at a time), although the input it read is also read by the unit that ran before it, or comes as a keyword.
    world_size = 2
    # Two models one after the other; each unit gathered twice and reduce-scattered once a model.
    witness = witness_for(SharedInput, SHARED_UNITS, world_size, models=2, moved=6)
    results = run_ranks(_shared_and_keyword_inputs, world_size, witness=witness)
    for name, make in INPUT_CASES.items():
        torch.manual_seed(0)
        model = make()
        x = torch.randn(3 * world_size, 13, generator=torch.Generator().manual_seed(1))
        try:
            _check_grad_shards([got[name] for got in results], model, SHARED_UNITS,
                               _single_process_grads(model, model(x).pow(2).mean()))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


# ---- More of the module docstring's hard cases, one small model each, in one run ----------------------------------
class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.a(x), self.b(x), "not a tensor"


class OneOutputOfTwo(nn.Module):
    """``two`` returns (a, b, a string); the loss uses only output ``use``: its pre-backward must run whichever."""

    def __init__(self, use: int):
        super().__init__()
        self.use = use
        self.pre = nn.Linear(5, 6)
        self.two = TwoOutputs()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.two(torch.tanh(self.pre(x)))[self.use])


class TwiceAndDetached(nn.Module):
    """``twice`` runs twice in one forward (its gradient: the sum of both runs'); ``side``'s output is detached."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(13, 29)
        self.twice = ScaledResidual(29, 37)
        self.side = nn.Linear(29, 29)
        self.head = nn.Linear(29, 7)

    def forward(self, x):
        h = self.twice(self.twice(self.embed(x)))
        return self.head(h + self.side(h).detach())


def _hard_case_models():
    """name -> (model maker, its units' prefixes, input maker(world_size))"""
    x = lambda d: (lambda world_size: torch.randn(3 * world_size, d, generator=torch.Generator().manual_seed(5)))
    return {"the loss uses output 0 of two": (lambda: OneOutputOfTwo(0), ["two.", ""], x(5)),
            "the loss uses output 1 of two": (lambda: OneOutputOfTwo(1), ["two.", ""], x(5)),
            "a unit run twice and a detached output": (TwiceAndDetached, ["twice.", "side.", ""], x(13))}


EVAL_CASE = "an evaluation forward under no_grad, then a training step (reshard_after_forward=False)"


def _hard_cases(rank, world_size):
    out = {}
    for name, (make, units, inputs) in _hard_case_models().items():
        torch.manual_seed(0)
        model = make()
        hand_shard(model, [model.get_submodule(u[:-1]) if u else model for u in units])
        model(inputs(world_size)[3 * rank:3 * (rank + 1)]).pow(2).mean().backward()
        out[name] = _after_backward(model)
    # An evaluation forward under torch.no_grad(), then a training step: every gradient still arrives. Without
    # reshard_after_forward the units stay unsharded in between, with the parameter views the evaluation made.
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    hand_shard_gpt(model, reshard_after_forward=False)
    idx, tgt = local_batch(cfg, rank, world_size, step=0)
    with torch.no_grad():
        model(idx)
    gpt_loss(model, idx, tgt).backward()
    out[EVAL_CASE] = _after_backward(model)
    return out


def _after_backward(model):
    return {"flat": describe_flat_params(model, grads=True), "sizes": unsharded_storage_sizes(model),
            "full_grads_alive": [u.module.__class__.__name__ for u in adapters.fsdp_units(model)
                                 for fp in u.flat_params if fp.unsharded.grad is not None]}


@pytest.mark.evidence("memory")
def test_one_output_of_several_a_unit_run_twice_a_detached_output_and_an_evaluation_forward():
    world_size = 2
    # Four small models one after the other, the GPT the largest (memory only: no byte count is decided here).
    witness = witness_for(lambda: GPT(GPTConfig()), GPT_UNITS, world_size, models=4, unsharded=len(GPT_UNITS))
    witness.sent_bytes = None
    results = run_ranks(_hard_cases, world_size, witness=witness)
    for name, (make, units, inputs) in _hard_case_models().items():
        torch.manual_seed(0)
        model = make()
        expected = _single_process_grads(model, model(inputs(world_size)).pow(2).mean())
        for got in results:
            for desc in got[name]["flat"]:  # a unit autograd never reaches gets no gradient or zeros
                if desc["grad"] is None and desc["requires_grad"] and not expected_shard(desc, expected).any():
                    desc["grad"] = torch.zeros(desc["shard_numel"])
        try:
            _check_grad_shards([got[name] for got in results], model, units, expected)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = gpt_batch(cfg, 2 * world_size, seed=0)
    name = EVAL_CASE
    try:
        _check_grad_shards([got[name] for got in results], model, GPT_UNITS,
                           _single_process_grads(model, gpt_loss(model, idx, tgt)))
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None
