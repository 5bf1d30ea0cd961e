"""The text of ``benchmarks/hook_trace.py``'s report, read in the parent from the events the ranks recorded: the
timeline, the per-unit summary (with what each FlatParameter gathers and reduce-scatters), and the tables of the
``--show-*`` options (hook_trace_probes.py records them). No torch here: only the events' dicts.
"""

from __future__ import annotations

COLLECTIVE_NAMES = {"all_gather": "ALL-GATHER", "reduce_scatter": "REDUCE-SCATTER"}


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
    if e["kind"] == "print":  # what your code printed, where it printed it
        stream = "" if e.get("stream") == "stdout" else f" {e.get('stream')}"
        return f"{indent}[rank {e.get('rank', '?')}{stream}] {e['name']}"
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
    """The text timeline: calls up to ``depth`` levels deep (collectives, prints, failures and phases always), the
    sharding phase summed up in one line unless ``setup`` (a print made while sharding is shown all the same)."""
    lines, skipped = [], [0, 0]
    for e in events:
        if e["phase"] == "shard" and not setup and e["kind"] != "print":
            skipped[0 if e["kind"] == "call" else 1] += e["kind"] in ("call", "collective")
            continue
        if e["kind"] == "call" and e["depth"] >= depth:
            continue
        lines.append(line_of(e))
    head = [f"(sharding the model: {skipped[0]} call(s) of your functions, {skipped[1]} collective(s); --setup "
            "shows them)"] if sum(skipped) else []
    return head + _collapsed(lines)


def _started_by(e: dict) -> str:
    """A call that starts work on a unit, with the call of yours it ran under when that one works on another unit
    (or on none): which hook or callback reached the unit (a frozen embedding changes it for blocks.0)."""
    name = _short(e["name"])
    parent = e.get("parent")
    if not parent:
        return name
    where = f" [{e['parent_unit']}]" if e.get("parent_unit") else ""
    return f"{name} (under {_short(parent)}{where})"


def per_unit(events: list[dict]) -> dict[str, list[str]]:
    """Per unit, phase by phase: the calls of your functions that start work on that unit (a call whose caller
    works on another unit, or none: your hooks, as autograd and the module call them; the caller is named), and
    its collectives."""
    out: dict[str, dict[str, list[str]]] = {}
    for e in events:
        if e["kind"] not in ("call", "collective") or not e["unit"] or e["unit"] == "-":
            continue
        if e["kind"] == "call" and not e.get("outer"):
            continue
        name = e["name"] if e["kind"] == "collective" else _started_by(e)
        out.setdefault(e["unit"], {}).setdefault(e["phase"], []).append(name)
    return {unit: [f"{phase}: " + " -> ".join(_collapsed(seq)) for phase, seq in phases.items()]
            for unit, phases in out.items()}


def _counted(items: list[tuple[int, str]]) -> str:
    """[(numel, dtype), ...] -> "2 x (216 x bfloat16)", grouped by size and dtype, in order of first use."""
    seen: dict[tuple[int, str], int] = {}
    for item in items:
        seen[item] = seen.get(item, 0) + 1
    return ", ".join(f"{n} x ({numel} x {dtype})" for (numel, dtype), n in seen.items())


def flat_param_lines(events: list[dict], flat_params: dict) -> dict[str, list[str]]:
    """Per unit, one line per FlatParameter: trainable or frozen, its shard, and the all-gathers and
    reduce-scatters of it over the whole run (every step). A frozen FlatParameter is gathered and never
    reduce-scattered: the column that tells a frozen unit from a trainable one. A collective the tool could not
    tie to one FlatParameter (two with the same shard) is counted on a line of its own."""
    out: dict[str, list[str]] = {}
    for unit, fps in (flat_params or {}).items():
        lines = []
        for fp in fps:
            mine = [e for e in events if e["kind"] == "collective" and e["unit"] == unit and e.get("flat") == fp["index"]
                    and e["phase"] != "shard"]
            ag = [(e["numel"], e["dtype"]) for e in mine if e["name"] == "ALL-GATHER"]
            rs = [(e["numel"], e["dtype"]) for e in mine if e["name"] == "REDUCE-SCATTER"]
            kind = "trainable" if fp["requires_grad"] else "frozen"
            lines.append(f"FlatParameter {fp['index']} ({kind}, shard {fp['shard_numel']} x {fp['dtype']}): "
                         f"ALL-GATHER {_counted(ag) or 'never'}; REDUCE-SCATTER "
                         + (_counted(rs) or ("never (frozen: no gradient)" if not fp["requires_grad"] else "never")))
        loose = [e for e in events if e["kind"] == "collective" and e["unit"] == unit and e.get("flat") is None
                 and e["name"] in ("ALL-GATHER", "REDUCE-SCATTER") and e["phase"] != "shard"]
        if loose:
            lines.append("not tied to one FlatParameter: " + "; ".join(
                f"{name} {_counted([(e['numel'], e['dtype']) for e in loose if e['name'] == name])}"
                for name in ("ALL-GATHER", "REDUCE-SCATTER") if any(e["name"] == name for e in loose)))
        out[unit] = lines
    return out


def _collectives(events):
    return [(e["name"], e["numel"]) for e in events if e["kind"] == "collective"]


def report(scenario: str, results: list[dict], depth: int = 99, setup: bool = False) -> list[str]:
    from benchmarks import hook_trace_probes as probes

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
    lines += ["", "per unit (rank 0): the calls that start work on the unit (under which call of yours, when that "
              "one works on another unit), and its collectives, phase by phase; then each FlatParameter, what is "
              "gathered and what is reduce-scattered over the run:"]
    flats = flat_param_lines(base["events"], base.get("flat_params") or {})
    for unit, seq in per_unit(base["events"]).items():
        lines.append(f"  {unit}:")
        lines += [f"    {x}" for x in seq]
        lines += [f"    {x}" for x in flats.get(unit, [])]
    lines += probes.report_probes(results)
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
    """0: every rank ran every step (and every --show-* check it was asked for); 2: a task is not implemented yet;
    1: something failed."""
    ends = {r["end"] for r in results}
    probes = {p.get("end", "ok") for r in results for p in (r.get("probes") or {}).values()}
    if ends == {"ok"} and probes <= {"ok"}:
        return 0
    return 2 if "not implemented" in ends | probes else 1
