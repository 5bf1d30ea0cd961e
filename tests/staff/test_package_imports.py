"""The autograder and its self-tests are packages (issue 32): ``staff.autograder`` (what ships to Gradescope) and
``staff.grader_selftest`` (zoo, mutants, lies, timing). Their modules import each other as package modules
(``from .grading_selection import ...``, ``from staff.autograder import grade``), never by putting their own folder
on ``sys.path`` and importing a sibling as a top-level module: with that, neither a reader nor a tool can follow
who uses whom, and a module could be loaded twice under two names. Static (``ast``), well under a second."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "staff" / "autograder", ROOT / "staff" / "grader_selftest")
# The packages' commands (python -m MODULE from the repository root): --help shows the docstring's usage lines.
COMMANDS = ("staff.autograder.grade", "staff.autograder.build_bundle", "staff.autograder.review",
            "staff.grader_selftest.zoo",
            "staff.grader_selftest.mutations", "staff.grader_selftest.lies", "staff.grader_selftest.measure_times",
            "staff.grader_selftest.machine_mutants", "staff.grader_selftest.machine_mutants_report")


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def import_problems(source: str, siblings: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every edit of ``sys.path`` in ``source`` (a call of one of its methods, an assignment to it
    or to a slice of it) and every absolute import of a module named in ``siblings`` (a top-level import of a
    module that lives beside it). Code inside string literals (the zoo's submissions) is not code here."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value):
            problems.append((node.lineno, f"sys.path.{node.func.attr}(...)"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value)):
                    problems.append((node.lineno, "assigns to sys.path"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in siblings:
                    problems.append((node.lineno, f"import {alias.name} (a sibling as a top-level module)"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in siblings:
                problems.append((node.lineno, f"from {node.module} import ... (a sibling as a top-level module)"))
    return problems


def test_the_check_catches_each_way_of_reaching_a_sibling():
    """The check itself, on small sources: each form is caught with its line; package imports pass."""
    siblings = {"grade", "cleanup"}
    bad = ("import sys\n"
           "sys.path.insert(0, 'x')\n"
           "sys.path.append('x')\n"
           "sys.path[:0] = ['x']\n"
           "sys.path = ['x']\n"
           "import grade\n"
           "from cleanup import kill\n"
           "def f():\n"
           "    import cleanup.sub as c\n")
    assert sorted(line for line, _ in import_problems(bad, siblings)) == [2, 3, 4, 5, 6, 7, 9]
    good = ("import sys\n"
            "from . import grade\n"
            "from .cleanup import kill\n"
            "from staff.autograder import grade as g\n"
            "print(sys.path)\n"
            "CODE = 'import sys\\nsys.path.insert(0, \"x\")\\nimport grade\\n'\n")
    assert import_problems(good, siblings) == []


def test_no_module_of_the_grader_edits_sys_path_or_imports_a_sibling_top_level():
    siblings = {p.stem for package in PACKAGES for p in package.glob("*.py")} - {"__init__"}
    found = []
    for package in PACKAGES:
        assert (package / "__init__.py").is_file(), f"{package.relative_to(ROOT)} is not a package"
        for path in sorted(package.glob("*.py")):
            for line, what in import_problems(path.read_text(encoding="utf-8"), siblings):
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, ("import the grader's modules as package modules (from .x import ..., from staff.autograder "
                       "import x), never through sys.path:\n  " + "\n  ".join(found))


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_shows_its_usage_with_help(name, capsys):
    """Issue 31: ``--help`` printed the docstring's first line only; a TA needs the command lines."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    usage = [line.strip() for line in module.__doc__.splitlines() if line.strip().startswith(f"python -m {name}")]
    assert usage, f"{name}'s docstring has no 'python -m {name} ...' usage line"
    missing = [line for line in usage if line not in out]
    assert not missing, f"python -m {name} --help does not show its usage lines: {missing}"
