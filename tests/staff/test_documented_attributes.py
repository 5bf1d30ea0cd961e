"""Every attribute a test or a later task reads is documented in the stub that defines it (staff only; fast).

Students build each task from its stub alone (generated from the reference by ``staff/make_stubs.py``), so an
attribute that the tests, or a later task's code or docstring, read on an object a task creates is part of that
task's specification: its name must appear in the stub's docstrings. Two kinds of definer are checked:

- the ``FlatParameter`` attributes (Task 2): every ``self.<name> = ...`` of the reference class; documented in
  the class or ``__init__`` docstring of the Task 2 stub;
- the attributes ``fully_shard`` (Task 7) sets on the module it is given (``module.<name> = ...``, e.g.
  ``_fsdp_unit``); documented in the Task 7 stub's module docstring, ``FSDPModule`` or ``fully_shard``.

Readers: every public and hidden test file (attribute loads, ``x.<name>``) and, for Task 2, the reference code
and docstrings of Tasks 3 to 7 (``.<name>`` anywhere in their source). A name that is also a tensor method
(``numel``) may be flagged by a read on a tensor: documenting it costs a line, and missing a real read costs a
student hours.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "fsdp_assignment" / "reference"
STUBS = ROOT / "fsdp_assignment"
TESTS = sorted((ROOT / "tests" / "public").glob("*.py")) + sorted((ROOT / "tests" / "hidden").glob("*.py"))
LATER_THAN_2 = ["task3_forward.py", "task4_backward.py", "task5_optim_ckpt.py", "task6_prefetch.py",
                "task7_fully_shard.py"]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _find(tree: ast.AST, kind, name: str):
    return next(n for n in ast.walk(tree) if isinstance(n, kind) and n.name == name)


def _assigned(node: ast.AST, owner: str) -> set[str]:
    """Names ``X`` of every ``<owner>.X = ...`` (or augmented/annotated assignment) under ``node``."""
    out = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == owner:
                out.add(t.attr)
    return {a for a in out if not a.startswith("__")}


def _loads(paths) -> dict[str, set[str]]:
    """attribute name -> the files that load it (``x.name`` in an expression)."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                out.setdefault(n.attr, set()).add(path.relative_to(ROOT).as_posix())
    return out


def _docs(*nodes) -> str:
    return "\n".join(ast.get_docstring(n) or "" for n in nodes)


def _undocumented(attrs: set[str], doc: str, readers: dict[str, set[str]]) -> list[str]:
    return [f"{a} (read in {', '.join(sorted(readers[a]))})" for a in sorted(attrs)
            if a in readers and not re.search(rf"\b{re.escape(a)}\b", doc)]


def test_flat_parameter_attributes_that_are_read_are_documented_in_the_task2_stub():
    attrs = _assigned(_find(_tree(REF / "task2_flat_param.py"), ast.ClassDef, "FlatParameter"), "self")
    assert {"shard", "unsharded", "unsynced_grad"} <= attrs, f"the scan found too little: {attrs}"
    readers = _loads(TESTS)
    for name in LATER_THAN_2:  # later tasks: their code and their docstrings (what the student reads)
        for a in set(re.findall(r"\.(\w+)", (REF / name).read_text(encoding="utf-8"))) & attrs:
            readers.setdefault(a, set()).add(f"fsdp_assignment/reference/{name}")
    stub = _find(_tree(STUBS / "task2_flat_param.py"), ast.ClassDef, "FlatParameter")
    doc = _docs(stub, _find(stub, ast.FunctionDef, "__init__"))
    missing = _undocumented(attrs, doc, readers)
    assert not missing, ("FlatParameter attributes read by tests or later tasks but not named in the Task 2 stub's "
                         "FlatParameter/__init__ docstrings (document them in the reference, then run "
                         "python staff/make_stubs.py):\n  " + "\n  ".join(missing))


def test_module_attributes_fully_shard_sets_that_are_read_are_documented_in_the_task7_stub():
    ref = _tree(REF / "task7_fully_shard.py")
    attrs = _assigned(_find(ref, ast.FunctionDef, "fully_shard"), "module")
    assert "_fsdp_unit" in attrs, f"the scan found too little: {attrs}"
    stub = _tree(STUBS / "task7_fully_shard.py")
    doc = _docs(stub, _find(stub, ast.ClassDef, "FSDPModule"), _find(stub, ast.FunctionDef, "fully_shard"))
    missing = _undocumented(attrs, doc, _loads(TESTS))
    assert not missing, ("module attributes fully_shard sets that tests read but the Task 7 stub does not name "
                         "(document them in the reference's fully_shard docstring, then python staff/make_stubs.py):"
                         "\n  " + "\n  ".join(missing))


def test_every_public_method_and_property_of_a_stub_class_has_a_docstring():
    # A stub member without a docstring gives the student nothing but a name (FSDPModule.fsdp_unit once did).
    missing = []
    for path in sorted(STUBS.glob("task*.py")):
        for cls in (n for n in _tree(path).body if isinstance(n, ast.ClassDef)):
            for m in cls.body:
                if isinstance(m, ast.FunctionDef) and (not m.name.startswith("_") or m.name == "__init__") \
                        and not ast.get_docstring(m):
                    missing.append(f"{path.name}: {cls.name}.{m.name}")
    assert not missing, "stub members without a docstring:\n  " + "\n  ".join(missing)
