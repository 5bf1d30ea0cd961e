"""Trace your FSDP: which of your functions ran, in order, per rank and per unit, beside the collectives.

    python benchmarks/hook_trace.py                         # the four scenarios below, fully_shard (Task 7)
    python benchmarks/hook_trace.py --scenario lora         # one scenario: lora, reentrant or twice
    python benchmarks/hook_trace.py --hooks 4               # units made by hand with Task 4's life cycle
                                                            # (before Task 7 works; 6: Task 6's, prefetch on)
    python benchmarks/hook_trace.py --prefetch --steps 2    # Task 6: a second step runs on the recorded order
    python benchmarks/hook_trace.py --scenario lora --freeze-embedding   # the first block's input needs no grad
    python benchmarks/hook_trace.py --mixed-precision       # bf16 parameters, fp32 reduction: the dtypes moved
    python benchmarks/hook_trace.py --json                  # the events as JSON, for your own scripts

A debugging tool first: when a test says a unit stayed unsharded, was gathered twice, or that a collective hung,
the trace shows what your code did, call by call. The writeup's questions on your design (Q1, Q3, Q7, Q8) ask about
the trace of *your* implementation too.

What it does. Two ranks (gloo, CPU) run one training step (forward, then backward) of a small model through
``adapters.py``, so the implementation traced is the one the tests use (``FSDP_IMPL``). Before the model is
built, every function and method defined in the seven task files (``fsdp_assignment/task*.py``: public
names, private helpers and methods alike, found when the tool runs, not from a list) is wrapped so that each
call is recorded with its depth and its unit, and the rank's process group is replaced by the tests' counting
one (``tests/public/collectives.py``), which records every all-gather and reduce-scatter however it is spelled.
Functions defined inside other functions (closures) are not wrapped: their collectives still appear, under the
function that defined them.

A call's unit is the first unit its arguments name (an FSDPUnit, a module, one of its FlatParameters or their
tensors), else its caller's. An all-gather's unit is the one whose shard it sends (``gathered_unit``), else its
caller's; a reduce-scatter's is its caller's.

The scenarios (the Task 4 hard cases and Task 1 on meta, models from ``fsdp_assignment/support/models.py``):

    lora       LoRAModel, 2 blocks: each block unit holds frozen base weights beside trainable adapters
    reentrant  GPT, 2 blocks, torch.utils.checkpoint(use_reentrant=True) around each block: the block's forward
               runs again inside backward
    twice      a block applied twice in one forward (one unit, two uses), then a head
    meta       GPT, 2 blocks, built on the meta device, sharded, then materialize_meta_module (Task 1): the
               "materialize" phase shows your calls unit by unit (--setup shows the sharding too)

Output: per scenario, rank 0's timeline (the other ranks' are printed only where they differ: ranks that issue
different collectives hang or pair the wrong tensors), then per unit the sequence of its events. A task that
still raises NotImplementedError is named, with the trace up to that point.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = ("lora", "reentrant", "twice", "meta")
COLLECTIVE_NAMES = {"all_gather": "ALL-GATHER", "reduce_scatter": "REDUCE-SCATTER"}


# ---- inside a rank ----------------------------------------------------------------------------------------
class Recorder:
    """The events of one rank, in order: calls of the task files' functions and the collectives they issue."""

    def __init__(self):
        self.events: list[dict] = []
        self.stack: list[tuple[str, str]] = []   # (function, unit) of the calls in progress, innermost last
        self.names: dict[int, str] = {}          # id(module, unit, FlatParameter or its tensors) -> unit name
        self.model = None
        self.units = {}                          # unit name -> FSDPUnit, for gathered_unit
        self.phase = "setup"
        self._lock = threading.Lock()

    def name_modules(self, model) -> None:
        """Name every module of ``model`` now (before sharding): a module passed to your code is named by its
        path ("blocks.0"; the root is "<root>")."""
        self.model = model
        for name, module in model.named_modules():
            self.names[id(module)] = name or "<root>"

    def _refresh_units(self) -> None:
        from fsdp_assignment.support.state import FSDPUnit
        if self.model is None:
            return
        for name, module in self.model.named_modules():
            unit = getattr(module, "_fsdp_unit", None)
            if not isinstance(unit, FSDPUnit):
                continue
            label = name or "<root>"
            self.units[label] = unit
            self.names[id(unit)] = label
            for fp in unit.flat_params:
                self.names[id(fp)] = label
                for attr in ("shard", "unsharded"):
                    t = getattr(fp, attr, None)
                    if t is not None:
                        self.names[id(t)] = label

    def unit_of(self, args, kwargs) -> str:
        for value in (*args, *kwargs.values()):
            label = self.names.get(id(value))
            if label is None and hasattr(value, "__dict__"):
                self._refresh_units()
                label = self.names.get(id(value))
            if label is not None:
                return label
        return self.stack[-1][1] if self.stack else ""

    def add(self, **event) -> None:
        with self._lock:
            event.update(i=len(self.events), depth=len(self.stack), phase=self.phase)
            self.events.append(event)

    def on_collective(self, call, output, sent) -> None:
        """The counting process group's listener: one event per collective, when it is issued."""
        from tests.public.collectives import gathered_unit
        unit = ""
        if call.kind == "all_gather":
            self._refresh_units()
            unit = gathered_unit(sent, self.units) or ""
        if not unit and self.stack:
            unit = self.stack[-1][1]
        self.add(kind="collective", name=COLLECTIVE_NAMES.get(call.kind, call.kind.upper().replace("_", "-")),
                 unit=unit, numel=call.numel, dtype=call.dtype.replace("torch.", ""), async_op=call.async_op,
                 caller=self.stack[-1][0] if self.stack else "")


_CURRENT: list[Recorder] = []  # the recorder of the scenario running in this rank (the wrappers are made once)


def _wrap(fn, label: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if not _CURRENT:
            return fn(*args, **kwargs)
        rec = _CURRENT[-1]
        unit = rec.unit_of(args, kwargs)
        rec.add(kind="call", name=label, unit=unit, outer=not rec.stack or rec.stack[-1][1] != unit)
        rec.stack.append((label, unit))
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            rec.add(kind="raise", name=label, unit=unit, error=f"{type(err).__name__}: {err}"[:300])
            raise
        finally:
            rec.stack.pop()
    traced.__hook_trace__ = True
    return traced


def wrap_task_functions() -> list[str]:
    """Wrap every function and method defined in the task files of the implementation ``adapters`` selects,
    found by looking at the modules now. Returns the labels wrapped ("task3_forward.unshard", ...)."""
    import adapters

    modules = {n: adapters._task(n) for n in adapters.TASK_MODULES}
    wrapped: dict[int, object] = {}   # id(original function) -> its wrapper, so a name imported elsewhere follows
    labels = []
    for mod in modules.values():
        short = mod.__name__.rpartition(".")[2]
        for name, obj in list(vars(mod).items()):
            if getattr(obj, "__module__", None) != mod.__name__:
                continue  # imported from elsewhere (torch, support code, an earlier task: wrapped there)
            if inspect.isfunction(obj) and not getattr(obj, "__hook_trace__", False):
                wrapped[id(obj)] = _wrap(obj, f"{short}.{name}")
                labels.append(f"{short}.{name}")
            elif inspect.isclass(obj):
                for attr, member in list(vars(obj).items()):
                    if attr.startswith("__") and attr not in ("__init__", "__call__"):
                        continue
                    label = f"{short}.{obj.__qualname__}.{attr}"
                    if isinstance(member, (staticmethod, classmethod)):
                        inner = member.__func__
                        if inspect.isfunction(inner) and not getattr(inner, "__hook_trace__", False):
                            setattr(obj, attr, type(member)(_wrap(inner, label)))
                            labels.append(label)
                    elif inspect.isfunction(member) and not getattr(member, "__hook_trace__", False):
                        setattr(obj, attr, _wrap(member, label))
                        labels.append(label)
    for mod in modules.values():  # `from .task3_forward import unshard` in a later task: the same wrapper
        for name, obj in list(vars(mod).items()):
            if id(obj) in wrapped:
                setattr(mod, name, wrapped[id(obj)])
    return labels


def _twice_model():
    """A block applied twice in one forward: one unit, two uses (its backward runs twice too)."""
    import torch.nn as nn
    from fsdp_assignment.support.models import ScaledResidual

    class RunTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(7, 13)
            self.block = ScaledResidual(13, 17)
            self.head = nn.Linear(13, 5)

        def forward(self, x):
            return self.head(self.block(self.block(self.embed(x))))

    return RunTwice()


def _build(scenario: str, freeze_embedding: bool = False):
    """(model, unit modules children first and the root last, a function of the step returning the loss)."""
    import torch
    from fsdp_assignment.support.models import GPT, GPTConfig, LoRAConfig, LoRAModel, gpt_batch, gpt_loss

    torch.manual_seed(0)
    if scenario == "meta":  # built on meta: materialize_meta_module gives it values after sharding
        cfg = GPTConfig(n_layer=2)
        with torch.device("meta"):
            model = GPT(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    if scenario == "lora":
        cfg = LoRAConfig(n_layer=2, freeze_embedding=freeze_embedding)
        model = LoRAModel(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    if scenario == "reentrant":
        cfg = GPTConfig(n_layer=2, checkpoint="block", checkpoint_reentrant=True)
        model = GPT(cfg)
        return model, [*model.blocks, model], lambda step: gpt_loss(model, *gpt_batch(cfg, 2, seed=step))
    model = _twice_model()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g)
    return model, [model.block, model], lambda step: model(x + step).pow(2).mean()


def _failing_task(err: BaseException) -> dict:
    """Where ``err`` came from: the innermost frame in a task file (its file, line and function)."""
    where = {}
    for frame in traceback.extract_tb(err.__traceback__):
        if "/fsdp_assignment/" in frame.filename.replace("\\", "/") and "/task" in frame.filename:
            where = {"file": "fsdp_assignment/" + frame.filename.replace("\\", "/").rpartition("/fsdp_assignment/")[2],
                     "line": frame.lineno, "function": frame.name}
    return where


def rank_body(rank: int, world_size: int, scenarios: tuple, hooks: int, prefetch: bool, steps: int,
              options: dict | None = None) -> dict:
    """The scenarios on one rank, in turn: per scenario its events and how it ended ("ok", "not implemented" or
    "error"); after a scenario that did not end "ok" the next ones are not run (they would stop there too)."""
    import adapters

    from tests.public.collectives import use_counted_collectives

    out = {}
    log = use_counted_collectives(late=False)  # once per rank: it replaces the gloo group by a counting one
    wrapped = wrap_task_functions()
    for scenario in scenarios:
        out[scenario] = _one_scenario(rank, scenario, hooks, prefetch, steps, log, options or {})
        out[scenario].update(impl=adapters.implementation(), wrapped=len(wrapped))
        if out[scenario]["end"] != "ok":
            break
    return out


def _one_scenario(rank: int, scenario: str, hooks: int, prefetch: bool, steps: int, log, options: dict) -> dict:
    import adapters

    rec = Recorder()
    log.listener = rec.on_collective
    out = {"rank": rank, "events": rec.events, "end": "ok"}
    _CURRENT.append(rec)
    try:
        model, unit_modules, loss_of = _build(scenario, options.get("freeze_embedding", False))
        rec.name_modules(model)
        rec.phase = "shard"
        if hooks == 7:
            policy = None
            if options.get("mixed_precision"):  # bf16 parameters, fp32 gradient reduction (the writeup's Q8)
                import torch
                from torch.distributed.fsdp import MixedPrecisionPolicy
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for module in unit_modules:
                adapters.fully_shard(module, mixed_precision=policy)
            if prefetch:
                adapters.set_prefetch(model, True)
        else:
            from tests.public.common import hand_shard
            root = hand_shard(model, unit_modules, hooks=hooks)
            root.shared.prefetch = prefetch
        rec._refresh_units()
        if scenario == "meta":
            import torch
            rec.phase = "materialize"
            rec.add(kind="phase", name="materialize_meta_module(model, 'cpu')", unit="")
            torch.manual_seed(0)
            adapters.materialize_meta_module(model, "cpu")
        for step in range(steps):
            rec.phase = f"step {step + 1} forward"
            rec.add(kind="phase", name=f"step {step + 1}: forward", unit="")
            loss = loss_of(step)
            rec.phase = f"step {step + 1} backward"
            rec.add(kind="phase", name=f"step {step + 1}: backward (loss.backward())", unit="")
            loss.backward()
            rec.phase = f"step {step + 1} after"
            rec.add(kind="phase", name=f"step {step + 1}: loss.backward() returned", unit="")
            for p in model.parameters():
                p.grad = None
    except NotImplementedError as err:
        out.update(end="not implemented", error=str(err)[:400], where=_failing_task(err))
    except Exception as err:  # a debugging tool: show the trace up to the failure, and the failure
        out.update(end="error", error=f"{type(err).__name__}: {err}"[:800], where=_failing_task(err),
                   traceback="".join(traceback.format_exception(err)[-6:])[-3000:])
    finally:
        _CURRENT.pop()
    raised = next((e["name"] for e in rec.events if e["kind"] == "raise"), None)
    if raised and out.get("where"):  # the qualified name of the innermost function of yours that raised
        out["where"]["function"] = raised.partition(".")[2]
    return out


def trace(scenarios, hooks: int = 7, prefetch: bool = False, steps: int = 1, world_size: int = 2,
          **options) -> dict:
    """Run ``scenarios`` on ``world_size`` ranks (the tests' ``run_ranks``): scenario -> the ranks' results.
    ``options``: freeze_embedding (the LoRA model's), mixed_precision (bf16 parameters, fp32 reduction)."""
    from benchmarks import hook_trace  # the rank imports the body by module name, never from __main__
    from tests.harness import run_ranks

    per_rank = run_ranks(hook_trace.rank_body, world_size, tuple(scenarios), hooks, prefetch, steps, options,
                         timeout=180)
    return {s: [r[s] for r in per_rank] for s in scenarios if all(s in r for r in per_rank)}


# ---- in the parent: reading the events --------------------------------------------------------------------
def _short(label: str) -> str:
    """"task4_backward.BackwardHooks.pre_backward" -> "T4 BackwardHooks.pre_backward"."""
    mod, _, rest = label.partition(".")
    return f"T{mod[4]} {rest}" if mod.startswith("task") and mod[4:5].isdigit() else label


def line_of(e: dict) -> str:
    indent = "  " * e["depth"]
    unit = f"[{e['unit']}]" if e["unit"] else "[-]"
    if e["kind"] == "phase":
        return f"== {e['name']} =="
    if e["kind"] == "collective":
        extra = f"{e['numel']} x {e['dtype']}" + (", async" if e["async_op"] else "")
        return f"{indent}>> {e['name']:<14} {unit:<12} ({extra})"
    if e["kind"] == "raise":
        return f"{indent}!! {_short(e['name'])} raised {e['error']}"
    return f"{indent}{_short(e['name'])} {unit}"


def _collapsed(lines: list[str]) -> list[str]:
    """Runs of the same line become one line with "(x N)"."""
    out: list[tuple[str, int]] = []
    for line in lines:
        if out and out[-1][0] == line:
            out[-1] = (line, out[-1][1] + 1)
        else:
            out.append((line, 1))
    return [line if n == 1 else f"{line}  (x {n})" for line, n in out]


def timeline(events: list[dict], depth: int = 99, setup: bool = False) -> list[str]:
    """The text timeline: calls up to ``depth`` levels deep (collectives, failures and phases always), the
    sharding phase summed up in one line unless ``setup``."""
    lines, skipped = [], [0, 0]
    for e in events:
        if e["phase"] == "shard" and not setup:
            skipped[0 if e["kind"] == "call" else 1] += e["kind"] in ("call", "collective")
            continue
        if e["kind"] == "call" and e["depth"] >= depth:
            continue
        lines.append(line_of(e))
    head = [f"(sharding the model: {skipped[0]} call(s) of your functions, {skipped[1]} collective(s); --setup "
            "shows them)"] if sum(skipped) else []
    return head + _collapsed(lines)


def per_unit(events: list[dict]) -> dict[str, list[str]]:
    """Per unit, phase by phase: the calls of your functions that start work on that unit (a call whose caller
    works on another unit, or none: your hooks, as autograd and the module call them), and its collectives."""
    out: dict[str, dict[str, list[str]]] = {}
    for e in events:
        if e["kind"] not in ("call", "collective") or not e["unit"] or e["unit"] == "-":
            continue
        if e["kind"] == "call" and not e.get("outer"):
            continue
        name = e["name"] if e["kind"] == "collective" else _short(e["name"])
        out.setdefault(e["unit"], {}).setdefault(e["phase"], []).append(name)
    return {unit: [f"{phase}: " + " -> ".join(_collapsed(seq)) for phase, seq in phases.items()]
            for unit, phases in out.items()}


def _collectives(events):
    return [(e["name"], e["numel"]) for e in events if e["kind"] == "collective"]


def report(scenario: str, results: list[dict], depth: int = 99, setup: bool = False) -> list[str]:
    lines = [f"### scenario {scenario}  (implementation: {results[0].get('impl')}, W = {len(results)})", ""]
    base = results[0]
    lines += ["rank 0:"] + ["  " + x for x in timeline(base["events"], depth, setup)]
    for r in results[1:]:
        if _collectives(r["events"]) == _collectives(base["events"]) and \
                [line_of(e) for e in r["events"] if e["kind"] == "call"] == \
                [line_of(e) for e in base["events"] if e["kind"] == "call"]:
            lines.append(f"rank {r['rank']}: the same calls and collectives as rank 0")
        else:
            lines += [f"rank {r['rank']} (DIFFERS from rank 0: ranks must issue the same collectives in the same "
                      "order):"] + ["  " + x for x in timeline(r["events"], depth, setup)]
    lines += ["", "per unit (rank 0): the calls that start work on the unit, and its collectives, phase by phase:"]
    for unit, seq in per_unit(base["events"]).items():
        lines.append(f"  {unit}:")
        lines += [f"    {x}" for x in seq]
    for r in results:
        if r["end"] == "not implemented":
            task = ""
            where = r.get("where") or {}
            if where.get("file", "").startswith("fsdp_assignment/task"):
                task = f"Task {where['file'][len('fsdp_assignment/task')]}"
            lines += ["", f"NOT IMPLEMENTED YET (rank {r['rank']}): {task or 'a task'} raised NotImplementedError"
                      + (f" in {where['function']}() ({where['file']}:{where['line']})" if where else "")
                      + f": {r['error']}",
                      "The trace above stops there. Implement it (or trace an earlier task's life cycle: "
                      "--hooks 4 needs Tasks 2-4, fully_shard needs Task 7)."]
            break
        if r["end"] == "error":
            lines += ["", f"FAILED (rank {r['rank']}): {r['error']}", r.get("traceback", "")]
            break
    return lines


def status(results: list[dict]) -> int:
    ends = {r["end"] for r in results}
    return 0 if ends == {"ok"} else 2 if "not implemented" in ends else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    p.add_argument("--hooks", type=int, choices=(4, 6, 7), default=7,
                   help="7: adapters.fully_shard on each unit (default); 4 or 6: units made by hand "
                        "(tests/public/common.py's hand_shard) with Task 4's or Task 6's life cycle")
    p.add_argument("--prefetch", action="store_true", help="turn prefetching on (Task 6; --hooks 6 or 7)")
    p.add_argument("--freeze-embedding", action="store_true",
                   help="lora: freeze the embedding too, so the first block's input needs no gradient")
    p.add_argument("--mixed-precision", action="store_true",
                   help="fully_shard with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
    p.add_argument("--steps", type=int, default=1, help="training steps per scenario (default 1)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--depth", type=int, default=4,
                   help="show calls up to this many levels deep (default 4; collectives are always shown)")
    p.add_argument("--setup", action="store_true", help="show the calls made while sharding the model too")
    p.add_argument("--json", action="store_true", help="print the events as JSON instead of the text timeline")
    args = p.parse_args(argv)
    if args.prefetch and args.hooks == 4:
        p.error("--prefetch needs Task 6's life cycle: use --hooks 6 or 7")
    if args.mixed_precision and args.hooks != 7:
        p.error("--mixed-precision is a fully_shard keyword: use --hooks 7")
    if args.steps < 1 or args.world_size < 1:
        p.error("--steps and --world-size must be at least 1")

    from tests.harness import RankFailure

    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    try:
        found = trace(scenarios, args.hooks, args.prefetch, args.steps, args.world_size,
                      freeze_embedding=args.freeze_embedding, mixed_precision=args.mixed_precision)
    except RankFailure as err:
        print(f"hook_trace: a rank failed outside the traced step:\n{err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for scenario, results in found.items():
            print("\n".join(report(scenario, results, args.depth, args.setup)) + "\n")
    return max(status(results) for results in found.values())


if __name__ == "__main__":
    sys.exit(main())
