"""The tests' instrumentation, as the staff review sees it: the private attributes of the classes that record what
a rank does (the collective counter and its handles, the invariant monitor, the harness's rooms), read from the
grading tree's own ``tests/`` folder.

Only the in-rank records can see some properties (the overlap of a reduce-scatter with backward's computation,
the order of hooks), so a rank that edits those records lies where the kernel cannot judge: issue 35's
``rs_waited_at_once`` puts a waited handle back among the counter's unwaited ones (``work._log._pending.add(...)``),
with no frame, no ``gc``, no patched module. Honest code never touches these names: the reference, the stubs and
the staff alternatives use none of them (tests/staff/test_review.py). A name counts as the submission's own, and
is not flagged, when the submission's file defines it itself (a method of that name, a class attribute, or an
attribute its methods assign on ``self``), so a student's ``self._state`` stays theirs.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
# What runs in a rank besides the body and records what it does: the tests' helpers and the harness's rooms.
INSTRUMENTED = ("public/*.py", "harness.py", "harness_*.py", "rank_*.py")
GETTERS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> set[str]:
    """Private names the classes of a module define: their methods, class attributes and the attributes their
    methods assign on ``self`` or ``cls`` (``self._n = ...``). An assignment on any other object
    (``type(group)._record = f``) defines nothing: it edits someone else's class."""
    names: set[str] = set()
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        names.update(t.id for item in cls.body if isinstance(item, (ast.Assign, ast.AnnAssign))
                     for t in (item.targets if isinstance(item, ast.Assign) else [item.target])
                     if isinstance(t, ast.Name) and _private(t.id))
    return names


@functools.lru_cache(maxsize=1)
def instrumentation_names(tests: Path = TESTS) -> dict[str, str]:
    """{private attribute name: the file of tests/ that defines it}, for the classes of the instrumented files
    (test modules themselves excluded: their functions run in the parent)."""
    found: dict[str, str] = {}
    for pattern in INSTRUMENTED:
        for path in sorted(tests.glob(pattern)):
            if path.name.startswith("test_"):
                continue
            try:
                tree = ast.parse(path.read_bytes())
            except (OSError, SyntaxError, ValueError):
                continue
            for name in defined_names(tree):
                found.setdefault(name, path.relative_to(tests.parent).as_posix())
    return found


def instrumentation_flags(tree: ast.AST, lines: list[str]) -> list[dict]:
    """A flag (kind ``harness``) for each use of a private name of the tests' instrumentation that the file does
    not define itself: an attribute (``log._pending``) or a literal name given to getattr and its kin."""
    known = instrumentation_names()
    if not known:
        return []
    own = defined_names(tree)
    flags = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETTERS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            name = node.args[1].value
        if name in known and name not in own:
            line = getattr(node, "lineno", 0)
            code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            flags.append({"line": line, "kind": "harness", "code": code[:200],
                          "what": f"uses .{name}, a private attribute of the tests' instrumentation "
                                  f"({known[name]}), which the file does not define"})
    return flags
