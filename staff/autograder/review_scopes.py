"""What a name stands for in a submitted file, for the staff review's rules (review_rules.py): the module or
attribute an alias is bound to, however it was bound, and the text a string expression builds.

One pass over the tree gives every node its parent and its scope, and every scope the bindings made in it
(imports, ``x = <expr>``, parameters, loop targets, ...), flow-insensitively: a name bound anywhere in a scope
to ``torch.distributed`` is an alias of it everywhere in that scope, even where another binding of it is live
too. Over-approximating is the safe side for a review (a person reads the line); under-approximating is what
let ``_US = torch.UntypedStorage; _US.size = f`` through (issue 36).

An origin is a dotted name rooted in an import (``torch.distributed.all_reduce``, ``.support.state.FSDPUnit``),
``<builtin>.NAME`` for a builtin (``g = getattr`` makes ``g`` one), or ``<class>`` for the class of an object
(``type(x)``, ``x.__class__``, and each class of a walk: ``cls.__mro__[1]``, ``for base in cls.__mro__``):
patching that patches every instance, the tests' included. Reading a class walk is honest (Task 7 names the
user's class behind a dynamic subclass through ``__mro__``); what is assigned on the classes it reaches is a patch."""

from __future__ import annotations

import ast
import builtins
import posixpath
import re

BUILTINS = set(dir(builtins)) | {"__builtins__", "__loader__", "__spec__"}
CLASS = "<class>"
# Attributes that hold a class (or classes): what they reach is the class of an object, however it is walked.
CLASS_ATTRIBUTES = {"__class__", "__mro__", "__bases__", "__base__"}
UNKNOWN = "\x00"  # a part of a string that is only known at run time
MAX_FOLDED = 4096
STR_METHODS = {"replace", "upper", "lower", "strip", "lstrip", "rstrip", "removeprefix", "removesuffix",
               "swapcase", "title", "capitalize", "casefold", "zfill", "center", "ljust", "rjust"}


def _own_nodes(function: ast.AST):
    """The nodes of a function's body, not those of the functions and classes defined in it."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))


class Scope:
    __slots__ = ("kind", "parent", "bindings", "declared_global")

    def __init__(self, kind: str, parent: Scope | None):
        self.kind, self.parent = kind, parent
        self.bindings: dict[str, list[tuple]] = {}  # name -> ("import", dotted) | ("value", expr) | ("other",)
        self.declared_global: set[str] = set()


class Scopes:
    def __init__(self, tree: ast.AST):
        self.module = Scope("module", None)
        self._cache: dict[int, str | None] = {}
        self._strings: dict[int, tuple[str, bool]] = {}
        self.attributes: dict[str, list[ast.AST]] = {}  # attribute name -> values assigned to it anywhere
        self._walk(tree, self.module, None)

    # ---- the pass: parents, scopes, bindings --------------------------------------------------------------
    def _bind(self, scope: Scope, name: str, how: tuple) -> None:
        (self.module if name in scope.declared_global else scope).bindings.setdefault(name, []).append(how)

    def _walk(self, node: ast.AST, scope: Scope, parent: ast.AST | None) -> None:
        # Iterative, with an explicit stack: a deeply nested expression must not exhaust the recursion limit.
        stack = [(node, scope, parent)]
        while stack:
            node, scope, parent = stack.pop()
            node._rv_parent, node._rv_scope = parent, scope
            inner = scope
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._bind(scope, node.name, ("def", node))  # what it returns is followed (def m(): return dist)
                elif isinstance(node, ast.ClassDef):
                    self._bind(scope, node.name, ("other",))
                inner = Scope("class" if isinstance(node, ast.ClassDef) else "function", scope)
                if not isinstance(node, ast.ClassDef):
                    args = node.args
                    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                        if a is not None:
                            self._bind(inner, a.arg, ("other",))
                # What is evaluated where the function is defined (decorators, defaults, bases) is in scope.
                outside = getattr(node, "decorator_list", []) + getattr(node, "bases", []) + \
                    getattr(node, "keywords", [])
                if not isinstance(node, ast.ClassDef):
                    outside += node.args.defaults + [k for k in node.args.kw_defaults if k is not None]
                    node.args._rv_parent, node.args._rv_scope = node, inner
                    for child in ast.iter_child_nodes(node.args):
                        stack.append((child, scope if child in outside else inner, node.args))
                for child in ast.iter_child_nodes(node):
                    if child is not getattr(node, "args", None):
                        stack.append((child, scope if child in outside else inner, node))
                continue
            if isinstance(node, ast.Global):
                scope.declared_global.update(node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    self._bind(scope, alias.asname or top, ("import", alias.name if alias.asname else top))
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                for alias in node.names:
                    if alias.name != "*":
                        full = f"{module}.{alias.name}" if node.module else module + alias.name
                        self._bind(scope, alias.asname or alias.name, ("import", full))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if node.value is not None:
                    for target in targets:
                        self._bind_target(scope, target, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and \
                    isinstance(node.iter, (ast.List, ast.Tuple, ast.Set)):
                for element in node.iter.elts:  # for m in (dist, torch.Tensor): m.x = f
                    self._bind_target(scope, node.target, element)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and isinstance(node.target, ast.Name):
                # for base in type(t).__mro__: base.size = f -- each element of a class walk is a class
                self._bind(scope, node.target.id, ("iter", node.iter))
                node.target._rv_bound = True
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                    len(node.args) == 3 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                self.attributes.setdefault(node.args[1].value, []).append(node.args[2])  # setattr(self, 'd', dist)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and \
                    not getattr(node, "_rv_bound", False):
                self._bind(scope, node.id, ("other",))
            for child in ast.iter_child_nodes(node):
                stack.append((child, scope, node))

    def _bind_target(self, scope: Scope, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self._bind(scope, target.id, ("value", value))
            target._rv_bound = True
            if scope.kind == "class":  # class C: d = torch.distributed -- C.d and self.d hold it
                self.attributes.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Attribute):  # self.d = torch.distributed: any .d may hold it
            self.attributes.setdefault(target.attr, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) and \
                len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind_target(scope, t, v)

    # ---- reading it back ----------------------------------------------------------------------------------
    def lookup(self, name: str, scope: Scope) -> list[tuple] | None:
        """The bindings of ``name`` seen from ``scope`` (Python's rule: a class body's names are not seen from
        the functions in it), or None when nothing in the file binds it."""
        s, first = (self.module if name in scope.declared_global else scope), True
        while s is not None:
            if (first or s.kind != "class") and name in s.bindings:
                return s.bindings[name]
            first, s = False, s.parent
        return None

    def origin(self, node: ast.AST, depth: int = 0) -> str | None:
        """What ``node`` stands for (module docstring), or None for a value of the file's own."""
        key = id(node)
        if key not in self._cache:
            self._cache[key] = None  # a cycle (x = x.y) resolves to nothing
            self._cache[key] = self._origin(node, depth) if depth < 16 else None
        return self._cache[key]

    def _origin(self, node: ast.AST, depth: int) -> str | None:
        if isinstance(node, ast.Name):
            bindings = self.lookup(node.id, node._rv_scope)
            if bindings is None:  # a builtin, or a name from outside (a star import): taken for a module
                return f"<builtin>.{node.id}" if node.id in BUILTINS else node.id
            for how in bindings:  # a function ("def") is not itself a module: calling it is (below)
                found = how[1] if how[0] == "import" else \
                    self.origin(how[1], depth + 1) if how[0] == "value" else \
                    CLASS if how[0] == "iter" and self.origin(how[1], depth + 1) == CLASS else None
                if found:
                    return found
            return None
        if isinstance(node, ast.Attribute):
            if node.attr in CLASS_ATTRIBUTES:  # x.__class__, and a class walk's classes (cls.__mro__[1])
                return CLASS
            base = self.origin(node.value, depth + 1)
            if base and not base.startswith("<builtin>"):
                return f"{base}.{node.attr}"
            # An object's attribute that the file sets to a module (or an attribute of one) somewhere.
            return next(filter(None, (self.origin(v, depth + 1) for v in self.attributes.get(node.attr, ()))), None)
        if isinstance(node, ast.Call):
            func = self.origin(node.func, depth + 1)
            if func == "<builtin>.type" and len(node.args) == 1:
                return CLASS
            if func == "<builtin>.getattr" and len(node.args) >= 2:
                base, name = self.origin(node.args[0], depth + 1), self.fold(node.args[1])
                return f"{base}.{name}" if base and name and not base.startswith("<builtin>") else None
            if func in ("<builtin>.__import__", "importlib.import_module", "sys.modules.get",
                        "sys.modules.setdefault", "sys.modules.pop") and node.args:
                return self.fold(node.args[0])
            return self._returned(node.func, depth + 1)
        if isinstance(node, ast.Subscript):
            base = self.origin(node.value, depth + 1)
            if base == "sys.modules":
                return self.fold(node.slice)
            if base == CLASS:  # type(t).__mro__[1]: a class
                return CLASS
        if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Tuple, ast.List, ast.Dict)):
            # (dist,)[0], {'d': dist}['d']: a literal container indexed by a constant
            values = node.value.values if isinstance(node.value, ast.Dict) else node.value.elts
            return next(filter(None, (self.origin(v, depth + 1) for v in values)), None)
        if isinstance(node, ast.BoolOp):
            return next(filter(None, (self.origin(v, depth + 1) for v in node.values)), None)
        if isinstance(node, ast.IfExp):
            return self.origin(node.body, depth + 1) or self.origin(node.orelse, depth + 1)
        return None

    def _returned(self, func: ast.AST, depth: int) -> str | None:
        """What a call of the file's own function or lambda returns, when that is a module or an attribute of one
        (``def m(): return dist`` makes ``m().all_reduce = f`` a patch)."""
        if isinstance(func, ast.Lambda):
            return self.origin(func.body, depth + 1)
        if not isinstance(func, ast.Name):
            return None
        for how in self.lookup(func.id, func._rv_scope) or ():
            if how[0] == "def":
                for sub in _own_nodes(how[1]):
                    if isinstance(sub, ast.Return) and sub.value is not None:
                        found = self.origin(sub.value, depth + 1)
                        if found:
                            return found
        return None

    def tracked(self, node: ast.AST) -> bool:
        """Whether ``node`` is something outside the file's own values: a module, an attribute of one, a class
        of an object. Setting an attribute on it is a patch."""
        found = self.origin(node)
        return bool(found) and not found.startswith("<builtin>")

    # ---- strings ------------------------------------------------------------------------------------------
    def fold(self, node: ast.AST) -> str | None:
        """The string ``node`` evaluates to when the review can tell, else None."""
        text, _ = self.partial(node)
        return None if UNKNOWN in text else text

    def partial(self, node: ast.AST, depth: int = 0) -> tuple[str, bool]:
        """(the string ``node`` builds, with UNKNOWN for the parts known only at run time; whether an operation
        built it). ``'/' + 'proc'``, ``os.path.join('/', 'proc')``, ``f'/{"proc"}'`` and ``'corp'[::-1]``
        all come out as the string they make."""
        key = id(node)
        if key not in self._strings:
            self._strings[key] = (UNKNOWN, False)  # a cycle (n = n + 'x') folds to nothing
            text, built = self._partial(node, depth) if depth < 100 else (UNKNOWN, False)
            # a string doubled sixty times would take the machine's memory: past a path's length, unknown
            self._strings[key] = (text, built) if len(text) <= MAX_FOLDED else (UNKNOWN, built)
        return self._strings[key]

    def _partial(self, node: ast.AST, depth: int) -> tuple[str, bool]:
        d = depth + 1
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                return node.value, False
            return (str(node.value), False) if isinstance(node.value, (int, float)) else (UNKNOWN, False)
        if isinstance(node, ast.JoinedStr):
            out = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    simple = v.format_spec is None and v.conversion in (-1, 115)
                    out.append(self.partial(v.value, d)[0] if simple else UNKNOWN)
                else:
                    out.append(self.partial(v, d)[0])
            return "".join(out), True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.partial(node.left, d)[0] + self.partial(node.right, d)[0], True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and \
                any(isinstance(n, ast.JoinedStr) or isinstance(n, ast.Constant) and isinstance(n.value, str)
                    for n in (node.left, node.right)):  # Path('/') / 'proc' (a number divided is no path)
            return posixpath.join(self.partial(node.left, d)[0], self.partial(node.right, d)[0]), True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str):
            args = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            values = [self.partial(a, d)[0] for a in args]
            if re.search(r"%[^s%]", node.left.value):  # a width or a precision could be huge
                return UNKNOWN, True
            try:
                return node.left.value % tuple(values), True
            except (TypeError, ValueError):
                return UNKNOWN, True
        if isinstance(node, ast.Name):
            bindings = self.lookup(node.id, node._rv_scope)
            if bindings and len(bindings) == 1 and bindings[0][0] == "value":
                return self.partial(bindings[0][1], d)
            return UNKNOWN, False
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            base, _ = self.partial(node.value, d)
            bounds = [self.fold_int(b) for b in (node.slice.lower, node.slice.upper, node.slice.step)]
            if UNKNOWN in base or "?" in bounds:
                return UNKNOWN, True
            return base[slice(*bounds)], True
        if isinstance(node, ast.Call):
            return self._partial_call(node, d)
        return UNKNOWN, False

    def fold_int(self, node: ast.AST | None):
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and isinstance(node.operand.value, int):
            return -node.operand.value
        return "?"

    def _bounded(self, nodes: list, d: int) -> list[str] | None:
        """The strings of ``nodes``, or None when together they are longer than a path can be."""
        if len(nodes) > MAX_FOLDED:
            return None
        parts = [self.partial(n, d)[0] for n in nodes]
        return parts if sum(map(len, parts)) <= MAX_FOLDED else None

    def _partial_call(self, node: ast.Call, d: int) -> tuple[str, bool]:
        func = node.func
        name = self.origin(func) or ""
        args = node.args
        if name in ("os.path.join", "posixpath.join") and args:
            parts = self._bounded(args, d)
            return (posixpath.join(*parts), True) if parts else (UNKNOWN, True)
        if name == "<builtin>.chr" and len(args) == 1:
            code = self.fold_int(args[0])
            return (chr(code), True) if isinstance(code, int) and 0 <= code < 0x110000 else (UNKNOWN, True)
        if name in ("<builtin>.str", "pathlib.Path", "pathlib.PurePosixPath", "pathlib.PosixPath") and \
                len(args) == 1:
            return self.partial(args[0], d)
        if not isinstance(func, ast.Attribute):
            return UNKNOWN, False
        if func.attr == "join" and len(args) == 1:
            sep, _ = self.partial(func.value, d)
            items = args[0]
            parts = self._bounded(items.elts, d) if isinstance(items, (ast.List, ast.Tuple)) else None
            if parts is not None and len(sep) * len(parts) <= MAX_FOLDED:
                return sep.join(parts), True
            if isinstance(items, ast.Call) and self.origin(items.func) == "<builtin>.map" and len(items.args) == 2 \
                    and self.origin(items.args[0]) == "<builtin>.chr" and isinstance(items.args[1], (ast.List, ast.Tuple)):
                codes = [self.fold_int(e) for e in items.args[1].elts]
                if all(isinstance(c, int) and 0 <= c < 0x110000 for c in codes) and \
                        len(sep) * len(codes) <= MAX_FOLDED:
                    return sep.join(map(chr, codes)), True
            return UNKNOWN, True
        if func.attr == "decode":
            raw = func.value
            if isinstance(raw, ast.Constant) and isinstance(raw.value, bytes):
                return raw.value.decode("latin-1"), True
            if isinstance(raw, ast.Call) and self.origin(raw.func) in ("<builtin>.bytes", "<builtin>.bytearray") \
                    and len(raw.args) == 1 and isinstance(raw.args[0], (ast.List, ast.Tuple)):
                codes = [self.fold_int(e) for e in raw.args[0].elts]
                if all(isinstance(c, int) and 0 <= c < 256 for c in codes):
                    return bytes(codes).decode("latin-1"), True
            return UNKNOWN, True
        if func.attr in STR_METHODS or func.attr == "format":
            base, _ = self.partial(func.value, d)
            values = [self.partial(a, d)[0] for a in args]
            if UNKNOWN in base or any(UNKNOWN in v for v in values) or node.keywords or \
                    re.search(r"\{[^}]*[:!]", base) or func.attr in ("center", "ljust", "rjust", "zfill"):
                return UNKNOWN, True
            try:
                return getattr(base, func.attr)(*values), True
            except (TypeError, ValueError, IndexError, KeyError):
                return UNKNOWN, True
        return UNKNOWN, False
