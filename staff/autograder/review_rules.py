"""The staff review's rules: one ``ast`` visitor that flags, with its line, each use of a name the tables hold
(review_names.py), however the name is spelt, once review_scopes.py has resolved what each name stands for.

The same access is flagged whichever of its spellings is used:
- ``os.fork``, ``posix.fork``, ``from os import fork``, ``f = os.fork``, ``getattr(os, 'fork')``,
  ``getattr(os, 'fo' + 'rk')``: a name is resolved through aliases (module-level or function-local) and the
  getattr family, and a string built by concatenation, an f-string, ``join``, ``os.path.join``, ``chr``,
  ``bytes.decode``, slicing or ``%``/``format`` is folded to the text it makes;
- a patch is an assignment, ``del``, ``setattr``/``delattr`` or ``object.__setattr__`` on anything rooted in an
  import or on the class of an object (``type(x)``, ``x.__class__``), however it was aliased;
- what the review cannot resolve is flagged as itself: ``getattr``/``setattr``/``delattr``/``hasattr`` with a
  name built at run time on any object, or with a name held in a variable on a module or a class; the dunders
  that walk to a namespace, a code object or the class graph (``__dict__``, ``__globals__``, ``__subclasses__``,
  ...); ``open``/``os.open``/``Path`` of a path built at run time.

Narrowed for honest code (issue 36, item 3), and why:
- ``getattr(obj, name)``/``setattr(obj, name, v)`` with ``name`` a plain variable on an object of the file's own
  (a submodule from ``named_modules()``, a parameter): Task 1 and Task 2 set a module's parameters by name this
  way. The name is still flagged where it is built (a built string that makes a flagged name is a flag).
- ``cls.__mro__``/``__bases__``/``__base__`` read (issue 40): Task 7 names the user's class behind a dynamic
  subclass; every class a walk reaches is a class to the review, so ``type(t).__mro__[1].size = f`` and
  ``for b in cls.__mro__: b.size = f`` are patches.
- ``x.__dict__``/``vars(x)`` of a value of the file's own, and a class's read-only ``__dict__`` (issue 40):
  ``owner.__dict__[attr] = view`` is how a plain tensor attribute is set past nn.Module.__setattr__. A module's
  ``__dict__`` stays a patch.
- ``getattr(torch.optim, name)`` and the like (``READ_BY_NAME``): reading a class by its name from a namespace
  that holds nothing else to reach.
- a literal ``getattr`` name that is not a dunder Python defines and not a flagged name (``getattr(dist,
  'all_gather_single', None)``: feature detection across torch versions; ``getattr(module, '__fsdp_state__')``:
  the submission's own attribute).
- ``nn.Module.__setattr__(module, name, t)``/``object.__setattr__(self, '_x', v)``: the unbound form is judged on
  the object it is given (a plain tensor attribute set past nn.Module's own ``__setattr__``).
- uses of a flagged module after its import (``import signal`` is flagged once, not each ``signal.SIGTERM``);
  its flagged functions (``os.fork``) are flagged at each use.
"""

from __future__ import annotations

import ast
import functools
import re

from .review_decode import shown
from .review_names import (ATTRIBUTE_KINDS, BUILTIN_KINDS, CLASS_WALKS, DOTTED_KINDS, DUNDER_ACCESS, ENVIRON_EDITS,
                           GETATTR_FAMILY, INTROSPECTION, MODULE_KINDS, OPEN_CALLS, PREFIX_KINDS,
                           PYTHON_DUNDERS, READ_BY_NAME, BUILT_NAME_KINDS, name_kind, string_kind)
from .review_scopes import CLASS, UNKNOWN, Scopes

PATH_EDITS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__", "__iadd__"}
TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")  # ESC, CR, ... (a tab or a newline is text)
CALLS_JUDGED = {"exec", "eval", "compile", "__import__", "vars", "globals"}  # visit_Call flags these calls
STRING_OPS = (ast.JoinedStr, ast.BinOp, ast.Call, ast.Subscript, ast.FormattedValue)


@functools.lru_cache(maxsize=1)
def _flagged_attribute_names() -> frozenset[str]:
    from .review_instrumentation import instrumentation_names
    frames = {f"{prefix}_{n}" for prefix in ("f", "tb", "gi", "cr", "ag", "co") for n in
              ("back", "locals", "globals", "builtins", "code", "trace", "frame", "next", "lasti", "lineno",
               "consts", "names", "varnames", "filename", "name", "await", "yieldfrom", "running", "suspended")}
    return frozenset(set(ATTRIBUTE_KINDS) | INTROSPECTION | PYTHON_DUNDERS | set(BUILT_NAME_KINDS) | frames |
                     set(instrumentation_names()))


def _short(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # (never for a parsed tree) a person reads the line anyway
        return "..."
    return text if len(text) <= 60 else text[:57] + "..."


class Review(ast.NodeVisitor):
    def __init__(self, tree: ast.AST, lines: list[str]):
        self.lines = lines
        self.flags: list[dict] = []
        self.scopes = Scopes(tree)

    def flag(self, node: ast.AST, kind: str, what: str) -> None:
        line = getattr(node, "lineno", 0)
        code = shown(self.lines[line - 1]) if 0 < line <= len(self.lines) else ""
        self.flags.append({"line": line, "kind": kind, "what": what, "code": code})

    def resolved(self, node: ast.AST) -> str:
        """The dotted name ``node`` stands for, aliases resolved, or ""."""
        found = self.scopes.origin(node)
        return found if found and not found.startswith("<") else ""

    def use_kind(self, node: ast.AST) -> str | None:
        """The kind of a name used (not imported): a module flagged on import is not flagged again at each use,
        a flagged function of it is (``import os`` is nothing, ``os.fork`` is process)."""
        full = self.resolved(node)
        kind = name_kind(full)
        if not kind or full in DOTTED_KINDS or full.startswith(tuple(PREFIX_KINDS)):
            return kind  # a flagged function is flagged at each use
        head = node
        while isinstance(head, ast.Attribute):
            head = head.value
        imported = self.resolved(head)
        parts = full.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if prefix in MODULE_KINDS:
                return None if imported and (imported + ".").startswith(prefix + ".") and \
                    name_kind(imported) == kind and len(imported) >= len(prefix) else kind
        return kind

    # ---- imports ------------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            kind = name_kind(alias.name)
            if kind:
                self.flag(node, kind, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        module_kind = name_kind(module) if node.level == 0 else None
        if module_kind:
            self.flag(node, module_kind, f"from {module} import ...")
        for alias in node.names:
            full = f"{module}.{alias.name}"
            kind = (name_kind(full) if node.level == 0 else None) or ATTRIBUTE_KINDS.get(alias.name)
            if full in ("os.environ", "os.environb"):
                kind = "environment"
            if kind and (kind != module_kind or full in ("os.environ",)):
                self.flag(node, kind, f"from {module} import {alias.name}")

    # ---- attributes ---------------------------------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.attribute(node, node.value, node.attr, node.ctx, node)
        self.generic_visit(node)

    def attribute(self, node: ast.AST, obj: ast.AST, attr: str, ctx: ast.AST, full_node: ast.AST | None,
                  via: str = "") -> bool:
        """Flag ``obj.attr`` read, set or deleted (``ctx``), spelt as an attribute or through the getattr family
        (``via``); True when something was flagged."""
        flagged = False
        if attr in ATTRIBUTE_KINDS:
            full = self.resolved(full_node) if full_node is not None else ""
            self.flag(node, ATTRIBUTE_KINDS[attr], via or full or f".{attr}")
            flagged = True
        elif attr in INTROSPECTION and not self.own_introspection(obj, attr, ctx):
            patch = attr == "__builtins__" or (attr == "__dict__" and self.resolved(obj)) or \
                (attr in CLASS_WALKS and not isinstance(ctx, ast.Load))
            self.flag(node, "patch" if patch else "introspection", via or f"{_short(obj)}.{attr}")
            flagged = True
        else:
            if full_node is not None:
                kind, full = self.use_kind(full_node), self.resolved(full_node)
            else:
                base = self.resolved(obj)
                full = f"{base}.{attr}" if base else ""
                kind = name_kind(full)
            if kind:
                self.flag(node, kind, via or full)
                flagged = True
        if isinstance(ctx, (ast.Store, ast.Del)) and self.scopes.tracked(obj):
            base = self.scopes.origin(obj)
            target = f"{base}.{attr}" if base != CLASS else f"{_short(obj)}.{attr} (a class: every instance)"
            self.flag(node, "patch", via or f"{'assigns' if isinstance(ctx, ast.Store) else 'deletes'} {target}")
            flagged = True
        return flagged

    def own_introspection(self, obj: ast.AST, attr: str, ctx: ast.AST) -> bool:
        """Honest FSDP code's reads of ``__dict__`` and of a class walk (issue 40, item 6), not flagged:
        - ``x.__dict__`` of a value of the file's own (a module of the model, the student's FlatParameter, self):
          ``owner.__dict__[attr] = view`` sets a plain tensor attribute past nn.Module.__setattr__,
          ``module.__dict__.get("_fsdp_unit")`` reads one without nn.Module.__getattr__. (A module's or a
          torch class's namespace is still flagged; a private name of the tests' instrumentation used as a key is
          flagged by review_instrumentation.py.) A class's ``__dict__`` is read-only: reading it is honest too.
        - ``cls.__mro__``, ``__bases__``, ``__base__`` read: the classes reached are classes (review_scopes.py), so
          what is assigned on them is flagged as a patch, where it happens.
        Assigning or deleting any of these is flagged."""
        if not isinstance(ctx, ast.Load):
            return False
        if attr in CLASS_WALKS:
            return True
        if attr == "__dict__":
            found = self.scopes.origin(obj)
            return not found or found == CLASS
        return False

    # ---- names --------------------------------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            found = self.scopes.origin(node) or ""
            parent = node._rv_parent
            called = isinstance(parent, ast.Call) and parent.func is node
            if found.startswith("<builtin>."):
                builtin = found[len("<builtin>."):]
                if builtin in BUILTIN_KINDS and not (called and builtin in CALLS_JUDGED):
                    self.flag(node, BUILTIN_KINDS[builtin], builtin)
                elif builtin in ("getattr", "setattr", "delattr") and not called and \
                        not isinstance(parent, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):  # an alias is followed
                    self.flag(node, "dynamic", f"{builtin} passed on (map, partial, ...): the review cannot see "
                                               f"what it is applied to")
            elif not isinstance(parent, ast.Attribute):  # an attribute chain is judged whole
                kind = self.use_kind(node) if found != node.id else None
                if kind:
                    self.flag(node, kind, f"{node.id} ({found})")

    # ---- calls --------------------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = self.scopes.origin(func) or ""
        builtin = name.split(".", 1)[1] if name.startswith(("<builtin>.", "builtins.")) else ""
        args = node.args
        if builtin in ("exec", "eval", "compile", "__import__"):
            self.flag(node, "dynamic", f"{builtin}(...)")
        elif builtin == "vars":  # vars(x) is x.__dict__; vars() is the caller's namespace
            patch = bool(args) and bool(self.resolved(args[0]))
            if not args or not self.own_introspection(args[0], "__dict__", ast.Load()):
                self.flag(node, "patch" if patch else "introspection", f"vars({_short(args[0]) if args else ''})")
        elif builtin == "globals":
            self.flag(node, "introspection", "globals()")
        elif builtin in GETATTR_FAMILY or name in GETATTR_FAMILY:
            self.getattr_family(node, GETATTR_FAMILY[builtin or name], args[0] if args else None, args[1:2],
                                spelt=f"{builtin or name}(...)")
        elif isinstance(func, ast.Attribute) and func.attr in DUNDER_ACCESS:
            # The unbound form, object.__setattr__(obj, name, v) or nn.Module.__setattr__(module, name, v), takes
            # the object first; the bound form, obj.__setattr__(name, v), one argument less.
            how = DUNDER_ACCESS[func.attr]
            unbound = len(args) == (3 if how == "set" else 2)
            obj = args[0] if unbound else func.value
            self.getattr_family(node, how, obj, args[1:2] if unbound else args[:1], spelt=f"{_short(func)}(...)")
        if builtin in OPEN_CALLS or name in OPEN_CALLS:
            path = args[0] if args else next((k.value for k in node.keywords if k.arg in ("file", "path")), None)
            if isinstance(path, ast.Constant) and isinstance(path.value, int):
                self.flag(node, "audit", f"{_short(func)}({path.value}): a descriptor the rank holds (its report "
                                         f"and audit channels are descriptors)")
            elif path is not None and self.scopes.fold(path) is None:
                self.flag(node, "path", f"{_short(func)}() of a path built at run time: {_short(path)}")
        if name.startswith(("os.environ.", "os.environb.")) and name.rsplit(".", 1)[1] in ENVIRON_EDITS:
            self.flag(node, "environment", name)
        if name.startswith("sys.path.") and name.rsplit(".", 1)[1] in PATH_EDITS:
            self.flag(node, "dynamic", f"{name}(...): what later imports find (a test's, the harness's)")
        if name == "torch.from_file" or (isinstance(func, ast.Attribute) and func.attr == "from_file"):
            shared = any(k.arg == "shared" for k in node.keywords) or len(args) >= 2
            self.flag(node, "mmap", f"{_short(func)}(...{', shared=...' if shared else ''}): a tensor mapped "
                                    f"from a file")
        self.string_expression(node)
        self.generic_visit(node)

    def getattr_family(self, node: ast.Call, how: str, obj: ast.AST | None, name_args: list,
                       spelt: str = "") -> None:
        """getattr/hasattr/setattr/delattr (and their dunder and operator spellings): a name the review can
        fold is judged as the attribute it names; a name it cannot is flagged where it could reach anything."""
        spelt = spelt or f"{how}(...)"
        if how == "attrgetter":  # operator.attrgetter('a.b'): no object; the names are what matter
            for arg in node.args:
                text = self.scopes.fold(arg)
                for part in (text.split(".") if text else []):
                    if part in ATTRIBUTE_KINDS or part in INTROSPECTION:
                        self.flag(node, ATTRIBUTE_KINDS.get(part, "introspection"), f"attrgetter({text!r})")
                if text is None:
                    self.flag(node, "dynamic", "attrgetter() of a name built at run time")
            return
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            self.flag(node, "dynamic", f"{spelt.split('(')[0]}(*...): arguments unpacked at run time")
            return
        if obj is None or not name_args:
            return
        name_node = name_args[0]
        name = self.scopes.fold(name_node)
        ctx = {"set": ast.Store(), "del": ast.Del()}.get(how, ast.Load())
        if name is not None:
            what = f"{spelt.split('(')[0]}({_short(obj)}, {name!r})"
            if not self.attribute(node, obj, name, ctx, None, via=what) and name in PYTHON_DUNDERS:
                self.flag(node, "introspection", what)
            return
        target = self.scopes.origin(obj)
        if how == "get" and target in READ_BY_NAME:
            return  # getattr(torch.optim, name): an optimizer class by its name, nothing else to reach there
        on_reachable = bool(target) and not target.startswith("<builtin>")
        built = not isinstance(name_node, (ast.Name, ast.Attribute, ast.Subscript)) or \
            (isinstance(name_node, ast.Subscript) and isinstance(name_node.slice, ast.Slice))
        if built and not on_reachable and not self.may_spell_a_flagged_name(name_node):
            return  # setattr(module, f"_buf_{i}", t): its known parts rule out every name the review flags
        if built or on_reachable:
            where = ("a class" if target and target.startswith(CLASS) else f"{target}" if on_reachable
                     else _short(obj))
            kind = "patch" if how in ("set", "del") and on_reachable else "dynamic"
            self.flag(node, kind, f"{spelt.split('(')[0]}({_short(obj)}, <{'built' if built else 'variable'} "
                                  f"name>) on {where}: the review cannot tell which attribute")

    def may_spell_a_flagged_name(self, node: ast.AST) -> bool:
        """Whether a name built at run time could come out as a name the review flags on any object (a frame's or
        a code object's attribute, a dunder Python defines, a private name of the tests' instrumentation): its
        known parts, with anything in the unknown ones, match one. ``f"_buf_{i}"`` cannot; ``'f_' + x`` can."""
        text, _ = self.scopes.partial(node)
        if not text.replace(UNKNOWN, ""):
            return True
        pattern = re.compile("".join(".*" if c == UNKNOWN else re.escape(c) for c in text), re.DOTALL)
        return any(pattern.fullmatch(name) for name in _flagged_attribute_names())

    # ---- stores through subscripts ------------------------------------------------------------------------
    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self.resolved(node.value) in ("os.environ",
                                                                                          "os.environb"):
            self.flag(node, "environment", f"{self.resolved(node.value)}[...] edited")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self.resolved(node.value) == "sys.path":
            self.flag(node, "dynamic", "sys.path[...] edited: what later imports find")
        self.string_expression(node)
        self.generic_visit(node)

    # ---- strings ------------------------------------------------------------------------------------------
    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            kind = string_kind(text, built=False)
            if kind:
                self.flag(node, kind, repr(node.value[:60]))
            if isinstance(node.value, str) and TERMINAL_CONTROLS.search(node.value):
                self.flag(node, "display", f"a string with terminal controls ({node.value[:40]!r}): printed, it "
                                           f"can rewrite what a log or a terminal shows")

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self.string_expression(node)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.string_expression(node)
        self.generic_visit(node)

    def string_expression(self, node: ast.AST) -> None:
        """A string built by operations, judged once, whole (not each of its parts again)."""
        parent = node._rv_parent
        if isinstance(parent, STRING_OPS) and self.scopes.partial(parent)[1]:
            return  # part of a larger string: judged there
        text, built = self.scopes.partial(node)
        if built and text.replace(UNKNOWN, ""):
            kind = string_kind(text, built=True)
            if kind:
                self.flag(node, kind, f"a string built as {text.replace(UNKNOWN, '{...}')[:60]!r}")
