"""Machine-generated mutants: every single-point mutation a real mutation tool (cosmic-ray) makes in the
reference task files, each graded only by the tests that call the mutated function.

    pip install -e ".[staff]"                                         # cosmic-ray, staff only
    python -m staff.grader_selftest.machine_mutants --list                 # how many, per file and operator
    python -m staff.grader_selftest.machine_mutants --file task1_meta_init.py --json out.json   # one file, all
    python -m staff.grader_selftest.machine_mutants --sample 10 --seed 3  # a random sample over every file

cosmic-ray enumerates the mutations (its ``core/*`` operators: replaced binary, comparison and unary
operators, ``and``/``or``, ``True``/``False``, numbers, ``break``/``continue``, a loop that runs zero times,
removed decorators, ...) and applies one at a time to the reference's source. Each mutant is graded on the grading
path the hand-written mutants take (``mutant_grading.py``: the student files of a fresh grading tree, the real
grading command with ``-x``) by the tests that ``test_times.json`` says call the function the mutation sits in
(innermost ``def``), the mutated task's first: a failing test or a hang (each test's time limit is the
grader's, from test_times.json) kills it. A mutant in code no graded test calls is
reported as such ("uncalled"). Survivors are listed in the report with the one-line reason they are equivalent
(``EQUIVALENT`` below), or as survivors to kill.

The unmutated reference is graded the same way first (a control): if it fails, no mutant is graded.
Staff-only, like ``mutations.py``: mutants are pieces of the solution.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from staff.grader_selftest import mutant_grading  # the grading path both mutation systems share
from staff.grader_selftest.mutant_grading import NEW_TESTS, TASK_FILES, TIMES  # noqa: F401

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Survivors that only a GPU can kill (reported as survivors, with this reason): the CPU-offload bonus keeps a
# shard on the CPU and gathers into a CUDA buffer; on a CPU-only machine a shard and its buffer share the device.
GPU_ONLY: dict[str, str] = {
    "task3_forward.py:ReplaceComparisonOperator_NotEq_Eq:2":
        "`shard.device == buffer.device`: a CPU-offloaded shard is not moved to the GPU before the all-gather; "
        "killed only by the NCCL variant of the offload bonus test (on CPU the two devices are always equal)",
    "task3_forward.py:ReplaceComparisonOperator_NotEq_Is:2":
        "`shard.device is buffer.device` is always false: a CPU-offloaded shard is not moved to the GPU; killed "
        "only by the NCCL variant of the offload bonus test",
}

# Survivors judged equivalent (no observable behaviour changes), by mutant id, with the reason.
EQUIVALENT: dict[str, str] = {
    "task1_meta_init.py:RemoveDecorator:0":
        "drops materialize_meta_module's @torch.no_grad(): reset_parameters() already runs with autograd on in eager "
        "__init__, and copy_into_shard writes under its own no_grad, so nothing records a graph either way",
    "task3_forward.py:ReplaceComparisonOperator_Eq_Is:0":
        "`unit.sharded_state is ShardedState.SHARDED` for `==`: enum members are singletons",
    "task3_forward.py:ReplaceComparisonOperator_NotEq_IsNot:0":
        "`param_dtype is not dtype` for `!=`: torch dtypes are singletons",
    "task3_forward.py:ReplaceComparisonOperator_NotEq_IsNot:1":
        "`shard.dtype is not dtype` for `!=`: torch dtypes are singletons",
    "task3_forward.py:ReplaceComparisonOperator_NotEq_IsNot:2":
        "`shard.device is not ...device` is always true (each .device is a new object), so the shard always goes "
        "through .to(device, dtype), which returns the tensor itself when both already match: no copy, no change",
    "task3_forward.py:ReplaceBinaryOperator_Mul_Div:0":
        "unshard's keyword-only marker `*` becomes the positional-only `/`: every caller (reference, adapters, "
        "tests) passes flat_param and group by position and param_dtype/async_op by keyword, which both accept",
    "task3_forward.py:ReplaceOrWithAnd:0":
        "`all_gather_single and all_gather_into_tensor` picks the older name of the same collective when the new one "
        "exists: same call, same result, and the tests count collectives under both names",
    "task3_forward.py:ReplaceTrueWithFalse:0":
        "the offload copy's non_blocking=True becomes False: a synchronous copy of the same values (only timing "
        "changes, and only on a GPU)",
    "task5_optim_ckpt.py:NumberReplacer:20":
        "numbers set_optimizer_state_dict's parameter ids from 1 instead of 0: they are only keys that "
        "Optimizer.load_state_dict pairs with the parameters in order, so any consistent numbering loads the same",
    "task4_backward.py:ReplaceBinaryOperator_Mul_Div:0":
        "reduce_scatter_grad's keyword-only marker `*` becomes the positional-only `/`: every caller passes "
        "flat_param, grad and group by position and reduce_dtype by keyword, which both accept",
    "task4_backward.py:ReplaceOrWithAnd:0":
        "`reduce_scatter_single and reduce_scatter_tensor` picks the other name of the same collective when both "
        "exist: same call, same result, and the tests count collectives under both names",
    "task5_optim_ckpt.py:ReplaceComparisonOperator_Eq_LtE:4":
        "`dist.get_rank() <= 0` for `== 0`: a rank is never negative",
    "task7_fully_shard.py:ReplaceComparisonOperator_NotEq_Gt:0":
        "`mesh.ndim > 2` for `!= 2` after the 1-D case has returned: a DeviceMesh has at least one dimension, so "
        "both are true for exactly the meshes of more than two",
    "task7_fully_shard.py:ReplaceComparisonOperator_Gt_NotEq:0":
        "`get_world_size(replicate_group) != 1` for `> 1`: a process group has at least one rank",
    "task6_prefetch.py:ReplaceComparisonOperator_IsNot_NotEq:0":
        "`units[0].module != module` for `is not`: nn.Module defines no __eq__, so != is identity",
    "task6_prefetch.py:NumberReplacer:3":
        "`units[-1].shared is None` for `units[0]`: init_shared_state (and Task 7's lazy init) give every unit of "
        "the tree one SharedState together, so the first and the last unit have one only together (they could "
        "differ only if a child unit had run forward as its own root before the root was sharded)",
}


@dataclass
class MachineMutant:
    id: str            # file:operator:occurrence (stable for a given reference)
    file: str          # task file name
    operator: str
    occurrence: int
    line: int
    function: str      # innermost enclosing def ("<module>" when none)
    equivalent: str    # why the mutation cannot change behaviour (automatic), or ''

    code_line: str     # the original line
    mutated_line: str  # the line after the mutation


_functions_by_line = mutant_grading.functions_by_line


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation: never evaluated here (``from __future__ import annotations``)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        anns = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            anns.append(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            anns.append(node.returns)
        if isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in anns]
    return spans


def automatic_equivalence(source: str, start: tuple[int, int]) -> str:
    """A reason when a mutation cannot change behaviour whatever the tests, else ''."""
    if "from __future__ import annotations" in source:
        # cosmic-ray's positions are (line, column) with 1-based lines and 0-based columns, like ast's.
        for lo, hi in _annotation_spans(source):
            if lo <= tuple(start) <= hi:
                return "inside a type annotation, which `from __future__ import annotations` never evaluates"
    return ""


def enumerate_mutants(files: list[str] | None = None) -> list[tuple[MachineMutant, str]]:
    """Every mutant cosmic-ray makes in the reference task files: (mutant, mutated source)."""
    from cosmic_ray.commands.init import _all_work_items
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    out = []
    for name in files or list(TASK_FILES.values()):
        path = ROOT / "fsdp_assignment" / "reference" / name
        source = path.read_text()
        lines = source.splitlines()
        functions = _functions_by_line(source)
        for item in _all_work_items([path], {}):
            spec = item.mutations[0]
            mutated = mutate_code(source, get_operator(spec.operator_name)(), spec.occurrence)
            if mutated is None or mutated == source:
                continue
            line = spec.start_pos[0]
            new_lines = mutated.splitlines()
            m = MachineMutant(id=f"{name}:{spec.operator_name.split('/')[-1]}:{spec.occurrence}", file=name,
                              operator=spec.operator_name, occurrence=spec.occurrence, line=line,
                              function=functions.get(line, "<module>"),
                              equivalent=automatic_equivalence(source, spec.start_pos), code_line=lines[line - 1].strip(),
                              mutated_line=new_lines[line - 1].strip() if line <= len(new_lines) else "")
            out.append((m, mutated))
    return out


def mutation_of(mutant_id: str) -> tuple[set[str], set[str]] | None:
    """The lines one mutant removes and adds (stripped), by id, without enumerating the others; None when the
    reference no longer has that mutation."""
    import difflib

    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    name, operator, occurrence = mutant_id.split(":")
    source = (ROOT / "fsdp_assignment" / "reference" / name).read_text()
    mutated = mutate_code(source, get_operator(f"core/{operator}")(), int(occurrence))
    if mutated is None:
        return None
    diff = list(difflib.ndiff(source.splitlines(), mutated.splitlines()))
    return ({d[2:].strip() for d in diff if d.startswith("- ")}, {d[2:].strip() for d in diff if d.startswith("+ ")})


def tests_calling(mutant: MachineMutant) -> list[tuple[str, float]]:
    """The graded tests that call the mutant's function, cheapest first: (node id, measured seconds)."""
    return mutant_grading.tests_calling(mutant.file, mutant.function)


def grade(mutant: MachineMutant | None, mutated: str | None, workdir: Path, tests: list[tuple[str, float]]) -> dict:
    """Grade the mutant (None: the unmutated reference) on ``tests`` (mutant_grading.grade_mutant). Returns the
    outcome."""
    files = mutant_grading.reference_student_files()
    order = []
    if mutant is not None:
        files[f"fsdp_assignment/{mutant.file}"] = mutant_grading.student_form(mutated)
        order = ["--grade-first-task", str(next(k for k, v in TASK_FILES.items() if v == mutant.file))]
    name = mutant.id.replace(":", "_").replace(".py", "") if mutant else "control"
    selection = mutant_grading.select_args([t.split("::", 1)[1] for t, _ in tests])
    # the run's own limit (its budget: 60 s less) as before, 15 x the tests' time + 120 s, at least the default:
    # a loaded machine must not cut the control's many tests (each test's own limit still catches a hang)
    v = mutant_grading.grade_mutant(files, workdir, name, [*selection, *order],
                                    timeout=max(600.0, 15 * sum(s for _, s in tests) + 120))
    return {"killed": v.killed, "passed": not v.killed and v.tests > 0 and v.detail.startswith("all "),
            "killer": v.killer, "tests": v.tests, "seconds": round(v.seconds, 1), "tail": v.detail[-600:]}


def run(selected: list[tuple[MachineMutant, str]], workers: int, log=print) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-machine-mutants-"))
    try:
        # the control: every test any selected mutant would run, on the unmutated reference
        needed = {t: s for m, _ in selected if not m.equivalent for t, s in tests_calling(m)}
        control = grade(None, None, workdir, sorted(needed.items(), key=lambda x: x[1]))
        if not control["passed"]:
            raise RuntimeError(f"the unmutated reference fails its tests here: {control['tail']}")
        log(f"control: {control['tests']} tests pass on the unmutated reference in {control['seconds']} s")
        outcomes = []

        def one(pair):
            m, mutated = pair
            if m.equivalent:
                return {**asdict(m), "status": "equivalent", "killer": "", "seconds": 0.0, "tests": 0,
                        "reason": m.equivalent}
            tests = tests_calling(m)
            if not tests:
                return {**asdict(m), "status": "uncalled", "killer": "", "seconds": 0.0, "tests": 0}
            r = grade(m, mutated, workdir, tests)
            status = "killed" if r["killed"] else ("equivalent" if m.id in EQUIVALENT else "survived")
            return {**asdict(m), "status": status, "killer": r["killer"], "seconds": r["seconds"],
                    "tests": r["tests"], "reason": EQUIVALENT.get(m.id, "") or GPU_ONLY.get(m.id, "")}
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for o in pool.map(one, selected):
                log(f"{o['id']:<55} {o['status']:<10} {o['seconds']:6.1f} s  {o['killer'] or o['code_line'][:60]}")
                outcomes.append(o)
        return outcomes
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def summary(outcomes: list[dict]) -> dict:
    count = {s: sum(o["status"] == s for o in outcomes) for s in ("killed", "survived", "equivalent", "uncalled")}
    graded = count["killed"] + count["survived"]
    return {"generated": len(outcomes), **count,
            "kill_rate_of_non_equivalent": round(count["killed"] / graded, 4) if graded else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", nargs="*", default=None, help="task files (default: all seven)")
    parser.add_argument("--sample", type=int, default=None, help="grade a random sample of this many")
    parser.add_argument("--seed", type=int, default=None, help="the sample's seed (default: random, printed)")
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    args = parser.parse_args(argv)
    mutants = enumerate_mutants(args.file)
    if args.only:
        mutants = [p for p in mutants if p[0].id in args.only]
    if args.list:
        for m, _ in mutants:
            print(f"{m.id:<55} line {m.line:<4} {m.function:<28} {m.code_line[:50]!r} -> {m.mutated_line[:50]!r}")
        print(f"{len(mutants)} mutants")
        return 0
    if args.sample is not None:
        seed = args.seed if args.seed is not None else random.randrange(10 ** 6)
        print(f"sample of {args.sample} with --seed {seed}")
        mutants = random.Random(seed).sample(mutants, min(args.sample, len(mutants)))
    start = time.monotonic()
    outcomes = run(mutants, args.workers)
    s = summary(outcomes)
    print(json.dumps(s), f"wall {time.monotonic() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"summary": s, "outcomes": outcomes}, indent=1))
    return 0 if s["survived"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
