"""Differential runs: generated small models and training scripts, run through the implementation (``adapters``)
and through PyTorch's own ``torch.distributed.fsdp.fully_shard`` in a separate rank run that imports no student
code; the parent compares what both expose (the comparison, with its tolerances, is in
tests/hidden/test_differential.py, which no rank imports: see tests/hidden/scenarios/__init__.py).

    configs = [generate(seed) for seed in GRADED_SEEDS]          # plain data, the same for every student
    ours = run_ranks(ours_body, W, configs)                       # adapters -> the implementation
    fsdp2 = run_ranks(fsdp2_body, W, configs)                     # torch only
    for cfg, a, b in zip(configs, zip(*ours), zip(*fsdp2)): compare(cfg, a, b)

**Why a seeded generator, not hypothesis.** Each example costs a distributed run (seconds: processes, gloo,
two implementations), so examples must be batched several to a spawn and fixed in advance, and a failing
example cannot be re-run hundreds of times to shrink it. hypothesis gives neither (it drives one test function
call per example and shrinks by re-running). ``random.Random(seed)`` over a feature list gives the same cases
to every student, and ``describe(cfg)`` names the features of a failing case instead of a shrunk example.

**What a generated script has** (each with some probability; ``FEATURES`` lists them): a keyword-argument input
and two inputs that carry gradients, two outputs, a frozen part inside a unit and a wholly frozen unit, a
parameter tied inside a unit, an integer buffer updated in forward and a boolean buffer, fp32, fp64 or bf16
parameters, nested units, a unit run twice in one forward, a loss that skips the root's output, SGD with
momentum or AdamW, ``reshard_after_forward`` off, mixed precision (bf16 compute, fp32 reduction), gradient
accumulation without sync, prefetching switched between iterations, and a full checkpoint saved and loaded
into a fresh model and optimizer in the middle. Issue 25 added: a model built on meta in its dtype (bf16, fp64)
and materialized by ``materialize_meta_module`` (the FSDP2 run builds it eagerly: the values must match), a
block whose only grad-carrying input is keyword-only, a block with two outputs each made by its own layer, a
loss made from a block's output that the root does not return, a floating-point buffer in every block (mixed
precision must not cast it), ``reshard_after_forward`` flipped between iterations (through ``fsdp_units``'
public ``reshard_after_forward``), a frozen tie inside a unit, and a frozen weight tied across two units, which
both implementations must refuse with ``ValueError``. ``configure(seed, **features)`` forces features on or
off: the graded set is chosen to cover every feature, not drawn.

**What is compared** (only what both expose, see the handout's "Checked in every run"): parameters after the
steps (gathered full), the full gradients of the last backward (FSDP2's ``None`` for a parameter without a
gradient equals zeros here: a FlatParameter has one gradient), the inputs' gradients, the loss of every step,
the full model state dict on rank 0 (keys, shapes, dtypes, values; buffers included), the sharded model state
dict's keys and dtypes, the full optimizer state dict (per parameter name: keys and values), and, through the
invariant monitor, the counted collectives and unsharded units of each run against the model.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn as nn
# Imported here, not in the rank body: it loads a shared library (ctypes), which the harness forbids while a
# body runs; a rank imports this module before it starts the body.
import torch.distributed.checkpoint.state_dict  # noqa: F401

FEATURES = ("kwarg_input", "two_outputs", "frozen_part", "frozen_unit", "tie", "nested", "run_twice",
            "aux_only", "no_reshard", "mixed_precision", "accumulate", "prefetch_flip", "checkpoint", "adamw",
            "float64", "bfloat16",
            # issue 25: paths no graded configuration took before
            "meta_init", "kwarg_block", "unit_two_outputs", "bypass_root", "float_buffer", "raf_flip",
            "tie_across_frozen", "frozen_tie")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def generate(seed: int, world_size: int = 2) -> dict:
    """One small model and training script, as plain data (it travels to the ranks)."""
    r = random.Random(seed)
    dtype = r.choices(["float32", "float64", "bfloat16"], weights=[6, 2, 1])[0]
    n_blocks = r.randint(1, 3)
    cfg = {"seed": seed, "world_size": world_size, "dtype": dtype, "n_blocks": n_blocks,
           "dim": r.choice([5, 6, 7, 9]), "in_dim": r.choice([3, 4, 5]), "out_dim": r.choice([2, 3]),
           "batch": r.choice([2, 3]), "steps": 3}
    for f in ("kwarg_input", "two_outputs", "tie", "nested", "run_twice", "frozen_part", "adamw"):
        cfg[f] = r.random() < 0.4
    cfg["frozen_unit"] = n_blocks > 1 and r.random() < 0.3
    cfg["aux_only"] = cfg["two_outputs"] and r.random() < 0.4
    cfg["adamw"] = cfg["adamw"] and not cfg["aux_only"]  # see _optim
    cfg["no_reshard"] = r.random() < 0.2
    # Not with a unit run twice: under bf16 compute the two uses' gradients are summed in another order and
    # precision by each implementation (both correct), and AdamW amplifies that bf16 rounding past the tolerance.
    mixed = dtype == "float32" and r.random() < 0.3  # drawn as before, so that every other seed keeps its script
    cfg["mixed_precision"] = mixed and not cfg["run_twice"]
    cfg["accumulate"] = r.random() < 0.3
    cfg["prefetch_flip"] = r.random() < 0.4
    cfg["checkpoint"] = r.random() < 0.35
    cfg["float64"], cfg["bfloat16"] = dtype == "float64", dtype == "bfloat16"
    # Drawn after the older features, so that every older seed keeps its script.
    cfg["meta_init"] = r.random() < 0.3
    cfg["kwarg_block"] = n_blocks > 1 and r.random() < 0.3
    cfg["unit_two_outputs"] = n_blocks > 1 and not cfg["run_twice"] and r.random() < 0.3
    # Only with the root kept unsharded after forward: no pre-backward of the root re-gathers it for that loss.
    cfg["bypass_root"] = not cfg["two_outputs"] and r.random() < 0.2
    cfg["adamw"] = cfg["adamw"] and not cfg["bypass_root"]  # see _optim
    cfg["float_buffer"] = r.random() < 0.3
    cfg["raf_flip"] = r.random() < 0.3
    cfg["bypass_root"] = cfg["bypass_root"] and cfg["no_reshard"] and not cfg["raf_flip"]
    cfg["tie_across_frozen"] = n_blocks > 1 and r.random() < 0.2
    cfg["frozen_tie"] = cfg["tie"] and r.random() < 0.3
    return cfg


def configure(seed: int, world_size: int = 2, **features) -> dict:
    """``generate(seed)`` with some features forced on or off (the graded set is chosen, not drawn); the dtype
    features (``float64``, ``bfloat16``) set the dtype. Raises if the forced features contradict each other."""
    cfg = generate(seed, world_size)
    cfg.update(features)
    if features.get("float64") or features.get("bfloat16"):
        cfg["dtype"] = "float64" if cfg["float64"] else "bfloat16"
        cfg["float64"], cfg["bfloat16"] = cfg["dtype"] == "float64", cfg["dtype"] == "bfloat16"
    bad = [why for why, wrong in (
        ("aux_only needs two_outputs", cfg["aux_only"] and not cfg["two_outputs"]),
        ("bypass_root excludes two_outputs, needs no_reshard and no raf_flip",
         cfg["bypass_root"] and (cfg["two_outputs"] or not cfg["no_reshard"] or cfg["raf_flip"])),
        ("mixed_precision needs float32 and no run_twice",
         cfg["mixed_precision"] and (cfg["dtype"] != "float32" or cfg["run_twice"])),
        ("unit_two_outputs excludes run_twice", cfg["unit_two_outputs"] and cfg["run_twice"]),
        ("frozen_unit, kwarg_block, unit_two_outputs, tie_across_frozen need 2 blocks or more",
         cfg["n_blocks"] < 2 and (cfg["frozen_unit"] or cfg["kwarg_block"] or cfg["unit_two_outputs"]
                                  or cfg["tie_across_frozen"])),
        ("frozen_tie needs tie", cfg["frozen_tie"] and not cfg["tie"]),
        ("adamw excludes a loss that skips units", cfg["adamw"] and (cfg["aux_only"] or cfg["bypass_root"])),
    ) if wrong]
    if bad:
        raise ValueError(f"seed {seed} with {features}: {bad}")
    return cfg


def describe(cfg: dict) -> str:
    on = [f for f in FEATURES if cfg.get(f)]
    return (f"seed {cfg['seed']} (W={cfg['world_size']}, {cfg['n_blocks']} blocks, dim {cfg['dim']}, {cfg['dtype']}"
            f"{': ' + ', '.join(on) if on else ''})")


# ---- the generated model (plain PyTorch; both runs and the parent build it) ---------------------------------
class GenBlock(nn.Module):
    def __init__(self, dim: int, cfg: dict, first: bool = False, **factory):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim + 1, **factory)
        self.fc2 = nn.Linear(dim + 1, dim, **factory)
        self.norm = nn.LayerNorm(dim, **factory)
        self.tie = cfg["tie"]
        if self.tie:  # a parameter used twice inside one unit
            self.fc3 = nn.Linear(dim + 1, dim, bias=False, **factory)
            self.fc3.weight = self.fc2.weight
        if cfg["nested"]:
            self.inner = nn.Sequential(nn.Linear(dim, dim, **factory), nn.Tanh())
        self.two_outputs = first and cfg["unit_two_outputs"]
        if self.two_outputs:  # a second output, made by its own layer
            self.side = nn.Linear(dim, dim, **factory)
        if cfg["float_buffer"]:  # a floating-point buffer: mixed precision must not cast it
            self.register_buffer("scale", torch.empty(dim, dtype=factory.get("dtype")))
            self.reset_parameters()
        if cfg["frozen_part"]:
            self.fc1.requires_grad_(False)
        if cfg["frozen_tie"]:  # the tie inside the unit is frozen (the unit's frozen FlatParameter holds it)
            self.fc2.weight.requires_grad_(False)

    def reset_parameters(self):  # this module's own state only (meta init calls it): the buffer, no RNG
        if hasattr(self, "scale"):
            with torch.no_grad():
                self.scale.copy_(torch.linspace(0.5, 1.5 + 1 / 3, self.scale.numel()))

    def forward(self, x, *, skip=None):
        if skip is not None:  # kwarg_block: x is a gate without gradient, the activation comes as a keyword
            x = x * skip
        h = torch.tanh(self.fc1(x))
        y = self.fc2(h)
        if self.tie:
            y = y + 0.5 * self.fc3(h)
        if hasattr(self, "inner"):
            y = y + self.inner(x)
        if hasattr(self, "scale"):
            y = y * self.scale.to(y.dtype)
        out = self.norm(x + y)
        return (out, self.side(x)) if self.two_outputs else out


class GenModel(nn.Module):
    def __init__(self, cfg: dict, **factory):
        super().__init__()
        self.cfg = dict(cfg)
        dim = cfg["dim"]
        self.emb = nn.Linear(cfg["in_dim"], dim, **factory)
        self.blocks = nn.ModuleList(GenBlock(dim, cfg, i == 0, **factory) for i in range(cfg["n_blocks"]))
        self.head = nn.Linear(dim, cfg["out_dim"], **factory)
        self.register_buffer("calls", torch.empty((), dtype=torch.int64))      # integer buffer, updated in forward
        self.register_buffer("mask", torch.empty(dim, dtype=torch.bool))       # boolean buffer
        self.reset_parameters()
        if cfg["frozen_unit"]:
            self.blocks[-1].requires_grad_(False)

    def reset_parameters(self):  # this module's own state only (meta init calls it): the buffers, no RNG
        with torch.no_grad():
            self.calls.zero_()
            self.mask.copy_(torch.arange(self.mask.numel()) % 3 != 1)

    def forward(self, x, *, y=None):
        self.calls += 1
        h = self.emb(x)
        if y is not None:
            h = h + y
        aux = side = None
        for i, block in enumerate(self.blocks):
            if self.cfg["kwarg_block"] and i == len(self.blocks) - 1:
                # the last block's only input that carries a gradient is a keyword argument
                h = block((0.5 + 0.5 * self.mask.to(h.dtype)).expand_as(h), skip=h)
            else:
                h = block(h)
            if isinstance(h, tuple):
                h, side = h
            if i == 0:
                aux = h
        # bypass_root: a loss may use this instead of the root's output (run_script), so that autograd never
        # reaches the root's output in that backward
        self.stash = aux
        if self.cfg["run_twice"]:
            h = self.blocks[0](h)
        if side is not None:  # the unit's second output reaches the loss long before its first one
            h = h + 0.5 * side
        out = self.head(h * self.mask)
        return (out, aux) if self.cfg["two_outputs"] else out


def unit_prefixes(cfg: dict) -> list[str]:
    """The units, children before parents: each block's inner unit, each block, the root."""
    out = []
    for i in range(cfg["n_blocks"]):
        if cfg["nested"]:
            out.append(f"blocks.{i}.inner.")
        out.append(f"blocks.{i}.")
    return out + [""]


def build(cfg: dict, device: str = "cpu") -> GenModel:
    """The model, initialized from ``cfg["seed"]``. With ``meta_init`` it is built in its dtype (parameters
    made in bf16/fp64, not cast after an fp32 init), on ``device``: "meta" for the implementation, which then
    materializes it (``materialize_meta_module``, same seed) and must get the eager values bitwise."""
    torch.manual_seed(cfg["seed"])
    if cfg.get("meta_init"):
        with torch.device(device):
            return GenModel(cfg, dtype=DTYPES[cfg["dtype"]])
    return GenModel(cfg).to(DTYPES[cfg["dtype"]])


def batch(cfg: dict, step: int, rank: int):
    """This rank's inputs for ``step`` (x, and y when the script passes a keyword input)."""
    g = torch.Generator().manual_seed(1000 * cfg["seed"] + step)
    n, w, dt = cfg["batch"], cfg["world_size"], DTYPES[cfg["dtype"]]
    x = torch.randn(n * w, cfg["in_dim"], generator=g).to(dt)[rank * n:(rank + 1) * n]
    y = torch.randn(n * w, cfg["dim"], generator=g).to(dt)[rank * n:(rank + 1) * n]
    return x.clone().requires_grad_(True), (y.clone().requires_grad_(True) if cfg["kwarg_input"] else None)


def loss_of(cfg: dict, out, step: int, model=None):
    if cfg.get("bypass_root") and step == 1:  # a block's output the root does not return: never the root's
        return model.stash.float().square().mean()
    if cfg["two_outputs"]:
        out, aux = out
        if cfg["aux_only"] and step == 1:  # this step's loss does not pass through the root's output
            return aux.float().square().mean()
        return out.float().square().mean() + 0.1 * aux.float().sum()
    return out.float().square().mean()


def sync_schedule(cfg: dict) -> list[bool]:
    """Per micro-batch: gradient sync on? With accumulation, step 1 runs an unsynced micro-batch first."""
    return [True, False, True, True] if cfg["accumulate"] else [True, True, True]


# ---- the two APIs --------------------------------------------------------------------------------------------
class Ours:
    """The implementation, through ``adapters`` only."""
    layout = "flat"

    def shard(self, model, cfg):
        import adapters
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg["mixed_precision"] else None
        for prefix in unit_prefixes(cfg):
            module = model.get_submodule(prefix[:-1]) if prefix else model
            adapters.fully_shard(module, reshard_after_forward=not cfg["no_reshard"], mixed_precision=mp)

    def optimizer(self, model, cfg):
        import adapters
        cls, kw = _optim(cfg)
        return adapters.get_sharded_optimizer(model, cls, **kw)

    def set_sync(self, model, flag):
        import adapters
        adapters.set_requires_gradient_sync(model, flag)

    def set_prefetch(self, model, flag):
        import adapters
        adapters.set_prefetch(model, flag)

    def set_reshard_after_forward(self, model, flag):
        import adapters
        for unit in adapters.fsdp_units(model):
            unit.reshard_after_forward = flag

    def materialize(self, model, cfg):
        """A model built on meta (``build(cfg, "meta")``), sharded: materialize it with the seed of eager init."""
        import adapters
        torch.manual_seed(cfg["seed"])
        adapters.materialize_meta_module(model, "cpu")

    def full_params(self, model):
        import adapters
        return {k: v.detach().clone() for k, v in adapters.gather_full_params(model).items()}

    def full_grads(self, model):
        """The sharded gradients as full tensors: gather_full_params with each shard's data swapped for its
        gradient (zeros where there is none)."""
        import adapters
        params = list(model.parameters())
        saved = [p.data for p in params]
        for p in params:
            p.data = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.data)
        try:
            return {k: v.detach().clone() for k, v in adapters.gather_full_params(model).items()}
        finally:
            for p, d in zip(params, saved):
                p.data = d

    def state_dicts(self, model, optim):
        import adapters
        return (adapters.get_model_state_dict(model, full=True), adapters.get_model_state_dict(model, full=False),
                adapters.get_optimizer_state_dict(model, optim, full=True))

    def save(self, model, optim):
        """Full model and optimizer state dicts, made on rank 0 and sent to every rank (each loads them)."""
        import adapters
        from tests.public.common import own_storage  # the test's own transfer: each tensor's own bytes
        box = [own_storage((adapters.get_model_state_dict(model, full=True),
                            adapters.get_optimizer_state_dict(model, optim, full=True)))]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def load(self, model, optim, saved):
        import adapters
        adapters.set_model_state_dict(model, saved[0], full=True)
        adapters.set_optimizer_state_dict(model, optim, saved[1], full=True)


class FSDP2:
    """PyTorch's own FSDP2 and distributed-checkpoint state dicts (imports torch only)."""
    layout = "per_param"

    def shard(self, model, cfg):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg["mixed_precision"] else MixedPrecisionPolicy()
        for prefix in unit_prefixes(cfg):
            module = model.get_submodule(prefix[:-1]) if prefix else model
            fully_shard(module, reshard_after_forward=not cfg["no_reshard"], mp_policy=mp)

    def optimizer(self, model, cfg):
        cls, kw = _optim(cfg)
        return cls(model.parameters(), **kw)

    def set_sync(self, model, flag):
        model.set_requires_gradient_sync(flag)

    def set_prefetch(self, model, flag):
        pass  # FSDP2 prefetches one unit ahead in backward by default; results do not depend on it

    def set_reshard_after_forward(self, model, flag):
        model.set_reshard_after_forward(flag)

    def materialize(self, model, cfg):
        pass  # built eagerly (build(cfg)): the values the implementation's meta init must reproduce

    def full_params(self, model):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}

    def full_grads(self, model):
        return {n: (p.grad.full_tensor().detach().clone() if p.grad is not None
                    else torch.zeros(p.shape, dtype=p.dtype))
                for n, p in model.named_parameters(remove_duplicate=False)}

    def state_dicts(self, model, optim):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=full)
        sharded = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, optim, options=full)
        return msd, sharded, osd

    def save(self, model, optim):
        """A full model state dict (sent to every rank) and the sharded optimizer state dict: DCP cannot load a
        full optimizer state dict into an optimizer that has no state yet."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        box = [_plain(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))]
        dist.broadcast_object_list(box, src=0)
        return box[0], get_optimizer_state_dict(model, optim)

    def load(self, model, optim, saved):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        set_model_state_dict(model, saved[0], options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(model, optim, saved[1])


def _optim(cfg):
    if cfg["aux_only"] or cfg.get("bypass_root"):
        # A step whose loss skips the root's output leaves some parameters without a gradient: FSDP2 gives them
        # None and the optimizer skips them; a FlatParameter gives them zeros, which momentum or weight decay
        # would still move (the handout's intended difference). Plain SGD moves neither.
        return torch.optim.SGD, {"lr": 0.1}
    if cfg["adamw"]:
        return torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-4}
    return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}


def _plain(x):
    """A state dict as plain CPU tensors and numbers (DTensors made local; it travels to the parent)."""
    from torch.distributed.tensor import DTensor
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, DTensor):
        return x.to_local().detach().cpu().clone()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    return x


def run_script(api, cfg: dict, rank: int, log) -> dict:
    """Build, shard, train ``cfg`` with ``api`` under the invariant monitor; return what both APIs expose."""
    from tests.public.monitor import Monitor
    device = "meta" if isinstance(api, Ours) else "cpu"
    rejected = tie_across_rejected(api, cfg) if cfg.get("tie_across_frozen") else None
    model = build(cfg, device)
    mon = Monitor(model, unit_prefixes(cfg), log)
    api.shard(model, cfg)
    if cfg.get("meta_init"):
        api.materialize(model, cfg)
    mon.attach().setting(reshard_after_forward=not cfg["no_reshard"], prefetch=isinstance(api, FSDP2))
    if cfg["mixed_precision"]:
        mon.setting(param_dtype="torch.bfloat16", reduce_dtype="torch.float32")
    optim = api.optimizer(model, cfg)
    losses, input_grads, syncs = [], [], sync_schedule(cfg)
    early = []  # per micro-batch: (reduce-scatters issued before autograd's final callbacks, in the whole backward)
    micro = 0
    for step in range(cfg["steps"]):
        if cfg["checkpoint"] and step == 2:  # save a full checkpoint, load it into a fresh model and optimizer
            saved = api.save(model, optim)
            mon.detach()
            model = build(cfg, device)
            mon = _continue_monitor(mon, model, cfg, log, api)
            api.shard(model, cfg)
            if cfg.get("meta_init"):
                api.materialize(model, cfg)
            mon.attach("after fully_shard of the resumed model")
            optim = api.optimizer(model, cfg)
            api.load(model, optim, saved)
        if cfg["prefetch_flip"] and not isinstance(api, FSDP2):
            api.set_prefetch(model, step % 2 == 1)
            mon.setting(prefetch=step % 2 == 1)
        if cfg.get("raf_flip"):  # reshard_after_forward switched between iterations, both ways
            raf = (step % 2 == 0) != cfg["no_reshard"]
            api.set_reshard_after_forward(model, raf)
            mon.setting(reshard_after_forward=raf)
        optim.zero_grad()
        while True:  # micro-batches of this step: unsynced ones first, then one synced
            sync = syncs[micro]
            api.set_sync(model, sync)
            mon.setting(requires_gradient_sync=sync)
            x, y = batch(cfg, 10 * step + micro, rank)
            out = model(x, y=y) if y is not None else model(x)
            loss = loss_of(cfg, out, step, model)
            start, seen = (log.mark() if log is not None else 0), []
            if log is not None:
                # Where autograd's final callbacks start: a callback queued by the loss's own node, the first to
                # run, is the first of them, ahead of any the implementation queues. Not "when x's gradient is
                # made": an implementation that reduces from a hook on its accumulated gradient (FSDP1's way)
                # reduces the root's right after that, during backward, and is right to.
                engine = torch.autograd.Variable._execution_engine
                first_node = loss.grad_fn.register_prehook(
                    lambda grads: engine.queue_callback(lambda: seen.append(log.mark())))
            mon.backward(loss)
            if log is not None:
                first_node.remove()
                rs = [c["kind"] == "reduce_scatter" for c in log.since(start)]
                early.append((sum(rs[:seen[0] - start]) if seen else None, sum(rs)))
            losses.append(float(loss.detach()))
            input_grads.append([None if t is None or t.grad is None else t.grad.detach().float().clone()
                                for t in (x, y)])
            micro += 1
            if sync:
                break
        grads = api.full_grads(model)
        optim.step()
        mon.after_step()
    msd, ssd, osd = api.state_dicts(model, optim)
    return {"params": api.full_params(model), "grads": grads, "losses": losses, "input_grads": input_grads,
            "model_sd": _plain(msd), "sharded_keys": {k: str(v.dtype) for k, v in ssd.items()},
            "optim_sd": _plain(osd), "monitor": mon.report(), "layout": api.layout, "early_reductions": early,
            "tie_across_rejected": rejected}


def tie_across_rejected(api, cfg) -> str | None:
    """A frozen weight tied across two sibling units (the first and last blocks' fc2), sharded as the script
    shards: the error's type name if sharding (or the first forward and backward) raised one, else None."""
    model = build(dict(cfg, meta_init=False))
    model.blocks[-1].fc2.weight = model.blocks[0].fc2.weight
    model.blocks[0].fc2.weight.requires_grad_(False)
    try:
        api.shard(model, dict(cfg, mixed_precision=False))
        x, y = batch(cfg, 0, dist.get_rank())
        out = model(x, y=y) if y is not None else model(x)
        loss_of(dict(cfg, bypass_root=False), out, 0).backward()
    except Exception as e:  # noqa: BLE001 - which error it is, is the result
        return type(e).__name__
    return None


def _continue_monitor(old, model, cfg, log, api):
    """A monitor for the resumed model that keeps the old one's records (one report for the whole script)."""
    from tests.public.monitor import Monitor
    mon = Monitor(model, unit_prefixes(cfg), log)
    mon.iterations, mon.events, mon.settings = old.iterations, old.events, dict(old.settings)
    return mon


def ours_body(rank, world_size, configs):
    from tests.public.collectives import use_counted_collectives
    log = use_counted_collectives(late=True)
    return [run_script(Ours(), cfg, rank, log) for cfg in configs]


def fsdp2_body(rank, world_size, configs):
    """Imports nothing of the implementation: torch's FSDP2 only. On the plain gloo group: DTensor's functional
    collectives (``full_tensor``, the state dicts) need a C++ backend, which the counting group is not
    (tests/staff/test_invariants.py shows FSDP2 keeps the collective invariants on counted collectives)."""
    return [run_script(FSDP2(), cfg, rank, None) for cfg in configs]
