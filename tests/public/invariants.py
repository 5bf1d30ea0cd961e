"""Parent-side checks of what ``tests/public/monitor.py`` recorded in a rank: the invariants every correct FSDP
run here keeps, whatever the model, the switches or the implementation (yours or PyTorch's ``fully_shard``).

The expected values come from the parent's own unsharded copy of the model, never from the rank. A failure
names the invariant, the unit and the moment (iteration, and the hook or autograd boundary it was seen at):

    unsharded-bound      at every moment of forward and backward, the non-root units whose full parameters
                         exist number at most (depth of nested non-root units) + (1 with prefetching or, for
                         PyTorch's FSDP2, its backward prefetch): one unit (and its parents) at a time, plus
                         one prefetched. Not bounded with ``reshard_after_forward=False``
    forward-gathers      every forward all-gathers each unit's parameters once (each FlatParameter once, with
                         its padded size / W elements), in the parameter dtype (``param_dtype`` if set)
    backward-gathers     a backward all-gathers again exactly the non-root units resharded after forward (the
                         root: once or not at all), nothing when ``reshard_after_forward=False``
    reduce-scatters      a backward with gradient sync reduce-scatters each trainable FlatParameter's padded full
                         gradient once (in ``reduce_dtype`` if set); a backward without it reduces nothing; no
                         all-reduce ever (FSDP needs none)
    reductions-in-flight at every moment the monitor samples, at most one reduce-scatter has been issued and not
                         yet waited on (each keeps a full gradient alive)
    handles-waited       when ``backward()`` returns every asynchronous collective issued in that iteration has
                         been waited on (a prefetched unit that then did not run included): a buffer freed or reused
                         while its collective may still write into it is corrupted memory on a GPU
    freed-after-backward after ``backward()`` returns no unit is unsharded and no original parameter name
                         carries a gradient
    no-full-copies       after sharding and after every step no original ``nn.Parameter`` is alive with its
                         storage, and ``module.parameters()`` holds about 1/W of the model
    dtypes-and-devices   shards keep their parameters' dtype (mixed precision casts the unsharded copy only),
                         gradients have their shard's dtype, buffers keep dtype, device and shape

Lower bounds and order (counted collectives; the units not nested, each run once; from the order of events the
monitor records, deterministic under gloo). They check that a switched-on feature happens, not only that it
stays within bounds, in every iteration with the switches in force *then*:

    forward-prefetch     prefetching on (in this iteration and the one before, which recorded the order): the
                         next unit's all-gather is issued before the current unit's forward ends
    backward-prefetch    prefetching on: in backward, the all-gather of the unit whose backward runs next is
                         issued before the current unit's backward computation ends
    no-early-gathers     prefetching off: no unit is all-gathered before its own pre-forward, nor in backward
                         before the backward of the unit before it has finished (nothing gathered ahead)
    reductions-overlap   prefetching on (this assignment; PyTorch's FSDP2 overlaps with CUDA streams, on a CPU it
                         reduces synchronously): every asynchronous reduce-scatter issued in backward is still in
                         flight at the next moment the backward reaches, i.e. it is waited on only once the next
                         backward computation has begun
"""

from __future__ import annotations

import torch.nn as nn

from tests.public.common import expected_owners


def _unit_layout(model: nn.Module, units: list[str], world_size: int, layout: str) -> dict[str, list[tuple]]:
    """unit -> [(trainable, elements per rank of its all-gather)] for each group it gathers.

    ``flat`` (this assignment): one FlatParameter per kind (trainable, frozen), padded to a multiple of W;
    ``per_param`` (PyTorch's FSDP2): one group per unit, each parameter padded along dim 0."""
    out = {}
    for prefix, own in expected_owners(model, units).items():
        params = list(own.values())
        if layout == "flat":
            groups = []
            for kind in (True, False):
                n = sum(p.numel() for p in params if p.requires_grad == kind)
                if n:
                    groups.append((kind, -(-n // world_size)))
            out[prefix] = groups
        else:
            n = sum(-(-p.shape[0] // world_size) * (p.numel() // max(p.shape[0], 1)) if p.dim() else 1
                    for p in params)
            out[prefix] = [(any(p.requires_grad for p in params), n)] if params else []
    return out


def _depth(units: list[str]) -> int:
    """The longest chain of nested non-root units."""
    non_root = [u for u in units if u]
    return max((sum(u.startswith(a) for a in non_root) for u in non_root), default=0)


def _unit_of(name: str, units: list[str]) -> str | None:
    """The innermost unit (prefix) whose module contains the module ``name``."""
    return max((u for u in units if u == "" or (name + ".").startswith(u)), key=len, default=None)


def _covers(issued: list[int], needed: list[int]) -> bool:
    """Does the multiset of elements per all-gather ``issued`` contain the multiset ``needed``?"""
    left = list(issued)
    for n in needed:
        if n not in left:
            return False
        left.remove(n)
    return True


def _check_order(it: dict, prev: dict | None, groups: dict, moment: str, layout: str) -> None:
    """forward-prefetch, backward-prefetch, no-early-gathers, reductions-overlap on one iteration's trace."""
    s = it["settings"]
    prefetch, raf = bool(s.get("prefetch", False)), s.get("reshard_after_forward", True)
    units = list(groups)
    calls = it["forward_calls"] + it["backward_calls"]
    cut = len(it["forward_calls"])
    trace = it["trace"]
    need = {u: sorted(n for _, n in g) for u, g in groups.items()}

    def gathers(lo: int, hi: int) -> list[int]:  # elements of the all-gathers issued in calls[lo:hi]
        return [c["numel"] for c in calls[lo:hi] if c["kind"] == "all_gather"]

    def label(u: str) -> str:
        return f"'{u or '<root>'}'"

    # ---- forward: the units in the order their forward began, and where each one's forward ended
    trace = [e for e in trace if _unit_of(e[1], units) is not None]
    fwd = [e for e in trace if e[0] in ("pre", "post") and e[2] <= cut]
    order, ends = [], {}
    for kind, name, issued, _ in fwd:
        u = _unit_of(name, units)
        if kind == "pre" and name == (u[:-1] if u else "") and u not in order:
            order.append(u)
        if kind == "post" and name == (u[:-1] if u else "") and u not in ends:
            ends[u] = issued
    prev_order = None
    if prev is not None:
        prev_order = []
        for kind, name, _, _ in prev.get("trace", []):
            u = _unit_of(name, units)
            if u is not None and kind == "pre" and name == (u[:-1] if u else "") and u not in prev_order:
                prev_order.append(u)
    was_on = prev is not None and prev["settings"].get("prefetch", False)
    for k, u in enumerate(order):
        if prefetch and was_on and prev_order == order and k + 1 < len(order) and u in ends:
            wanted = [n for v in order[:k + 2] for n in need[v]]
            got = gathers(0, ends[u])
            assert _covers(got, wanted), (
                f"invariant forward-prefetch: {moment}, forward: when the forward of {label(u)} ended, the "
                f"all-gathers issued were {got} elements per rank; with prefetching on, the next unit in the recorded "
                f"order, {label(order[k + 1])}, must already be gathering ({need[order[k + 1]]}): issue its all-gather "
                f"asynchronously in {label(u)}'s pre-forward, so that it overlaps {label(u)}'s computation")
        if not prefetch:
            start = next(e[2] for e in fwd if e[0] == "pre" and e[1] == (u[:-1] if u else ""))
            allowed = [n for v in order[:k] for n in need[v]]
            got = gathers(0, start)
            assert len(got) <= len(allowed), (
                f"invariant no-early-gathers: {moment}, forward: before {label(u)}'s forward began, {len(got)} "
                f"all-gathers ({got} elements per rank) were issued; with prefetching off each unit is gathered in its "
                f"own pre-forward, so at most the {len(allowed)} of the units that ran before it ({allowed})")
    if not raf:
        return
    # ---- backward: the units in the order their backward began (first gradient seen inside them)
    grads = [(name, issued, inflight, _unit_of(name, units))
             for kind, name, issued, inflight in trace if kind == "grad"]
    border = []
    for _, _, _, u in grads:
        if u not in border:
            border.append(u)
    gathered = gathers(cut, len(calls))
    must = sorted(n for u in units if u for n in need[u])
    root_too = _covers(gathered, must + need.get("", []))
    bneed = {u: (need[u] if u or root_too else []) for u in border}

    def begun(pos: int) -> list[str]:  # the units with a gradient seen at or before grads[pos]
        return list(dict.fromkeys(g[3] for g in grads[:pos + 1]))

    for k, u in enumerate(border):
        mine = [j for j, g in enumerate(grads) if g[3] == u]
        inner = [j for j in mine if grads[j][0] != (u[:-1] if u else "")]
        if prefetch and k + 1 < len(border) and inner:
            at = inner[-1]
            ahead = list(dict.fromkeys(begun(at) + [border[k + 1]]))
            wanted = [n for v in ahead for n in bneed[v]]
            got = gathers(cut, grads[at][1])
            assert _covers(got, wanted), (
                f"invariant backward-prefetch: {moment}, backward: at the last gradient inside {label(u)} "
                f"('{grads[at][0]}'), the backward all-gathers issued were {got} elements per rank; with prefetching "
                f"on, {label(border[k + 1])}, whose backward runs next, must already be gathering "
                f"({bneed[border[k + 1]]}): issue its all-gather in {label(u)}'s pre-backward, so that it overlaps "
                f"{label(u)}'s backward computation")
        if not prefetch:
            at = mine[-1]
            allowed = [n for v in begun(at) for n in bneed[v]]
            got = gathers(cut, grads[at][1])
            assert len(got) <= len(allowed), (
                f"invariant no-early-gathers: {moment}, backward: at the last gradient inside {label(u)} "
                f"('{grads[at][0]}'), {len(got)} backward all-gathers ({got} elements per rank) were issued; with "
                f"prefetching off a unit is gathered in its own pre-backward, so at most those of the units whose "
                f"backward has begun ({allowed}): a backward prefetch ran although prefetching is off")
    if not prefetch or layout != "flat" or not s.get("requires_gradient_sync", True):
        return
    for r in range(cut, len(calls)):
        if calls[r]["kind"] != "reduce_scatter":
            continue
        later = next((g for g in grads if g[1] > r), None)
        if later is not None:
            assert r in later[2], (
                f"invariant reductions-overlap: {moment}, backward: the reduce-scatter of {calls[r]['numel']} elements "
                f"(async_op={calls[r]['async_op']}) had already been waited on when the backward reached the next "
                f"gradient ('{later[0]}'); with prefetching on it is asynchronous and waited on only once the next "
                f"unit's backward has begun (when the next reduce-scatter is issued, or at the end of backward), so "
                f"that it overlaps that computation")


def check_monitor(report: dict, model: nn.Module, world_size: int, where: str, *, layout: str = "flat",
                  collectives: bool = True, bounded: bool = True) -> None:
    """Check every invariant above on one rank's ``Monitor.report()``, against the parent's ``model`` (as it
    was before sharding: same names, same ``requires_grad``). ``collectives=False`` leaves out the three
    collective invariants and the order ones, for scripts whose forward runs a unit twice or whose loss skips some units (each
    correct implementation may then gather or reduce differently). ``bounded=False`` leaves out the bound on
    unsharded units (the differential runs use it for a unit run twice with prefetching)."""
    units = report["units"]
    groups = _unit_layout(model, units, world_size, layout)
    depth = _depth(units)
    assert report["iterations"], f"{where}: the monitor saw no iteration (the root's forward never ran)"
    nested = depth > 1
    for i, it in enumerate(report["iterations"]):
        s = it["settings"]
        moment = f"{where}, iteration {i} ({', '.join(f'{k}={v}' for k, v in sorted(s.items())) or 'defaults'})"
        raf = s.get("reshard_after_forward", True)
        sync = s.get("requires_gradient_sync", True)
        if raf and bounded:
            bound = depth + (1 if s.get("prefetch", False) else 0)
            for when, unsharded in it["samples"]:
                non_root = [u for u in unsharded if u]
                assert len(non_root) <= bound, (
                    f"invariant unsharded-bound: {moment}, {when}: {len(non_root)} non-root units unsharded "
                    f"{non_root}; at most {bound} may be (one unit and its parents at a time"
                    f"{', plus one prefetched' if s.get('prefetch') else ''})")
        inflight = it.get("max_reductions_in_flight", 0)
        assert inflight <= 1, (
            f"invariant reductions-in-flight: {moment}: {inflight} reduce-scatters were in flight at once (issued, "
            f"not yet waited on); at most one may be: each keeps a full unsharded gradient alive until it is waited on")
        ab = it["after_backward"]
        assert not ab.get("unwaited"), (
            f"invariant handles-waited: {moment}, after backward: asynchronous collectives never waited on: "
            f"{[(c['kind'], c['numel']) for c in ab['unwaited']]}. Wait on every handle before its buffer is used, "
            f"freed or reused (a unit prefetched that then does not run included): on a GPU the collective may "
            f"still be writing into that memory")
        assert not ab["unsharded"], (f"invariant freed-after-backward: {moment}, after backward: units "
                                     f"{ab['unsharded']} still hold their full parameters")
        assert not ab["full_grads"], (f"invariant freed-after-backward: {moment}, after backward: original "
                                      f"parameters {ab['full_grads'][:4]} carry a full gradient")
        if not (report["counted"] and collectives):
            continue
        expected_gathers = sorted(n for g in groups.values() for _, n in g)
        fwd = [c for c in it["forward_calls"] if c["kind"] != "barrier"]
        got = sorted(c["numel"] for c in fwd if c["kind"] == "all_gather")
        others = [c["kind"] for c in fwd if c["kind"] != "all_gather"]
        assert not others, f"invariant forward-gathers: {moment}, forward: communicated {others}; only all-gathers"
        assert got == expected_gathers, (
            f"invariant forward-gathers: {moment}, forward: all-gathers of {got} elements per rank; expected each "
            f"unit's parameters once: {_by_unit(groups)}")
        if s.get("param_dtype"):
            bad = {c["dtype"] for c in fwd} - {s["param_dtype"]}
            assert not bad, f"invariant forward-gathers: {moment}: all-gathers in {bad}, param_dtype={s['param_dtype']}"
        bwd = [c for c in it["backward_calls"] if c["kind"] != "barrier"]
        gathered = sorted(c["numel"] for c in bwd if c["kind"] == "all_gather")
        must = sorted(n for u, g in groups.items() if u and raf for _, n in g)
        root = sorted(n for _, n in groups.get("", [])) if raf else []
        ok = gathered in (must, sorted(must + root))
        assert ok, (f"invariant backward-gathers: {moment}, backward: all-gathers of {gathered} elements per rank; "
                    f"expected the units resharded after forward once each: {must} (the root's {root} allowed)")
        if not nested and "trace" in it:
            _check_order(it, report["iterations"][i - 1] if i else None, groups, moment, layout)
        reduced = [c for c in bwd if c["kind"] not in ("all_gather",)]
        if not sync:
            assert not reduced, (f"invariant reduce-scatters: {moment}, backward without gradient sync: it "
                                 f"communicated {[(c['kind'], c['numel']) for c in reduced]}; nothing may be reduced")
            continue
        # At W=1 an all-reduce moves what a reduce-scatter moves (nothing): only a label would tell them apart.
        reduction = {"reduce_scatter", "all_reduce"} if world_size == 1 else {"reduce_scatter"}
        kinds = sorted({c["kind"] for c in reduced} - reduction)
        assert not kinds, f"invariant reduce-scatters: {moment}, backward: {kinds} issued; FSDP reduces by reduce-scatter"
        got = sorted(c["numel"] for c in reduced)
        expected = sorted(n * world_size for g in groups.values() for trainable, n in g if trainable)
        assert got == expected, (
            f"invariant reduce-scatters: {moment}, backward: reduce-scatters of {got} elements; expected each "
            f"trainable unit's padded full gradient once: {expected}")
        if s.get("reduce_dtype"):
            bad = {c["dtype"] for c in reduced} - {s["reduce_dtype"]}
            assert not bad, f"invariant reduce-scatters: {moment}: reduce-scatters in {bad}, reduce_dtype={s['reduce_dtype']}"
    dtypes = {str(p.dtype) for p in model.parameters()}
    shard_total = sum(n for g in groups.values() for _, n in g)
    buffers = {n: (str(b.dtype), str(b.device), list(b.shape)) for n, b in model.named_buffers()}
    for e in report["events"]:
        moment = f"{where}, {e['moment']}"
        assert not e["originals_alive"], (
            f"invariant no-full-copies: {moment}: the original parameters {e['originals_alive'][:4]} are still alive "
            f"with their full storage; after sharding only the shards may hold parameter memory")
        assert sum(e["param_numels"]) == shard_total, (
            f"invariant no-full-copies: {moment}: module.parameters() holds {sum(e['param_numels'])} elements; the "
            f"shards of the model hold {shard_total} ({_by_unit(groups)})")
        bad = sorted(set(e["param_dtypes"]) - dtypes)
        assert not bad, (f"invariant dtypes-and-devices: {moment}: shards in {bad}; the model's parameters are "
                         f"{sorted(dtypes)} (mixed precision casts only the unsharded copy)")
        for pd, gd in zip(e["param_dtypes"], e["grad_dtypes"]):
            assert gd is None or gd == pd, (f"invariant dtypes-and-devices: {moment}: a {pd} shard has a {gd} "
                                            f"gradient; a gradient has its parameter's dtype")
        got_buffers = {k: [v[0], v[1], list(v[2])] for k, v in e["buffers"].items()}
        assert got_buffers == {k: [v[0], v[1], v[2]] for k, v in buffers.items()}, (
            f"invariant dtypes-and-devices: {moment}: buffers (dtype, device, shape) {e['buffers']}; expected "
            f"{buffers}")


def _by_unit(groups: dict) -> str:
    return ", ".join(f"'{u or '<root>'}': {[n for _, n in g]}" for u, g in groups.items())
