"""Code a person should look at: what in a submission reaches into the grader's machinery or around the process
group, found statically (``ast``) in the submitted task files, with file and line (issue 32).

    python -m staff.autograder.review SUBMISSIONS          # one line per flag, for every submission in the folder
    python -m staff.autograder.review SUBMISSIONS --json review.json
    python -m staff.autograder.review fsdp_assignment/task3_forward.py ...   # some files

A SUBMISSIONS folder holds one entry per student: a zip (``make_submission.sh``'s) or a folder; its task files are
found exactly as the grading command finds them (``intake.find_submitted``, ``intake.find_in_zips``).

What is flagged (each a ``kind``): ``frame`` (frame or stack inspection, tracing hooks), ``gc`` (walking the
garbage collector's objects), ``ctypes``, ``mmap`` (shared or file mappings, memfd, shared_memory), ``path``
(``/proc``, ``/dev/shm``, ``/sys`` named in a string), ``patch`` (an assignment, ``setattr`` or ``del`` on an
attribute of an imported module: ``dist.all_reduce = ...``, ``torch.Tensor.x = ...``; ``vars()``/``__dict__`` of
one; ``builtins``), ``sys.modules``, ``signal`` (signals, ``os.kill``, the parent's pid, sessions), ``process``
(``os.fork``, ``subprocess``, ``multiprocessing``, ``exec*``/``spawn*``), ``harness`` (importing ``tests``,
``pytest``, ``staff`` or ``conftest``), ``dynamic`` (``exec``, ``eval``, ``compile``, ``__import__``,
``importlib``: code this review cannot read), ``socket``, ``environment`` (edits of ``os.environ``),
``resource`` (rlimits). A correct implementation written from the release needs none of them (a staff test checks
the reference and the staff alternatives flag nothing); a flag is not a verdict: a person reads the line.

Where it shows, never to the student: the grading command prints it in its log (Gradescope shows the autograder's
output to instructors only: ``stdout_visibility`` is "hidden") and stores it in results.json under
``extra_data.staff_review`` (Gradescope stores ``extra_data`` and displays none of it); this command lists it for a
folder of submissions.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

FRAME_CALLS = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.gettrace",
               "threading.settrace", "threading.setprofile", "inspect.currentframe", "inspect.stack",
               "inspect.trace", "inspect.getouterframes", "inspect.getinnerframes", "inspect.getframeinfo",
               "traceback.walk_stack", "traceback.extract_stack"}
FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals", "f_builtins", "f_trace", "tb_frame", "gi_frame", "cr_frame",
                    "ag_frame"}
GC_CALLS = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "gc.garbage", "gc.callbacks"}
MODULE_KINDS = {"ctypes": "ctypes", "_ctypes": "ctypes", "cffi": "ctypes", "mmap": "mmap", "signal": "signal",
                "subprocess": "process", "multiprocessing": "process", "pty": "process", "socket": "socket",
                "resource": "resource", "importlib": "dynamic", "builtins": "patch", "tests": "harness",
                "pytest": "harness", "_pytest": "harness", "conftest": "harness", "staff": "harness",
                "faulthandler": "signal"}
CALL_KINDS = {"os.fork": "process", "os.forkpty": "process", "os.system": "process", "os.popen": "process",
              "os.posix_spawn": "process", "os.posix_spawnp": "process", "os.kill": "signal", "os.killpg": "signal",
              "os.getppid": "signal", "os.setsid": "signal", "os.setpgid": "signal", "os.abort": "signal",
              "os.memfd_create": "mmap", "os.putenv": "environment", "os.unsetenv": "environment"}
PROCESS_PREFIXES = ("os.exec", "os.spawn")
PATH_STRINGS = ("/proc", "/dev/shm", "/dev/mem", "/sys/")
ENVIRON_EDITS = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return ""


class _Review(ast.NodeVisitor):
    def __init__(self, lines: list[str]):
        self.lines = lines
        self.flags: list[dict] = []
        self.modules: dict[str, str] = {}  # name bound at module level -> the module it names
        self.local_names: list[set[str]] = []  # per enclosing function: names bound there (shadowing modules)

    # -- what names are modules --
    def module_of(self, name: str) -> str | None:
        if any(name in scope for scope in self.local_names):
            return None
        return self.modules.get(name)

    def resolve(self, node: ast.AST) -> str:
        """The dotted name with a module alias replaced by its module (``dist.x`` -> ``torch.distributed.x``)."""
        dotted = _dotted(node)
        if not dotted:
            return ""
        head, _, rest = dotted.partition(".")
        module = self.module_of(head)
        return (module + ("." + rest if rest else "")) if module else dotted

    def flag(self, node: ast.AST, kind: str, what: str) -> None:
        line = getattr(node, "lineno", 0)
        code = self.lines[line - 1].strip()[:160] if 0 < line <= len(self.lines) else ""
        self.flags.append({"line": line, "kind": kind, "what": what, "code": code})

    # -- imports --
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            if top in MODULE_KINDS:
                self.flag(node, MODULE_KINDS[top], f"import {alias.name}")
            if alias.name == "multiprocessing.shared_memory":
                self.flag(node, "mmap", f"import {alias.name}")
            if not self.local_names:
                self.modules[alias.asname or top] = alias.name if alias.asname else top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        top = module.split(".")[0]
        if node.level == 0 and top in MODULE_KINDS:
            self.flag(node, MODULE_KINDS[top], f"from {module} import ...")
        for alias in node.names:
            full = f"{module}.{alias.name}" if module else alias.name
            if full in FRAME_CALLS or full in GC_CALLS:
                self.flag(node, "frame" if full in FRAME_CALLS else "gc", f"from {module} import {alias.name}")
            elif full in CALL_KINDS or full.startswith(PROCESS_PREFIXES):
                self.flag(node, CALL_KINDS.get(full, "process"), f"from {module} import {alias.name}")
            elif alias.name == "shared_memory" or full in ("os.environ", "sys.modules"):
                kind = {"shared_memory": "mmap", "environ": "environment", "modules": "sys.modules"}[alias.name]
                self.flag(node, kind, f"from {module} import {alias.name}")
            # A lower-case name imported from a package is taken for a module (torch.nn, torch.distributed,
            # the package's support modules): an assignment to its attributes is a patch.
            if not self.local_names and alias.name[:1].islower() and (node.level or top in ("torch", "tests")):
                self.modules[alias.asname or alias.name] = ("." * node.level) + full

    # -- scopes: a function's own names shadow the module's --
    def _function(self, node) -> None:
        names = {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
        names |= {a.arg for a in (node.args.vararg, node.args.kwarg) if a is not None}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
        self.local_names.append(names)
        self.generic_visit(node)
        self.local_names.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    # -- uses --
    def visit_Attribute(self, node: ast.Attribute) -> None:
        full = self.resolve(node)
        if node.attr in FRAME_ATTRIBUTES:
            self.flag(node, "frame", f".{node.attr}")
        elif full in FRAME_CALLS:
            self.flag(node, "frame", full)
        elif full in GC_CALLS:
            self.flag(node, "gc", full)
        elif full in CALL_KINDS or full.startswith(PROCESS_PREFIXES):
            self.flag(node, CALL_KINDS.get(full, "process"), full)
        elif full == "sys.modules":
            self.flag(node, "sys.modules", "sys.modules")
        elif node.attr in ("__dict__", "__builtins__") and (self.module_of(_dotted(node.value).split(".")[0])
                                                             or node.attr == "__builtins__"):
            self.flag(node, "patch", f"{_dotted(node.value)}.{node.attr}")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self.module_of(_dotted(node.value).split(".")[0] or "-"):
            self.flag(node, "patch", f"{'assigns' if isinstance(node.ctx, ast.Store) else 'deletes'} {full}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "__builtins__":
            self.flag(node, "patch", "__builtins__")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func, name = node.func, self.resolve(node.func)
        first = _dotted(node.args[0]) if node.args else ""
        first_is_module = bool(first) and bool(self.module_of(first.split(".")[0]))
        if isinstance(func, ast.Name) and not self.module_of(func.id) and \
                not any(func.id in scope for scope in self.local_names):
            if func.id in ("exec", "eval", "compile", "__import__"):
                self.flag(node, "dynamic", f"{func.id}(...)")
            elif func.id in ("setattr", "delattr", "vars") and first_is_module:
                self.flag(node, "patch", f"{func.id}({self.resolve(node.args[0])}, ...)")
        elif name.startswith("os.environ.") and name.rsplit(".", 1)[1] in ENVIRON_EDITS:
            self.flag(node, "environment", name)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self.resolve(node.value) == "os.environ":
            self.flag(node, "environment", "os.environ[...] edited")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and any(p in node.value for p in PATH_STRINGS):
            self.flag(node, "path", repr(node.value[:60]))


def review_source(text: str) -> list[dict]:
    """The flags of one file's source: ``{"line", "kind", "what", "code"}``, in line order. A file that does not
    parse is one flag (``unreadable``): a person reads it (the tests grade it as it is)."""
    try:
        tree = ast.parse(text)
        visitor = _Review(text.splitlines())
        visitor.visit(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return [{"line": getattr(err, "lineno", 0) or 0, "kind": "unreadable",
                 "what": f"not reviewed: {type(err).__name__}: {str(err)[:200]}", "code": ""}]
    seen, out = set(), []
    for f in sorted(visitor.flags, key=lambda f: (f["line"], f["kind"], f["what"])):
        key = (f["line"], f["kind"], f["what"])
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def review_files(files: dict[str, bytes | str]) -> list[dict]:
    """Flags over several files (path -> content), each with its ``file``."""
    out = []
    for path, data in sorted(files.items()):
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        out += [{"file": path, **f} for f in review_source(text)]
    return out


def format_flags(flags: list[dict]) -> str:
    if not flags:
        return "staff review: nothing flagged"
    return "\n".join([f"staff review: {len(flags)} line(s) for a person to read (never shown to the student):"] +
                     [f"  {f['file']}:{f['line']}: {f['kind']}: {f['what']}  |  {f['code']}" for f in flags])


def review_submission(entry: Path, wanted: list[str]) -> list[dict]:
    """The flags of one submission (a folder, or a zip as uploaded), its task files chosen as the grading command
    chooses them (a zip is read in memory through the same bounded reader, never extracted)."""
    import shutil
    import tempfile
    from .intake import MAX_ZIP_BYTES, find_in_zips, find_submitted
    if entry.is_dir():
        found, _ = find_submitted(entry, wanted)
        missing = [w for w in wanted if w not in found]
        if missing:
            found.update(find_in_zips(entry, missing)[0])
        return review_files(found)
    if entry.stat().st_size > MAX_ZIP_BYTES:
        return [{"file": entry.name, "line": 0, "kind": "unreadable", "what": "zip too large to open", "code": ""}]
    with tempfile.TemporaryDirectory() as alone:  # find_in_zips reads every zip of a folder: this one only
        shutil.copyfile(entry, Path(alone) / entry.name)
        return review_files(find_in_zips(Path(alone), wanted)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path,
                        help="a folder of submissions (a zip or a folder each), or task files")
    parser.add_argument("--json", type=Path, default=None, help="also write {submission: [flags]} here")
    args = parser.parse_args(argv)
    from .intake import task_files
    wanted = task_files(Path(__file__).resolve().parents[2])
    report: dict[str, list[dict]] = {}
    for path in args.paths:
        if path.is_file() and path.suffix == ".py":
            report[str(path)] = review_files({str(path): path.read_bytes()})
        elif path.is_dir():
            for entry in sorted(path.iterdir()):
                if entry.is_dir() or entry.suffix == ".zip":
                    report[entry.name] = review_submission(entry, wanted)
        else:
            parser.error(f"{path}: not a folder of submissions or a .py file")
    for name, flags in report.items():
        print(f"{name}: " + ("nothing flagged" if not flags else f"{len(flags)} flag(s)"))
        for f in flags:
            print(f"  {f['file']}:{f['line']}: {f['kind']}: {f['what']}  |  {f['code']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
