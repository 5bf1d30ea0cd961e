"""Task 7 hidden scenarios: what runs in the ranks (see tests/hidden/scenarios/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, TiedModel, gpt_loss
from tests.public.collectives import use_counted_collectives
from tests.public.common import describe_flat_params, local_batch


CFG = GPTConfig()


SGD = dict(lr=0.1, momentum=0.9)


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
    # output_dtype: honoured (the output cast to it, as FSDP2 does) or refused naming it; never ignored.
    try:
        torch.manual_seed(0)
        cast_out = torch.nn.Sequential(torch.nn.Linear(5, 3))
        adapters.fully_shard(cast_out, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                            output_dtype=torch.float32))
        out["output_dtype_policy"] = str(cast_out(x).dtype)
    except NotImplementedError as e:
        if "output_dtype" not in str(e):
            raise
        out["output_dtype_policy"] = "refused"
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


GPT_UNITS = [f"blocks.{i}." for i in range(CFG.n_layer)] + [""]
# reshard_after_forward per iteration, flipped on every unit between micro-batches: in effect in the very next one
RESHARD = [True, False, False, True]


def _accumulate(rank, world_size, steps, micro_batches):
    from tests.public.monitor import Monitor
    log = use_counted_collectives(late=True)  # every collective, however it is called
    torch.manual_seed(0)
    model = GPT(CFG)
    mon = Monitor(model, GPT_UNITS, log)  # the invariant monitor, checked in the parent
    _shard_gpt(model)
    mon.attach()
    adapters.set_prefetch(model, True)
    optim = adapters.get_sharded_optimizer(model, torch.optim.SGD, **SGD)
    early = []
    for step in range(steps):
        optim.zero_grad()
        for micro in range(micro_batches):
            sync = micro == micro_batches - 1
            adapters.set_requires_gradient_sync(model, sync)
            raf = RESHARD[(step * micro_batches + micro) % len(RESHARD)]
            for unit in adapters.fsdp_units(model):
                unit.reshard_after_forward = raf
            mon.setting(prefetch=True, requires_gradient_sync=sync, reshard_after_forward=raf)
            idx, tgt = local_batch(CFG, rank, world_size, step * micro_batches + micro)
            before = log.mark()
            mon.backward(gpt_loss(model, idx, tgt))
            if not sync:
                # Re-gathering parameters is expected; communicating gradients is not.
                early += [(step, micro, c["kind"]) for c in log.since(before)
                          if c["kind"] not in ("all_gather", "barrier")]
        optim.step()
        mon.after_step()
    return {"params": adapters.gather_full_params(model), "early": early, "monitor": mon.report()}


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


# case -> (model, the units applied first, the unit whose fully_shard must be rejected: a tie across units)
TIE_CASES = {
    "sibling head, then embed": (TiedModel, lambda m: [m.head], lambda m: m.embed),
    "child head, then the parent": (TiedModel, lambda m: [m.head], lambda m: m),
    "GPT lm_head, then wte": (lambda: GPT(CFG), lambda m: [*m.blocks, m.lm_head], lambda m: m.wte),
}


def _ties_across_units(rank, world_size):
    out = {}
    for case, (make, firsts, second) in TIE_CASES.items():
        model = make()
        for module in firsts(model):
            adapters.fully_shard(module)
        try:
            adapters.fully_shard(second(model))
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out
