"""Task 6 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import torch

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, gpt_loss
from tests.public.collectives import gathered_unit, use_counted_collectives
from tests.public.common import describe_flat_params, hand_shard_gpt, local_batch


CFG = GPTConfig(n_layer=4)


STEPS = 2


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _run(rank, world_size, prefetch, trace, log):
    torch.manual_seed(0)
    model = GPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = prefetch
    units = adapters.fsdp_units(model)
    names = {id(u): ("root" if u.is_root else f"block{[b._fsdp_unit for b in model.blocks].index(u)}")
             for u in units}
    gathers = {"forward": {}, "backward": {}}
    phase = ["forward"]
    max_unsharded = [0]
    tracing = [False]

    def on_collective(call, output, sent):
        if not tracing[0] or call.kind != "all_gather":
            return
        who = _owner(units, names, sent)
        gathers[phase[0]][who] = gathers[phase[0]].get(who, 0) + 1
        max_unsharded[0] = max(max_unsharded[0], sum(any(fp.is_unsharded() for fp in u.flat_params)
                                                     for u in units if not u.is_root))

    log.listener = on_collective
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = None
    for step in range(STEPS):
        last = step == STEPS - 1
        tracing[0] = trace and last  # the first step records the execution order; trace the second
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        phase[0] = "forward"
        loss = gpt_loss(model, idx, tgt)
        # the units backward must gather: those resharded after forward (reshard_after_forward)
        resharded = sorted(names[id(u)] for u in units if not any(fp.is_unsharded() for fp in u.flat_params))
        phase[0] = "backward"
        loss.backward()
        if last:
            grads = _grads(model)  # right when backward returns: every reduce-scatter must have landed
        optim.step()
    log.listener = None
    return {"grads": grads, "gathers": gathers, "max_unsharded": max_unsharded[0], "resharded": resharded}


def _owner(units, names, sent):
    """The name of the unit whose shard an all-gather sends ("other": none): by what it sends, never by the
    buffer it writes into (gathering into a list of shards and copying is as correct as gathering in place)."""
    who = gathered_unit(sent, {names[id(u)]: u for u in units})
    return "other" if who is None else who


def _both(rank, world_size):
    # Collectives finish late (NaN until wait()), as on a GPU; every all-gather is seen however it is called.
    log = use_counted_collectives(late=True)
    return {"off": _run(rank, world_size, False, False, log), "on": _run(rank, world_size, True, True, log)}


class ReorderedGPT(GPT):
    """GPT whose blocks run in ``self.order`` (a list of block indices; a block left out is skipped)."""

    order: list[int]

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i in self.order:
            x = self.blocks[i](x)
        return self.lm_head(self.ln_f(x))


ORDERS = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0], [3, 2, 1, 0], [3, 2, 1], [3, 2, 1, 0]]
TWICE = [[0, 1, 2, 3, 0]] * 3  # block 0 runs again after block 3, every step


def _reorder(rank, world_size, orders=ORDERS):
    log = use_counted_collectives(late=True)
    torch.manual_seed(0)
    model = ReorderedGPT(CFG)
    root = hand_shard_gpt(model, hooks=6)
    root.shared.prefetch = True
    units = adapters.fsdp_units(model)
    blocks = [b._fsdp_unit for b in model.blocks]
    names = {id(u): ("root" if u.is_root else f"block{blocks.index(u)}") for u in units}
    events = []
    max_unsharded = {}

    def on_collective(call, output, sent):
        if call.kind == "all_gather":
            events.append(("ag", _owner(units, names, sent)))
        now = sum(any(fp.is_unsharded() for fp in u.flat_params) for u in units if not u.is_root)
        max_unsharded[step] = max(max_unsharded.get(step, 0), now)

    def forward_started(i):
        def hook(module, args):
            events.append(("fwd", f"block{i}"))
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(forward_started(i))
    log.listener = on_collective
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    traced, after_backward, unwaited = {}, {}, {}
    for step, order in enumerate(orders):
        model.order = order
        events.clear()
        mark = log.mark()
        idx, tgt = local_batch(CFG, rank, world_size, step)
        optim.zero_grad()
        gpt_loss(model, idx, tgt).backward()
        traced[step] = list(events)
        after_backward[step] = [names[id(u)] for u in units if any(fp.is_unsharded() for fp in u.flat_params)]
        unwaited[step] = [(c["kind"], c["numel"]) for c in log.unwaited(mark)]
        optim.step()
    log.listener = None
    return {"events": traced, "unsharded_after_backward": after_backward, "unwaited_after_backward": unwaited,
            "max_unsharded": max_unsharded,
            "flat": describe_flat_params(model)}
