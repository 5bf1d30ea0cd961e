"""The tests' instrumentation, as the staff review sees it: the private attributes of the classes that record what
a rank does (the collective counter and its handles, the invariant monitor, the harness's rooms), read from the
grading tree's own ``tests/`` folder.

Only the in-rank records can see some properties (the overlap of a reduce-scatter with backward's computation,
the order of hooks), so a rank that edits those records lies where the kernel cannot judge: issue 35's
``rs_waited_at_once`` puts a waited handle back among the counter's unwaited ones (``work._log._pending.add(...)``),
with no frame, no ``gc``, no patched module. Honest code never touches these names: the reference, the stubs and
the staff alternatives use none of them (tests/staff/test_review.py). A name counts as the submission's own, and
is not flagged, when any of the submission's files defines it (``defined_names``: a method, a class attribute,
an attribute assigned on ``self`` or on an object the submission built), so a student's ``self._state``, or the
``_index`` of their FlatParameter set in Task 2 and read in Task 3, stays theirs (issue 40, item 6).

What this cannot tell: a name the submission both defines for an object of its own and uses on the tests' objects
(a decoy ``self._log = None`` in a class of its own, then ``work._log._pending``) is taken as its own. A person
reading a flagged submission sees the decoy; an unflagged one is not read. The runtime audit sees no attribute
reads either.
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


# Names the tests' classes define that torch's own objects define too: the counted process group overrides
# ProcessGroup._allgather_base and _reduce_scatter_base, which honest code may call (``dist._reduce_scatter_base``,
# an older spelling of reduce_scatter_tensor). tests/staff/test_review.py checks this list against torch.
TORCH_NAMES = frozenset({"_allgather_base", "_reduce_scatter_base"})
# Calls that return the model's own objects: a loop over them names the submission's modules and parameters.
MODEL_ITERATORS = {"parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
                   "children", "named_children"}
DICT_READS = {"get", "pop", "setdefault", "__getitem__", "__setitem__", "__delitem__", "__contains__"}


def _function_nodes(scope: ast.AST):
    """The nodes of a function's (or a module's) own body, not those of the functions and classes in it."""
    stack = list(scope.body)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))


def _built_here(value: ast.AST, classes: set[str]) -> bool:
    """Whether ``value`` builds a new object of the submission's: a class it defines (``FlatParameter(...)``),
    ``super().__new__(cls)``/``X.__new__(...)``, or a tensor or module from torch (``nn.Parameter(...)``,
    ``torch.empty(...)``), never a collective's handle (``torch.distributed``) nor what a builtin hands back
    (``getattr(work, '_log')``, ``type(group)``, ``next(...)``)."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Name):
        return func.id in classes
    if isinstance(func, ast.Attribute):
        if func.attr == "__new__":
            return True
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name):
            dotted = ".".join([func.id] + parts[::-1])
            return parts[0] in classes or (dotted.split(".")[0] in ("torch", "nn") and
                                           not any(part in ("distributed", "dist") for part in dotted.split(".")))
    return False


def _own_receivers(scope: ast.AST, classes: set[str]) -> set[str]:
    """Names in ``scope`` that hold the submission's own objects: ``self``/``cls``, a name bound to an object built
    there (``flat = FlatParameter(...)``, ``p = super().__new__(cls, data)``), a loop variable over the model's
    modules or parameters (``for name, p in module.named_parameters()``)."""
    names = {"self", "cls"}
    for node in _function_nodes(scope):
        if isinstance(node, ast.Assign) and _built_here(node.value, classes):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.iter, ast.Call):
            call = node.iter
            if isinstance(call.func, ast.Name) and call.func.id == "enumerate" and call.args and \
                    isinstance(call.args[0], ast.Call):
                call = call.args[0]
            if isinstance(call.func, ast.Attribute) and call.func.attr in MODEL_ITERATORS:
                target = node.target
                while isinstance(target, ast.Tuple) and target.elts:
                    target = target.elts[-1]
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return names


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dict_of(node: ast.AST) -> ast.AST | None:
    """``x`` when ``node`` is ``x.__dict__`` or ``vars(x)``."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    return None


def defined_names(tree: ast.AST) -> set[str]:
    """Private names a submission's file defines as its own (issue 40: "their own private names, defined or
    assigned anywhere in the submission"): the methods and class attributes of its classes (dataclass fields and
    ``__slots__`` included), and every private attribute it assigns on an object of its own: ``self``/``cls``,
    an object it built (``flat = FlatParameter(...); flat._index = i``), a module or parameter of the model
    (``for p in module.parameters(): p._index = i``), through ``setattr(x, '_n', v)`` or ``x.__dict__['_n'] = v``
    as well. An assignment on any other object (``type(group)._record = f``, ``work._log = x``, a parameter of
    the function) defines nothing: it edits someone else's object."""
    names: set[str] = set()
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                names.add(item.name)
            targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
                if isinstance(item, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and _private(t.id):
                    names.add(t.id)
                if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                    names.update(v for v in map(_literal, item.value.elts) if v and _private(v))
        for node in ast.walk(cls):  # methods nested in methods too
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        own = _own_receivers(scope, classes)
        for node in _function_nodes(scope):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in own:
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                    len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id in own:
                name = _literal(node.args[1])
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                holder = _dict_of(node.value)
                if isinstance(holder, ast.Name) and holder.id in own:
                    name = _literal(node.slice)
            if name and _private(name):
                names.add(name)
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


def instrumentation_flags(tree: ast.AST, lines: list[str], own: set[str] | None = None) -> list[dict]:
    """A flag (kind ``harness``) for each use of a private name of the tests' instrumentation that the submission
    does not define itself (``own``: defined_names over all its files; this file's alone when not given): an
    attribute (``log._pending``), a literal name given to getattr and its kin, or a literal key of an object's
    ``__dict__`` (``group.__dict__['_record'] = f``, ``vars(work).get('_log')``)."""
    known = {k: v for k, v in instrumentation_names().items() if k not in TORCH_NAMES}
    if not known:
        return []
    own = defined_names(tree) if own is None else own
    flags = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETTERS \
                and len(node.args) >= 2:
            name = _literal(node.args[1])
        elif isinstance(node, ast.Subscript) and _dict_of(node.value) is not None:
            name = _literal(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DICT_READS \
                and _dict_of(node.func.value) is not None and node.args:
            name = _literal(node.args[0])
        if name in known and name not in own:
            line = getattr(node, "lineno", 0)
            code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            flags.append({"line": line, "kind": "harness", "code": code[:200],
                          "what": f"uses .{name}, a private attribute of the tests' instrumentation "
                                  f"({known[name]}), which the submission does not define"})
    return flags
