"""Hanging submissions graded in full (issue 8; ``python -m staff.grader_selftest.zoo --hangs``): a hang costs only
the tests that reach it.

Each case puts a hang into one task function of the reference (at its first statement) and grades the whole
suite with Gradescope's defaults; the points it loses must all be tests that call the hung function (in the
reference's traced calls, test_times.json) and, for a hang confined to a branch, take that branch.
tests/staff/test_grading_budget.py runs them. Staff-only, like the zoo.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from staff.autograder import grade
from staff.autograder.grading_limits import TIMES_FILE
from staff.grader_selftest import mutations
from staff.grader_selftest.zoo_processes import TAG_VAR, kill_tagged, tagged_processes

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class HangCase:
    id: str
    what: str
    task: int
    function: str          # the task function (in the reference) the hang is put into, at its first statement
    code: str              # inserted there; {arg0}, {arg1}, ... are the function's parameters
    # For a hang confined to a branch: the same branch raising instead of hanging. Graded first, its failures are
    # the tests that take the branch (what the hang may cost); the hang must cost no test outside them.
    raising_twin: str | None = None


HANG_CASES: list[HangCase] = [
    HangCase("hang_task1", "materialize_meta_module loops forever (every rank)", 1, "materialize_meta_module",
             "while True:  # zoo: never ends\n    pass\n"),
    HangCase("hang_task4", "accumulating into an existing gradient, rank 0 calls a collective no other rank calls",
             4, "accumulate_shard_grad",
             "import torch.distributed as _zd\n"
             "if {arg0}.shard.grad is not None and _zd.get_rank() == 0:  # zoo: rank 0 only\n"
             "    _zd.all_reduce(torch.zeros(1))\n"),
    HangCase("hang_task6", "backward prefetch: rank 0 calls a collective no other rank calls", 6, "prefetch_backward",
             "import torch.distributed as _zd\n"
             "if _zd.get_rank() == 0:  # zoo: rank 0 only\n"
             "    _zd.all_reduce(torch.zeros(1))\n"),
    # issue 18: a hang only in post_forward's reshard_after_forward=False branch, which every test passes through
    # post_forward: blamed per function alone, it cost 49 of 69 later tests
    HangCase("hang_branch", "post_forward hangs (every rank) only when the unit keeps its parameters after forward",
             3, "post_forward",
             "import time as _zt\n"
             "while not {arg1}.reshard_after_forward:  # zoo: the reshard_after_forward=False branch only\n"
             "    _zt.sleep(0.05)\n",
             raising_twin="if not {arg1}.reshard_after_forward:  # zoo: the same branch, raising\n"
                          "    raise RuntimeError('zoo: the reshard_after_forward=False branch')\n"),
]


def inject_at_start(source: str, function: str, code: str) -> str:
    """``code`` as the first statements of ``function`` (a function or method, after its docstring)."""
    import ast
    import textwrap
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name == function]
    if len(found) != 1:
        raise ValueError(f"{function}: {len(found)} definitions (expected one)")
    node = found[0]
    body = node.body
    first = body[1] if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)) else body[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    args = node.args.posonlyargs + node.args.args
    code = code.format(**{f"arg{i}": a.arg for i, a in enumerate(args)})
    lines.insert(first.lineno - 1, textwrap.indent(code, indent))
    return "".join(lines)


def hang_case_files(case: HangCase, root: Path = ROOT, *, twin: bool = False) -> dict[str, str]:
    files = mutations.reference_student_files(root)
    rel = f"fsdp_assignment/{mutations.TASK_FILES[case.task]}"
    files[rel] = inject_at_start(files[rel], case.function, case.raising_twin if twin else case.code)
    compile(files[rel], rel, "exec")
    return files


def _grade_files(files: dict[str, str], tree: Path, results: Path, timeout: float, root: Path,
                 pytest_args: list[str] | None = None) -> tuple:
    mutations.stage_tree(tree, files, root)
    tag = uuid.uuid4().hex
    cmd = grade.command("--results", str(results), "--rank-user", "none", "--timeout", f"{timeout:g}",
                        *(["--", *pytest_args] if pytest_args else []))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=dict(os.environ, **{TAG_VAR: tag}), capture_output=True, text=True)
    seconds = time.monotonic() - start
    time.sleep(0.2)
    survivors = tagged_processes(tag)
    kill_tagged(tag)
    return proc, json.loads(results.read_text()), seconds, survivors


def run_hang_case(case: HangCase, workdir: Path, *, timeout: float = 540, root: Path = ROOT) -> dict:
    """Grade the whole suite (Gradescope's defaults: --timeout 540, budget 480 s) on the hanging submission.
    Returns the score, the points lost per task, the lost tests split into those that call the hung function
    (in the reference's traced calls, test_times.json: lost on the merits) and any other (``problems``: points the
    hang cost through the time budget), and the grading time. A case with a raising twin (a hang confined to a
    branch) grades the twin first: a lost test that the twin passed never took the branch, and is a problem too."""
    takes_branch = None
    if case.raising_twin is not None:
        _, twin, _, _ = _grade_files(hang_case_files(case, root, twin=True), workdir / f"{case.id}-twin",
                                     workdir / f"{case.id}-twin.json", timeout, root)
        takes_branch = {t["name"] for t in twin["tests"] if t["status"] != "passed"}
    proc, data, seconds, survivors = _grade_files(hang_case_files(case, root), workdir / case.id,
                                                  workdir / f"{case.id}.json", timeout, root)
    times = json.loads(TIMES_FILE.read_text())["tests"]
    hung = f"{mutations.TASK_FILES[case.task]}:{case.function}"
    # results.json names a test "Task N public: test_file.py::test_name[param]"
    by_short_name = {f"{Path(k.split('::')[0]).name}::{k.split('::', 1)[1]}": k for k in times}
    lost: dict[int, float] = {}
    on_merit, problems = [], []
    for t in data["tests"]:
        if t["status"] == "passed":
            continue
        task = int(t["number"].split(".")[0])
        lost[task] = lost.get(task, 0.0) + t["max_score"]
        nodeid = by_short_name.get(t["name"].split(": ", 1)[1])
        why = t["output"].split(chr(10) + chr(10), 1)[-1][:300]
        if nodeid is None or hung not in times[nodeid]["calls"]:
            problems.append(f"{t['name']} lost {t['max_score']:.2f} points but does not call {hung}: {why}")
        elif takes_branch is not None and t["name"] not in takes_branch:
            problems.append(f"{t['name']} lost {t['max_score']:.2f} points but never takes the branch that hangs "
                            f"(it passed with the branch raising): {why}")
        else:
            on_merit.append(t["name"])
    if not lost.get(case.task):
        problems.append(f"the hang in {hung} cost Task {case.task} nothing: no test that calls it failed")
    if survivors:
        problems.append(f"processes survived: {survivors}")
    if "has not finished" in data.get("output", ""):
        problems.append("the grading run did not finish")
    not_run_at_once = sum("hung in" in t["output"] and "not run" in t["output"] for t in data["tests"])
    probes = sum("note: a probe" in t["output"] for t in data["tests"])
    return {"case": case.id, "score": data["score"], "lost_by_task": {k: round(v, 2) for k, v in sorted(lost.items())},
            "lost_tests_calling_the_hung_function": len(on_merit), "reported_not_run_at_once": not_run_at_once,
            "probes": probes, "tests_taking_the_branch": None if takes_branch is None else len(takes_branch),
            "problems": problems, "seconds": round(seconds, 1), "load_1min": round(os.getloadavg()[0], 1),
            "summary": proc.stdout[proc.stdout.find("score by task"):][:2500]}
