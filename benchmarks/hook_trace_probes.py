"""The checks behind ``benchmarks/hook_trace.py``'s ``--show-*`` options: the artefacts the writeup asks for, made by
the tool instead of a script of your own. Each runs inside a rank, on the model the scenario traced, reaching your
implementation through ``adapters.py`` only; ``report_probes`` renders what they return, in the parent.

    --show-rng               (meta scenario) after materialize_meta_module, each module's parameters and buffers
                             against eager init under the same seed: torch.equal per tensor
    --show-state-dict-peaks  after one AdamW step, the bytes each rank allocates while your code builds the full
                             and the sharded state dicts of the model and the optimizer (LiveStorageTracker)
    --show-dtypes            (with --mixed-precision) per unit, the dtypes of what is gathered, of the parameters
                             and input its forward sees, of their gradients, of what is reduce-scattered and of
                             the gradient the shard holds after backward

A check that raises is reported as such (not implemented yet, or the error), under the trace it follows.
"""

from __future__ import annotations

import traceback

MIB = 2**20


# ---- inside a rank ----------------------------------------------------------------------------------------
def run_probe(fn, *args) -> dict:
    """``fn(*args)``'s dict with end="ok", or how it stopped: a check that fails never hides the trace."""
    try:
        out = fn(*args)
        out.setdefault("end", "ok")
        return out
    except NotImplementedError as err:
        return {"end": "not implemented", "error": str(err)[:400]}
    except Exception as err:
        return {"end": "error", "error": f"{type(err).__name__}: {err}"[:800],
                "traceback": "".join(traceback.format_exception(err)[-4:])[-2000:]}


def rng_check(model, make_eager, seed: int = 0) -> dict:
    """Each module's parameters (full, from ``adapters.gather_full_params``) and buffers after
    materialize_meta_module, against the same model built eagerly on the CPU after ``torch.manual_seed(seed)``
    (the seed the scenario materialised under). The global RNG is left as it was."""
    import torch

    import adapters

    full = adapters.gather_full_params(model)
    buffers = dict(model.named_buffers())
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        eager = make_eager()
    finally:
        torch.random.set_rng_state(state)
    rows, first_name = [], {}  # id(eager tensor) -> its first name: a tied weight is listed under each module
    for path, module in eager.named_modules():
        owned = [("parameter", n, t) for n, t in module.named_parameters(recurse=False)] + \
                [("buffer", n, t) for n, t in module.named_buffers(recurse=False)]
        for kind, attr, ref in owned:
            name = f"{path}.{attr}" if path else attr
            got = full.get(name) if kind == "parameter" else buffers.get(name)
            row = {"module": path or "<root>", "tensor": attr, "kind": kind, "shape": list(ref.shape), "equal": False}
            if got is None:
                row["note"] = "not found in the materialised model" + (" (gather_full_params)" if kind == "parameter"
                                                                       else "")
            elif got.shape != ref.shape or got.dtype != ref.dtype:
                row["note"] = f"materialised as {list(got.shape)} {got.dtype}, eager {list(ref.shape)} {ref.dtype}"
            else:
                got = got.detach().cpu()
                row["equal"] = bool(torch.equal(got, ref.detach()))
                if not row["equal"]:
                    row["note"] = f"max |diff| {float((got.double() - ref.detach().double()).abs().max()):.3g}"
            if id(ref) in first_name:
                row["note"] = (row.get("note", "") + "; " if row.get("note") else "") + f"tied to {first_name[id(ref)]}"
            first_name.setdefault(id(ref), name)
            rows.append(row)
    return {"seed": seed, "rows": rows}


def state_dict_peaks(model, loss_of, step: int) -> dict:
    """One AdamW step (so the optimizer has its state), then for full=True and full=False: the peak and the held
    bytes of the storages allocated while your code builds the model's state dict, then the optimizer's (the
    model's dict still held), as ``fsdp_assignment/support/memory.py``'s LiveStorageTracker counts them, over what
    the rank held before (its shards and the optimizer's state, tracked first: a view of them costs nothing)."""
    import torch

    import adapters
    from fsdp_assignment.support.memory import LiveStorageTracker

    optimizer = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-3)
    loss_of(step).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {}
    for full in (True, False):
        with LiveStorageTracker(device="cpu") as mem:
            # what the rank already holds (its shards, the optimizer's state) counts from here on, so a view of it
            # in a state dict is not a new storage: the figures below are what building the dicts adds
            mem.track(model, label="model")
            mem.track(optimizer, label="optimizer")
            base = mem.current_bytes
            mem.reset_peak()
            model_sd = adapters.get_model_state_dict(model, full=full)
            model_peak, model_held = mem.peak_bytes - base, _settled_bytes(mem) - base
            optim_sd = adapters.get_optimizer_state_dict(model, optimizer, full=full)
            out["full" if full else "sharded"] = {
                "model_peak": model_peak, "model_held": model_held, "peak": mem.peak_bytes - base,
                "held": _settled_bytes(mem) - base, "already_held": base}
        del model_sd, optim_sd
    return out


def _settled_bytes(mem, quiet_s: float = 0.3, limit_s: float = 5.0) -> int:
    """The tracker's live bytes once nothing more has been freed for ``quiet_s``: held means still referenced.
    gc.collect() each time (a reference cycle is not a reference anyone holds), and a wait because gloo's worker
    thread drops its reference to a collective's buffers a moment after ``wait()`` returns: under load, after a
    first reading (CI once read one unit's gathered buffer, 71,400 bytes, still alive)."""
    import gc
    import time

    gc.collect()
    last, steady_since, give_up = mem.current_bytes, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - steady_since < quiet_s and time.monotonic() < give_up:
        time.sleep(0.02)
        gc.collect()
        now = mem.current_bytes
        if now != last:
            last, steady_since = now, time.monotonic()
    return last


class DtypeWatch:
    """--show-dtypes: per unit, the dtypes its forward sees (the parameters it owns, read from the modules as
    forward reads them, and the input after your pre-forward hooks), the dtypes of those parameters' gradients
    as autograd makes them, and of each FlatParameter's ``.grad`` after backward. It wraps the unit module's
    ``forward`` (so it runs after every pre-forward hook, yours included) and puts a hook on each parameter
    tensor that requires a gradient; nothing of your code is changed."""

    KEYS = ("params", "input", "grads", "shard_grad")

    def __init__(self, model, units: dict, param_names: dict):
        self.seen = {label: {k: set() for k in self.KEYS} for label in units}
        self.units = units
        prefixes = {label: ("" if label == "<root>" else label) for label in units}
        owner = {}  # module path -> the unit that owns its parameters: the deepest unit module above it
        for path in param_names:
            above = [label for label, pre in prefixes.items()
                     if pre == "" or path == pre or path.startswith(pre + ".")]
            if above:
                owner[path] = max(above, key=lambda label: len(prefixes[label]))
        for label, unit in units.items():
            owned = [(model.get_submodule(path), attr) for path, attrs in param_names.items()
                     if owner.get(path) == label for attr, _ in attrs]
            self._wrap(unit.module, label, owned)

    def _wrap(self, module, label: str, owned: list) -> None:
        import functools

        import torch

        inner = module.forward
        seen = self.seen[label]

        def note_grad(grad):
            seen["grads"].add(str(grad.dtype).replace("torch.", ""))

        @functools.wraps(inner)
        def watched(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    seen["input"].add(str(value.dtype).replace("torch.", ""))
            for mod, attr in owned:
                t = getattr(mod, attr, None)
                if isinstance(t, torch.Tensor):
                    seen["params"].add(str(t.dtype).replace("torch.", ""))
                    if t.requires_grad and torch.is_grad_enabled():
                        t.register_hook(note_grad)
            return inner(*args, **kwargs)

        module.forward = watched  # an instance attribute: nn.Module.__call__ calls it after every pre-hook

    def after_backward(self) -> None:
        """The gradient each FlatParameter's shard holds after backward: ``shard.grad`` (or the FlatParameter's own
        ``.grad`` where it is itself the shard's tensor)."""
        for label, unit in self.units.items():
            for fp in unit.flat_params:
                grad = getattr(getattr(fp, "shard", None), "grad", None)
                grad = grad if grad is not None else getattr(fp, "grad", None)
                if grad is not None:
                    self.seen[label]["shard_grad"].add(str(grad.dtype).replace("torch.", ""))

    def result(self) -> dict:
        return {label: {k: sorted(v) for k, v in seen.items()} for label, seen in self.seen.items()}


# ---- in the parent: the tables ----------------------------------------------------------------------------
def _bytes(n) -> str:
    return "n/a" if n is None else f"{n:,} B ({n / 1024:.1f} KiB)" if n < MIB else f"{n:,} B ({n / MIB:.2f} MiB)"


def _stopped(name: str, probe: dict) -> list[str]:
    if probe.get("end") == "not implemented":
        return [f"{name}: NOT IMPLEMENTED YET: {probe['error']}"]
    return [f"{name}: FAILED: {probe.get('error')}", probe.get("traceback", "")]


def _rng_lines(results: list[dict]) -> list[str]:
    probe = results[0]["probes"]["rng"]
    if probe.get("end") != "ok":
        return _stopped("--show-rng", probe)
    rows = probe["rows"]
    lines = [f"--show-rng (rank 0): after materialize_meta_module, each module's parameters (gathered full) and "
             f"buffers against eager init under the same seed (torch.manual_seed({probe['seed']}), then the model "
             "built on the CPU); torch.equal per tensor:",
             f"  {'module':<24} {'tensor':<10} {'kind':<10} {'shape':<12} torch.equal"]
    for r in rows:
        lines.append(f"  {r['module']:<24} {r['tensor']:<10} {r['kind']:<10} {str(r['shape']):<12} "
                     f"{r['equal']}" + (f"  ({r['note']})" if r.get("note") else ""))
    differ = sorted({r["module"] for r in rows if not r["equal"]}, key=[r["module"] for r in rows].index)
    lines.append(f"  {sum(r['equal'] for r in rows)} of {len(rows)} tensors equal"
                 + (f"; modules whose values differ from eager init: {', '.join(differ)}" if differ else
                    ": every module drew what eager init drew"))
    for r in results[1:]:
        other = r["probes"]["rng"]
        same = other.get("end") == "ok" and [x["equal"] for x in other["rows"]] == [x["equal"] for x in rows]
        lines.append(f"  rank {r['rank']}: " + ("the same" if same else "DIFFERS: " + (
            ", ".join(f"{x['module']}.{x['tensor']} {x['equal']}" for x in other.get("rows", []))
            or other.get("error", "?"))))
    return lines


def _peak_lines(results: list[dict]) -> list[str]:
    sizes = results[0].get("sizes") or {}
    psi, psi_t, w = sizes.get("psi"), sizes.get("psi_trainable"), len(results)
    lines = ["--show-state-dict-peaks: after one AdamW step, the bytes of tensor storage your code allocates while it "
             "builds the model's state dict, then the optimizer's (the model's still held), per rank, as "
             "LiveStorageTracker counts them, over what the rank held before (its shards and the optimizer's state: "
             "a view of them costs nothing); held = still allocated once both dicts are built."]
    if psi is not None:
        lines.append(f"  the traced model: Psi = {psi:,} parameters ({psi_t:,} trainable); 4 Psi = {_bytes(4 * psi)} "
                     f"(fp32 parameters), 8 Psi_t = {_bytes(8 * psi_t)} (AdamW's two moments); a rank's shard of "
                     f"them at W = {w}: {_bytes(4 * psi // w)} and {_bytes(8 * psi_t // w)}")
    lines.append(f"  {'rank':<5} {'state dict':<11} {'peak, model + optimizer':<32} {'peak, model alone':<30} "
                 "held after")
    for r in results:
        probe = r["probes"]["peaks"]
        if probe.get("end") != "ok":
            lines += ["  " + x for x in _stopped(f"rank {r['rank']}", probe)]
            continue
        for kind in ("full", "sharded"):
            p = probe[kind]
            lines.append(f"  {r['rank']:<5} {kind:<11} {_bytes(p['peak']):<32} {_bytes(p['model_peak']):<30} "
                         f"{_bytes(p['held'])}")
    return lines


def _dtype_lines(results: list[dict]) -> list[str]:
    base = results[0]
    probe = base["probes"]["dtypes"]
    if probe.get("end") != "ok":
        return _stopped("--show-dtypes", probe)

    def moved(unit, name):
        found = sorted({e["dtype"] for e in base["events"] if e["kind"] == "collective" and e["unit"] == unit
                        and e["name"] == name and e["phase"] != "shard"})
        return ", ".join(found) or "-"

    cols = ("unit", "all-gathered", "params in forward", "input", "param grads", "reduce-scattered", "shard .grad")
    rows = [cols] + [(unit, moved(unit, "ALL-GATHER"), ", ".join(seen["params"]) or "-", ", ".join(seen["input"]) or "-",
                      ", ".join(seen["grads"]) or "- (none needed)", moved(unit, "REDUCE-SCATTER"),
                      ", ".join(seen["shard_grad"]) or "-")
                     for unit, seen in probe["units"].items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return [f"--show-dtypes (rank 0{', mixed precision' if base.get('mixed_precision') else ', no --mixed-precision'}): "
            "per unit, the dtypes of what is all-gathered, of the parameters and the input its forward sees (after "
            "your pre-forward hooks), of those parameters' gradients as autograd makes them, of what is "
            "reduce-scattered, and of the gradient each FlatParameter's shard holds after backward:"] + \
        ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def report_probes(results: list[dict]) -> list[str]:
    """The tables of the --show-* checks the ranks ran for this scenario (none: nothing)."""
    probes = results[0].get("probes") or {}
    lines = []
    for key, render in (("rng", _rng_lines), ("peaks", _peak_lines), ("dtypes", _dtype_lines)):
        if key in probes:
            lines += [""] + render(results)
    return lines
