"""The student stubs are generated from the reference (staff/make_stubs.py): fail when they drift apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.staff
def test_stubs_match_the_reference():
    proc = subprocess.run([sys.executable, "staff/make_stubs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.staff
def test_every_stub_function_raises_naming_its_task():
    # Run in a subprocess: the pytest process never imports task modules.
    code = r"""
import ast, pathlib, sys
sys.path.insert(0, '.')
from adapters import TASK_MODULES
bad = []
for task, name in TASK_MODULES.items():
    tree = ast.parse(pathlib.Path(f'fsdp_assignment/{name}.py').read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith('_') or getattr(node, 'name', '') == '__init__':
            raise_ = node.body[-1]
            text = ast.unparse(raise_)
            if not (isinstance(raise_, ast.Raise) and f'Task {task}: implement' in text):
                bad.append(f'{name}.{node.name}')
print('\n'.join(bad))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"stub functions that do not raise NotImplementedError('Task N: ...'): {proc.stdout}"


def _make_stubs():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_stubs", ROOT / "staff" / "make_stubs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_names(path: Path) -> set[str]:
    """Every name and attribute that ``path``'s code uses (strings and comments aside)."""
    import ast
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


@pytest.mark.staff
def test_what_the_stubs_leave_out_nothing_outside_the_task_files_calls():
    """``make_stubs.SUGGESTED`` drops the reference's own decomposition from the stubs (the student designs it):
    no test, adapter or benchmark may use one of those names, or a student's design could not pass."""
    suggested = {name.split(".")[-1] for names in _make_stubs().SUGGESTED.values() for name in names}
    suggested -= {"reduce_scatter"}  # also torch.distributed's, which tests/public/collectives.py wraps
    users = [ROOT / "adapters.py", *sorted((ROOT / "tests" / "public").glob("*.py")),
             *sorted((ROOT / "tests" / "hidden").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    used = {f"{path.relative_to(ROOT)}: {name}" for path in users for name in _code_names(path) & suggested}
    assert not used, (f"names the stubs leave out (staff/make_stubs.py, SUGGESTED) are used outside the task files: "
                      f"{sorted(used)}; keep them in the stub (take them out of SUGGESTED) or stop using them")


@pytest.mark.staff
def test_the_stubs_leave_out_the_suggested_names():
    import ast
    for filename, names in _make_stubs().SUGGESTED.items():
        tree = ast.parse((ROOT / "fsdp_assignment" / filename).read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {f"{c.name}.{m.name}" for c in tree.body if isinstance(c, ast.ClassDef)
                    for m in c.body if isinstance(m, ast.FunctionDef)}
        assert not (names & defined), f"fsdp_assignment/{filename} still defines {sorted(names & defined)}"
