"""Trace your FSDP: which of your functions ran, in order, per rank and per unit, beside the collectives.

    python benchmarks/hook_trace.py                         # the four scenarios below, fully_shard (Task 7)
    python benchmarks/hook_trace.py --scenario lora         # one scenario: lora, reentrant, twice or meta
    python benchmarks/hook_trace.py --hooks 4               # units made by hand with Task 4's life cycle
                                                            # (before Task 7 works; 6: Task 6's, prefetch on)
    python benchmarks/hook_trace.py --prefetch --steps 2    # Task 6: a second step runs on the recorded order
    python benchmarks/hook_trace.py --scenario lora --freeze-embedding   # the first block's input needs no grad
    python benchmarks/hook_trace.py --mixed-precision       # bf16 parameters, fp32 reduction: the dtypes moved
    python benchmarks/hook_trace.py --scenario meta --show-rng     # Task 1: each module's materialised values
                                                            # against eager init under the same seed (torch.equal)
    python benchmarks/hook_trace.py --show-state-dict-peaks # Task 5: per rank, the peak bytes while your code
                                                            # builds the full and the sharded state dicts
    python benchmarks/hook_trace.py --scenario lora --mixed-precision --show-dtypes   # per unit: the dtypes
                                                            # gathered, in forward, of the grads, reduced
    python benchmarks/hook_trace.py --json                  # the events as JSON, for your own scripts

A --show-* option with no --scenario runs the scenario it needs (--show-rng, --show-state-dict-peaks: meta;
--show-dtypes: lora); its table follows the scenario's trace (hook_trace_probes.py says what each measures).

Your prints show: whatever your code prints (or writes to stderr) inside a rank is printed first, every line
labelled ``[rank r]``, passing or failing, and rank 0's prints appear in its timeline too, where they happened.

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
different collectives hang or pair the wrong tensors), then per unit the sequence of its events (a call that
starts work on the unit names the call of yours it ran under) and, per FlatParameter, what is all-gathered and
what is reduce-scattered (a frozen one is gathered, never reduce-scattered). A task that still raises
NotImplementedError is named, with the trace up to that point.
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

from benchmarks.hook_trace_scenarios import META_CONFIG, _build, _eager_meta_model  # noqa: E402,F401
from benchmarks.hook_trace_report import (COLLECTIVE_NAMES, _collapsed, _short, line_of, per_unit,  # noqa: E402,F401
                                          report, status, timeline)

SCENARIOS = ("lora", "reentrant", "twice", "meta")


# ---- inside a rank ----------------------------------------------------------------------------------------
class Recorder:
    """The events of one rank, in order: calls of the task files' functions and the collectives they issue."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[dict] = []
        self.stack: list[tuple[str, str]] = []   # (function, unit) of the calls in progress, innermost last
        self.names: dict[int, str] = {}          # id(module, unit, FlatParameter or its tensors) -> unit name
        self.model = None
        self.units = {}                          # unit name -> FSDPUnit, for gathered_unit
        self.param_names: dict[str, list] = {}   # module path -> [(name, requires_grad)] of its own parameters
        self.sizes: dict[str, int] = {}          # the model's Psi and trainable Psi, counted before sharding
        self.phase = "setup"
        self.paused = False                      # the --show-* checks: their calls and collectives are not traced
        self._lock = threading.Lock()

    def name_modules(self, model) -> None:
        """Name every module of ``model`` now (before sharding): a module passed to your code is named by its
        path ("blocks.0"; the root is "<root>"); note each module's own parameters and the model's size."""
        self.model = model
        for name, module in model.named_modules():
            self.names[id(module)] = name or "<root>"
            own = [(n, p.requires_grad) for n, p in module.named_parameters(recurse=False)]
            if own:
                self.param_names[name] = own
        params = list(model.parameters())
        self.sizes = {"psi": sum(p.numel() for p in params),
                      "psi_trainable": sum(p.numel() for p in params if p.requires_grad)}

    def describe_units(self) -> dict[str, list[dict]]:
        """Per unit, its FlatParameters in order: shard size and dtype, trainable or frozen (for the per-unit
        summary's gathered / reduce-scattered lines)."""
        self._refresh_units()
        return {label: [{"index": i, "shard_numel": int(fp.shard.numel()), "requires_grad": bool(fp.requires_grad),
                         "dtype": str(fp.shard.dtype).replace("torch.", "")} for i, fp in enumerate(unit.flat_params)]
                for label, unit in self.units.items()}

    def _flat_of(self, unit: str, sent, output, kind: str):
        """Which of ``unit``'s FlatParameters a collective moves (its index), or None when it cannot tell: an
        all-gather by the shard it sends (as gathered_unit), a reduce-scatter by its output's size (a trainable
        FlatParameter first: a frozen one has no gradient)."""
        import torch
        fps = list(getattr(self.units.get(unit), "flat_params", []))
        if kind == "all_gather" and sent is not None:
            sent = sent.detach().reshape(-1)
            found = [i for i, fp in enumerate(fps) if fp.shard.numel() == sent.numel()
                     and torch.equal(fp.shard.detach().to(device=sent.device, dtype=sent.dtype), sent)]
        elif kind == "reduce_scatter" and output is not None:
            found = [i for i, fp in enumerate(fps) if fp.shard.numel() == output.numel()]
            found = [i for i in found if fps[i].requires_grad] or found
        else:
            return None
        return found[0] if len(found) == 1 else None

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
        if self.paused and event["kind"] not in ("phase", "print"):
            return
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
        flat = self._flat_of(unit, sent, output, call.kind) if unit in self.units else None
        self.add(kind="collective", name=COLLECTIVE_NAMES.get(call.kind, call.kind.upper().replace("_", "-")),
                 unit=unit, numel=call.numel, dtype=call.dtype.replace("torch.", ""), async_op=call.async_op,
                 caller=self.stack[-1][0] if self.stack else "", flat=flat)

    def add_print(self, line: str, stream: str) -> None:
        """A line your code wrote to stdout or stderr, at the place in the trace where it wrote it."""
        self.add(kind="print", name=line[:1000], unit=self.stack[-1][1] if self.stack else "", stream=stream,
                 rank=self.rank)


class _PrintTee:
    """The rank's sys.stdout or sys.stderr: every write passes through (the harness shows the rank's output after
    the run, each line labelled [rank r]), and each complete line written while a scenario runs is also recorded
    as a "print" event, so the timeline shows it where it happened."""

    def __init__(self, inner, stream: str):
        self._inner, self._stream, self._partial = inner, stream, ""

    def write(self, text):
        n = self._inner.write(text)
        if _CURRENT and isinstance(text, str):
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                _CURRENT[-1].add_print(line, self._stream)
        return n

    def end_line(self) -> None:
        """At a scenario's end: a last line written without its newline is recorded too."""
        if self._partial and _CURRENT:
            _CURRENT[-1].add_print(self._partial, self._stream)
        self._partial = ""

    def flush(self):
        return self._inner.flush()

    def __getattr__(self, name):
        return getattr(self._inner, name)


_CURRENT: list[Recorder] = []  # the recorder of the scenario running in this rank (the wrappers are made once)


def _wrap(fn, label: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if not _CURRENT:
            return fn(*args, **kwargs)
        rec = _CURRENT[-1]
        unit = rec.unit_of(args, kwargs)
        parent, parent_unit = rec.stack[-1] if rec.stack else ("", "")
        rec.add(kind="call", name=label, unit=unit, outer=not rec.stack or parent_unit != unit, parent=parent,
                parent_unit=parent_unit)
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
    tees = _PrintTee(sys.stdout, "stdout"), _PrintTee(sys.stderr, "stderr")
    sys.stdout, sys.stderr = tees
    try:
        for scenario in scenarios:
            try:
                out[scenario] = _one_scenario(rank, scenario, hooks, prefetch, steps, log, options or {})
            finally:
                for tee in tees:
                    tee.end_line()
            out[scenario].update(impl=adapters.implementation(), wrapped=len(wrapped))
            if out[scenario]["end"] != "ok":
                break
    finally:  # a print without flush=True reaches the rank's output file (and the harness) all the same
        sys.stdout, sys.stderr = (tee._inner for tee in tees)
        for tee in tees:
            tee.flush()
    return out


def _one_scenario(rank: int, scenario: str, hooks: int, prefetch: bool, steps: int, log, options: dict) -> dict:
    import adapters
    from benchmarks import hook_trace_probes as probes

    rec = Recorder(rank)
    log.listener = rec.on_collective
    out = {"rank": rank, "events": rec.events, "end": "ok", "probes": {},
           "mixed_precision": bool(options.get("mixed_precision"))}
    _CURRENT.append(rec)

    def probe(key: str, title: str, fn, *args) -> None:  # a --show-* check: its calls and collectives untraced
        rec.phase, rec.paused = title, True
        rec.add(kind="phase", name=f"{title} (its calls and collectives are not traced)", unit="")
        try:
            out["probes"][key] = probes.run_probe(fn, *args)
        finally:
            rec.paused = False

    try:
        model, unit_modules, loss_of = _build(scenario, options.get("freeze_embedding", False))
        rec.name_modules(model)
        out["sizes"] = rec.sizes
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
        out["flat_params"] = rec.describe_units()
        if scenario == "meta":
            import torch
            rec.phase = "materialize"
            rec.add(kind="phase", name="materialize_meta_module(model, 'cpu')", unit="")
            torch.manual_seed(0)
            adapters.materialize_meta_module(model, "cpu")
            if options.get("show_rng"):
                probe("rng", "--show-rng", probes.rng_check, model, _eager_meta_model, 0)
        watch = probes.DtypeWatch(model, rec.units, rec.param_names) if options.get("show_dtypes") else None
        for step in range(steps):
            rec.phase = f"step {step + 1} forward"
            rec.add(kind="phase", name=f"step {step + 1}: forward", unit="")
            loss = loss_of(step)
            rec.phase = f"step {step + 1} backward"
            rec.add(kind="phase", name=f"step {step + 1}: backward (loss.backward())", unit="")
            loss.backward()
            rec.phase = f"step {step + 1} after"
            rec.add(kind="phase", name=f"step {step + 1}: loss.backward() returned", unit="")
            if watch is not None:
                watch.after_backward()
            for p in model.parameters():
                p.grad = None
        if watch is not None:
            out["probes"]["dtypes"] = {"end": "ok", "units": watch.result()}
        if options.get("show_state_dict_peaks"):
            probe("peaks", "--show-state-dict-peaks", probes.state_dict_peaks, model, loss_of, steps)
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
          rank_output: list | None = None, **options) -> dict:
    """Run ``scenarios`` on ``world_size`` ranks (the tests' ``run_ranks``): scenario -> the ranks' results.
    ``options``: freeze_embedding (the LoRA model's), mixed_precision (bf16 parameters, fp32 reduction),
    show_rng, show_state_dict_peaks, show_dtypes (the --show-* checks). ``rank_output``: a list that receives
    what the ranks wrote (each line labelled [rank r] by the harness) instead of this process's stdout, even
    when a rank fails."""
    import contextlib
    import io

    from benchmarks import hook_trace  # the rank imports the body by module name, never from __main__
    from tests.harness import run_ranks

    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured) if rank_output is not None else contextlib.nullcontext():
            per_rank = run_ranks(hook_trace.rank_body, world_size, tuple(scenarios), hooks, prefetch, steps,
                                 options, timeout=180)
    finally:
        if rank_output is not None:
            rank_output.append(captured.getvalue())
    return {s: [r[s] for r in per_rank] for s in scenarios if all(s in r for r in per_rank)}


# ---- in the parent: the report is hook_trace_report.py's; main prints it ------------------------------
RANK_OUTPUT_HEAD = ("what the ranks wrote to stdout and stderr (your prints), each line labelled [rank r]; the "
                    "timelines below show rank 0's where they happened:")
SHOW_SCENARIO = {"show_rng": "meta", "show_state_dict_peaks": "meta", "show_dtypes": "lora"}  # with no --scenario


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--scenario", choices=(*SCENARIOS, "all"), default=None,
                   help="default: all four; with a --show-* option and no --scenario, the scenario it needs "
                        "(--show-rng and --show-state-dict-peaks: meta; --show-dtypes: lora)")
    p.add_argument("--hooks", type=int, choices=(4, 6, 7), default=7,
                   help="7: adapters.fully_shard on each unit (default); 4 or 6: units made by hand "
                        "(tests/public/common.py's hand_shard) with Task 4's or Task 6's life cycle")
    p.add_argument("--prefetch", action="store_true", help="turn prefetching on (Task 6; --hooks 6 or 7)")
    p.add_argument("--freeze-embedding", action="store_true",
                   help="lora: freeze the embedding too, so the first block's input needs no gradient")
    p.add_argument("--mixed-precision", action="store_true",
                   help="fully_shard with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
    p.add_argument("--show-rng", action="store_true",
                   help="meta: after materialize_meta_module, each module's parameters and buffers against eager "
                        "init under the same seed (torch.equal per tensor, a table)")
    p.add_argument("--show-state-dict-peaks", action="store_true",
                   help="after one AdamW step, per rank the peak bytes allocated while building the full and the "
                        "sharded state dicts of the model and the optimizer (LiveStorageTracker)")
    p.add_argument("--show-dtypes", action="store_true",
                   help="per unit, the dtypes gathered, of the parameters and input forward sees, of their "
                        "gradients, reduce-scattered and of the shard's gradient (use with --mixed-precision)")
    p.add_argument("--steps", type=int, default=1, help="training steps per scenario (default 1)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--depth", type=int, default=4,
                   help="show calls up to this many levels deep (default 4; collectives and prints are always shown)")
    p.add_argument("--setup", action="store_true", help="show the calls made while sharding the model too")
    p.add_argument("--json", action="store_true", help="print the events as JSON instead of the text timeline "
                   "(the ranks' output then goes to stderr)")
    args = p.parse_args(argv)
    if args.prefetch and args.hooks == 4:
        p.error("--prefetch needs Task 6's life cycle: use --hooks 6 or 7")
    if args.mixed_precision and args.hooks != 7:
        p.error("--mixed-precision is a fully_shard keyword: use --hooks 7")
    if args.steps < 1 or args.world_size < 1:
        p.error("--steps and --world-size must be at least 1")
    shows = [k for k in SHOW_SCENARIO if getattr(args, k)]
    if args.scenario is None and shows:
        scenarios = tuple(s for s in SCENARIOS if s in {SHOW_SCENARIO[k] for k in shows})
    else:
        scenarios = SCENARIOS if args.scenario in (None, "all") else (args.scenario,)
    if args.show_rng and "meta" not in scenarios:
        p.error("--show-rng checks materialize_meta_module: it needs the meta scenario (--scenario meta)")

    from tests.harness import RankFailure

    sink = sys.stderr if args.json else sys.stdout
    output: list[str] = []
    try:
        found = trace(scenarios, args.hooks, args.prefetch, args.steps, args.world_size, rank_output=output,
                      freeze_embedding=args.freeze_embedding, mixed_precision=args.mixed_precision,
                      **{k: True for k in shows})
    except RankFailure as err:
        if "".join(output):
            print(RANK_OUTPUT_HEAD + "\n" + "".join(output), file=sys.stderr)
        print(f"hook_trace: a rank failed outside the traced step:\n{err}", file=sys.stderr)
        return 1
    if "".join(output):
        print(RANK_OUTPUT_HEAD + "\n" + "".join(output), file=sink)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for scenario, results in found.items():
            print("\n".join(report(scenario, results, args.depth, args.setup)) + "\n")
    return max(status(results) for results in found.values())


if __name__ == "__main__":
    sys.exit(main())
