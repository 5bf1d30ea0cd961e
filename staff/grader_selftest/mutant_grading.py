"""Grading a mutant: the one path both mutation systems take (mutations.py, hand-written; machine_mutants.py,
cosmic-ray), so that what kills a mutant is decided in one place.

A mutant is the seven reference task files in the students' layout with one edit. It is staged as the student
files of a fresh grading tree (the bundle's, ``build_bundle.stage``) and graded by the real grading command
(``grade.py``: the grading plugin's limits, deselection and ordering) with ``-x``, on the graded tests that call a
function it mutates (``test_times.json``'s traced calls; ``tests_calling``), the mutated task's first. The rule:

- **killed** when a test ran and failed (its first failure, in run order, is the killer), or when the whole run
  had to be killed at its timeout (a hang, killer "hang");
- **survived** when every selected test passed (``grade_mutant``'s caller may then grade it on more tests);
- a run that leaves no results.json kills nothing: it is reported (a broken grader is never a kill).

Staff-only, like both mutation systems: mutants are pieces of the solution.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from staff.autograder import build_bundle, grade
from staff.autograder.grading_limits import TIMES_FILE

ROOT = Path(__file__).resolve().parents[2]
TIMES = TIMES_FILE

TASK_FILES = {1: "task1_meta_init.py", 2: "task2_flat_param.py", 3: "task3_forward.py",
              4: "task4_backward.py", 5: "task5_optim_ckpt.py", 6: "task6_prefetch.py",
              7: "task7_fully_shard.py"}

# Graded tests that test_times.json does not list yet (added after its last measurement), with the task functions
# they call and a rough time; test_times.json's own entry wins once it is regenerated (delete the file then).
# new_test_calls.json: issue 41's public tests, from a timed and a traced grading run of the reference on them alone
# (seconds at load 4-5 on 2 cores; the first test of each run also pays its start, 2-4 s).
_NEW_TESTS_FILE = Path(__file__).with_name("new_test_calls.json")
NEW_TESTS: dict[str, dict] = json.loads(_NEW_TESTS_FILE.read_text()) if _NEW_TESTS_FILE.exists() else {}


# ---- the files -----------------------------------------------------------------------------------------------
def student_form(text: str) -> str:
    """A reference task file as it would sit in the students' package (fsdp_assignment/)."""
    text = re.sub(r"^(\s*)from(\s+)\.\.", r"\1from\2.", text, flags=re.MULTILINE)
    return text.replace("fsdp_assignment.reference.", "fsdp_assignment.")


def reference_student_files(root: Path = ROOT) -> dict[str, str]:
    """``fsdp_assignment/taskN_*.py`` -> the reference's code in the student layout."""
    return {f"fsdp_assignment/{name}": student_form((root / "fsdp_assignment" / "reference" / name).read_text())
            for name in TASK_FILES.values()}


def stage_tree(dest: Path, files: dict[str, str], root: Path = ROOT) -> None:
    build_bundle.stage(dest, root)
    for rel, text in files.items():
        (dest / rel).write_text(text)


# ---- which tests: those that call the mutated function ------------------------------------------------------
def functions_by_line(source: str) -> dict[int, str]:
    """line -> innermost enclosing function name."""
    out: dict[int, str] = {}
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda n: n.end_lineno - n.lineno, reverse=True):  # outer first, inner wins
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # a decorator belongs to its def
        for line in range(first, node.end_lineno + 1):
            out[line] = node.name
    return out


def functions_edited(source: str, old: str) -> set[str]:
    """The innermost functions of every line an edit of ``old`` (occurring once in ``source``) touches; "<module>"
    for a line outside every function."""
    start = source.index(old)
    first = source.count("\n", 0, start) + 1
    last = first + old.rstrip("\n").count("\n")
    functions = functions_by_line(source)
    return {functions.get(line, "<module>") for line in range(first, last + 1)}


def test_times() -> dict[str, dict]:
    return {**NEW_TESTS, **json.loads(TIMES.read_text())["tests"]}


def tests_calling(file: str, functions: set[str] | str) -> list[tuple[str, float]]:
    """The graded tests that call any of ``functions`` of task file ``file``, cheapest first: (node id, measured
    seconds). Empty when one of them is "<module>" (module-level code runs for every test) or none is called."""
    functions = {functions} if isinstance(functions, str) else set(functions)
    if "<module>" in functions:
        return []
    keys = {f"{file}:{f}" for f in functions}
    return sorted(((t, v["seconds"] or 1.0) for t, v in test_times().items() if keys & set(v["calls"])),
                  key=lambda x: x[1])


# ---- grading ------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    killed: bool
    killer: str      # the first failing test's name, "hang", or "" when nothing failed
    seconds: float
    tests: int       # how many tests were graded
    detail: str = ""  # the killer's output, first lines; or why nothing failed


def first_failure(results: dict) -> dict | None:
    """The first test, in run order, that ran and failed (not one marked 'not run')."""
    for t in results.get("tests", []):
        body = t["output"].split("\n\n", 1)[-1]
        if t["status"] == "failed" and not body.startswith(("not run", "did not finish")):
            return t
    return None


def select_args(names: list[str]) -> list[str]:
    """pytest arguments that grade the tests of these names (a node id's part after ``::``): ``-k`` on them (a
    name that is also part of another's selects that one too: more tests, never fewer)."""
    return ["-k", " or ".join(dict.fromkeys(names))]


def public_test_files(root: Path = ROOT) -> list[str]:
    """The public test files (``tests/public/test_*.py``), relative to a grading tree's root."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests" / "public").glob("test_*.py"))


def grade_mutant(files: dict[str, str], workdir: Path, name: str, pytest_args: list[str], *, timeout: float = 600,
                 timeout_cap: float = 45, root: Path = ROOT, public_only: bool = False) -> Verdict:
    """Stage ``files`` as a student's submission and grade it with ``-x`` and ``pytest_args`` (the selection and
    order: ``select_args``, ``--grade-first-task``, ``--grade-first``). The rule is the module docstring's.
    ``public_only``: the tree has no hidden tests (what a student can run), so only public tests can kill."""
    start = time.monotonic()
    tree = workdir / name
    stage_tree(tree, files, root)
    if public_only:
        shutil.rmtree(tree / "tests" / "hidden")
    results = workdir / f"{name}.json"
    cmd = grade.command("--results", str(results), "--rank-user", "none", "--timeout", f"{timeout:g}",
                        "--timeout-cap", f"{timeout_cap:g}", "--", "-x", *pytest_args)
    try:
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout + 120)
        output = proc.stdout
    except subprocess.TimeoutExpired as e:  # grade.py kills its own run at --timeout; this is its backstop
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    seconds = time.monotonic() - start
    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError):
        return Verdict(False, "", seconds, 0, f"no results.json; grader output:\n{output[-2000:]}")
    tests = data.get("tests", [])
    if not tests:
        raise RuntimeError(f"{name}: the grading run graded no test; grader output:\n{output[-3000:]}")
    failed = first_failure(data)
    if failed is not None:
        return Verdict(True, failed["name"], seconds, len(tests), failed["output"].split("\n\n", 2)[-1][:400])
    if "has not finished" in data.get("output", ""):  # killed at --timeout while a test ran: a hang
        return Verdict(True, "hang", seconds, len(tests), "the grading run was killed at its timeout")
    return Verdict(False, "", seconds, len(tests), f"all {len(tests)} tests passed")
