"""The invariant monitor: what any correct FSDP run here looks like, observed from outside the implementation
(rank-side test code, like ``collectives.py``; it records, it never decides).

    from tests.public.monitor import Monitor

    def _body(rank, world_size):
        log = use_counted_collectives(late=True)
        model = GPT(cfg)
        mon = Monitor(model, ["blocks.0.", "blocks.1.", ""], log)   # BEFORE sharding: the unit names, children first
        shard(model)                                               # adapters.fully_shard / hand_shard / torch's fully_shard
        mon.attach("after fully_shard")                            # after sharding: hooks on, first records
        for step in range(steps):
            optim.zero_grad()
            mon.backward(gpt_loss(model, idx, tgt))                # marks forward/backward, samples after it
            optim.step()
            mon.after_step()
        return {"monitor": mon.report()}                           # plain data: the parent checks it

and in the parent: ``tests.public.invariants.check_monitor(report, model, units, world_size, where)``.

What it records, and only through what a user of FSDP can see (module attributes, ``module.parameters()``,
collectives counted by ``collectives.py``, weak references it took itself):

* **reduce-scatters in flight** (issued, handle not yet waited on) at each of those moments, the most of them;
* **unsharded units** at every moment it can see: before and after every module's forward (a global module
  hook, so every unit's hooks are bracketed) and at autograd's node boundaries in backward (a hook on every
  module output that carries a gradient, which runs when the gradient of that output is ready, i.e. just
  before that module's backward). A unit counts as unsharded when one of its original parameter names
  points at a plain tensor (not a DTensor shard) whose storage holds that parameter's full size;
* **collectives per iteration**, split into the forward (the root's forward) and the backward (from the end
  of the forward to ``backward`` returning), by kind and elements per rank;
* **after backward**: which units are still unsharded, which original parameter names carry a ``.grad``, and
  which asynchronous collectives were issued and never waited on (``collectives.py``'s late handles);
* **after sharding and after every step**: whether the original ``nn.Parameter`` objects (weakly referenced
  before sharding) are still alive with their storage, the elements and dtypes of ``module.parameters()``, the
  dtypes of their gradients and the dtypes and devices of every buffer;
* **switches**: what the test set before each iteration (``mon.setting(...)``), so that the parent checks
  each iteration against the switches in force *then*, not only before the first iteration;
* **the order of events** (on counted collectives): at each of those moments, which kind of moment it was
  (``pre``/``post`` forward, ``grad`` in backward) at which module, how many collectives this iteration had
  issued by then, and which of its reduce-scatters were in flight. With the collectives' own issue order this
  says whether a unit was gathered ahead of its own hooks (prefetch) and whether a reduce-scatter overlapped
  the next unit's backward. Deterministic under gloo: it is the order of the rank's own calls.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten


try:  # torch's FSDP2 keeps sharded parameters as DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()


def _owned_names(model: nn.Module, unit_prefixes: list[str]) -> dict[str, list[str]]:
    """unit prefix -> full names (relative to ``model``) of the parameters it owns, every alias included."""
    taken: set[int] = set()
    out: dict[str, list[str]] = {}
    for prefix in unit_prefixes:
        module = model.get_submodule(prefix[:-1]) if prefix else model
        mine = {id(p) for _, p in module.named_parameters(remove_duplicate=False)} - taken
        out[prefix] = [prefix + n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in mine]
        taken |= mine
    return out


def _resolve(model: nn.Module, name: str):
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def _storage_bytes(t) -> int:
    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return 0
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank stores for ``p``: its own numel, or for a DTensor shard its padded local storage."""
    if isinstance(p, DTensor):
        local = p.to_local()
        return local.untyped_storage().nbytes() // local.element_size()
    return int(p.numel())


class Monitor:
    def __init__(self, model: nn.Module, unit_prefixes: list[str], log=None):
        self.model, self.units, self.log = model, list(unit_prefixes), log
        self.owned = _owned_names(model, self.units)
        self.numel = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
        self.originals = [(n, weakref.ref(p)) for n, p in model.named_parameters()]
        self.modules = {id(m): n for n, m in model.named_modules()}
        self.iterations: list[dict] = []
        self.events: list[dict] = []     # after sharding / after each step
        self.settings: dict = {}
        self._handles: list = []
        self._it: dict | None = None
        self._depth = 0

    # ---- probes ------------------------------------------------------------------------------------------
    def unsharded_units(self) -> list[str]:
        """The units (prefixes) one of whose original parameter names points at full-size storage now."""
        out = []
        for prefix, names in self.owned.items():
            for name in names:
                owner, attr = _resolve(self.model, name)
                t = getattr(owner, attr, None)
                if _storage_bytes(t) and _storage_bytes(t) >= self.numel[name] * t.element_size():
                    out.append(prefix)
                    break
        return out

    def _sample(self, moment: str, kind: str = "", name: str = "") -> None:
        if self._it is not None:
            self._it["samples"].append((moment, self.unsharded_units()))
            if self.log is not None:  # reduce-scatters of this iteration issued and not yet waited on
                mark = self._it["mark"]
                inflight = [c["index"] - mark for c in self.log.unwaited(mark) if c["kind"] == "reduce_scatter"]
                self._it["max_reductions_in_flight"] = max(self._it.get("max_reductions_in_flight", 0),
                                                           len(inflight))
                # (kind, module, collectives issued so far in this iteration, reduce-scatters in flight)
                self._it["trace"].append((kind, name, self.log.mark() - mark, inflight))

    def _state(self, moment: str) -> dict:
        alive = []
        for name, ref in self.originals:
            p = ref()
            if p is not None and _storage_bytes(p) >= p.numel() * p.element_size() and p.numel() > 0:
                alive.append(name)
        params = list(self.model.parameters())
        return {"moment": moment, "originals_alive": alive,
                "param_numels": [_local_numel(p) for p in params],
                "param_dtypes": [str(p.dtype) for p in params],
                "param_devices": [str(p.device) for p in params],
                "grad_dtypes": [None if p.grad is None else str(p.grad.dtype) for p in params],
                "buffers": {n: (str(b.dtype), str(b.device), list(b.shape)) for n, b in self.model.named_buffers()}}

    # ---- hooks -------------------------------------------------------------------------------------------
    def attach(self, moment: str = "after fully_shard") -> "Monitor":
        """Start watching (after sharding): global module hooks, filtered to this model's modules."""
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = nn.modules.module.register_module_forward_hook(self._post)
        self._handles += [pre, post]
        self.events.append(self._state(moment))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _name(self, module) -> str | None:
        return self.modules.get(id(module))

    def _pre(self, module, args):
        name = self._name(module)
        if name is None:
            return
        if name == "" and self._depth == 0:  # the root's forward: a new iteration
            self._it = {"settings": dict(self.settings), "samples": [], "trace": [],
                        "mark": self.log.mark() if self.log is not None else 0}
            self.iterations.append(self._it)
        self._depth += name == ""
        self._sample(f"before forward of '{name or '<root>'}'", "pre", name)

    def _post(self, module, args, output):
        name = self._name(module)
        if name is None or self._it is None:
            return
        self._sample(f"after forward of '{name or '<root>'}'", "post", name)
        label = f"backward boundary at the output of '{name or '<root>'}'"
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, label=label, name=name: self._sample(label, "grad", name))
        if name == "":
            self._depth -= 1
            if self._depth == 0 and self.log is not None:
                self._it["forward_end"] = self.log.mark()

    # ---- the test's calls --------------------------------------------------------------------------------
    def setting(self, **kwargs) -> None:
        """Record the switches the test sets for the following iterations (reshard_after_forward, prefetch,
        requires_gradient_sync), as the test sets them."""
        self.settings.update(kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then record what the backward communicated and what it left behind."""
        loss.backward()
        it = self._it
        if it is None:
            return
        self._sample("after backward")
        if self.log is not None:
            calls = self.log.since(it["mark"])
            cut = it.get("forward_end", self.log.mark()) - it["mark"]
            it["forward_calls"], it["backward_calls"] = calls[:cut], calls[cut:]
        grads = []
        for names in self.owned.values():
            for name in names:
                owner, attr = _resolve(self.model, name)
                t = getattr(owner, attr, None)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.grad is not None:
                    grads.append(name)
        # this iteration's own: a handle left unwaited by an earlier run on the same log was reported there
        unwaited = self.log.unwaited(it["mark"]) if self.log is not None else []
        it["after_backward"] = {"unsharded": self.unsharded_units(), "full_grads": grads, "unwaited": unwaited}
        del it["mark"]
        self._it = None

    def after_step(self, moment: str | None = None) -> None:
        self.events.append(self._state(moment or f"after step {len(self.iterations)}"))

    def report(self) -> dict:
        """Everything recorded, as plain data (it travels to the parent)."""
        self.detach()
        its = [{k: v for k, v in it.items() if k != "mark"} for it in self.iterations]
        return {"units": self.units, "iterations": its, "events": self.events,
                "counted": self.log is not None}
