"""Generate the seven student stubs from the staff reference: one source of truth for signatures and docstrings.

    python staff/make_stubs.py           # rewrite fsdp_assignment/task*.py from fsdp_assignment/reference/
    python staff/make_stubs.py --check   # exit 1 if a stub differs from what the reference generates

For each reference module the stub keeps: the module docstring, the imports (``..support`` becomes
``.support``; private names are dropped), module-level constants, and every public function, class and
method with its decorators, signature and docstring. Each body becomes

    raise NotImplementedError("Task N: implement <name> in fsdp_assignment/<file>.py (see its docstring)")

Private helpers (names starting with ``_``, except ``__init__``) are left out: they are the reference's
own choices, not part of the assignment. So are the public names in ``SUGGESTED`` below: the reference's own
decomposition (its hook methods and helpers), which no test, adapter or benchmark calls; the student designs
that part, and the hints show the reference's way. An import of an omitted name is dropped from later stubs, and
an ``import x`` whose name the stub never uses (``weakref`` in Task 7) is dropped too: an import says how.
tests/staff/test_stubs.py runs ``--check`` in CI.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_assignment"
HEADER = ("# This file is generated from the staff reference by staff/make_stubs.py: the signatures and\n"
          "# docstrings are the specification. Replace each `raise NotImplementedError` with your code; you may\n"
          "# add private helpers (names starting with `_`).\n")


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _signature_and_docstring(lines: list[str], node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    """Source lines from the first decorator through the docstring (or the signature when there is none)."""
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    body0 = node.body[0]
    has_doc = isinstance(body0, ast.Expr) and isinstance(getattr(body0, "value", None), ast.Constant) \
        and isinstance(body0.value.value, str)
    end = body0.end_lineno if has_doc else body0.lineno - 1
    return lines[start:end]


# Public names of the reference that the stubs leave out (qualified: "Class.method"): the tests call only
# ``register`` on the hook classes, the adapters and ``fully_shard``; how the life cycle is split into methods
# and helpers is the student's design (tests/staff/test_stubs.py checks that no test, adapter or benchmark
# names one of these).
SUGGESTED = {
    "task2_flat_param.py": {"FlatParameter.copy_into_shard"},
    "task3_forward.py": {"wait_for_unshard", "reshard_unit", "cast_forward_inputs",
                         "ForwardHooks.pre_forward", "ForwardHooks.post_forward"},
    "task4_backward.py": {"BackwardHooks.pre_forward", "BackwardHooks.post_forward",
                          "BackwardHooks.pre_backward", "BackwardHooks.post_backward", "BackwardHooks.reduce_grad",
                          "BackwardHooks.reduce_scatter", "BackwardHooks.finalize_backward",
                          "BackwardHooks.wait_for_reductions"},
    "task6_prefetch.py": {"record_forward_order", "prefetch_forward", "prefetch_backward",
                          "PrefetchHooks.pre_forward", "PrefetchHooks.pre_backward", "PrefetchHooks.reduce_scatter",
                          "PrefetchHooks.wait_for_reductions"},
    "task7_fully_shard.py": {"lazy_init"},
}
OMITTED = {name for names in SUGGESTED.values() for name in names if "." not in name}


# Lines a stub runs before its NotImplementedError, by (file, qualified name): a bonus the student has not done
# fails with the bonus's name (the required tests never pass these keywords). Delete them when you do the bonus.
STUB_PROLOGUES = {
    ("task7_fully_shard.py", "fully_shard()"): [
        "# Bonus guards: delete them when you implement the bonus (handout, Bonus).",
        "if mesh is not None and (mesh.ndim != 1 or mesh.size() != dist.get_world_size()):",
        "    raise NotImplementedError(\"Bonus (HSDP): fully_shard(mesh=<2-D DeviceMesh>) is not implemented\")",
        "if isinstance(offload_policy, CPUOffloadPolicy):",
        "    raise NotImplementedError(\"Bonus (CPU offload): fully_shard(offload_policy=CPUOffloadPolicy()) is not \"",
        "                              \"implemented\")",
    ],
}


def _stub_function(lines, node, task: int, qualname: str, filename: str, indent: str) -> list[str]:
    out = _signature_and_docstring(lines, node)
    out += [f"{indent}    {line}" for line in STUB_PROLOGUES.get((filename, qualname), [])]
    out.append(f'{indent}    raise NotImplementedError("Task {task}: implement {qualname} in '
               f'fsdp_assignment/{filename} (see its docstring)")')
    return out


def make_stub(reference_file: Path, task: int) -> str:
    suggested = SUGGESTED.get(reference_file.name, set())
    source = reference_file.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            out += lines[node.lineno - 1:node.end_lineno] + [HEADER.rstrip("\n")]
        elif isinstance(node, ast.ImportFrom):
            names = [a for a in node.names if (_is_public(a.name) and a.name not in OMITTED) or a.name == "annotations"]
            if not names:
                continue
            level = node.level - 1 if node.module and node.module.startswith("support") else node.level
            module = "." * level + (node.module or "")
            alias = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in names)
            out.append(f"from {module} import {alias}")
        elif isinstance(node, ast.Import):
            out += lines[node.lineno - 1:node.end_lineno]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and _is_public(t.id) for t in targets):
                out += lines[node.lineno - 1:node.end_lineno]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_public(node.name) \
                and node.name not in suggested:
            out += [""] * 2 + _stub_function(lines, node, task, f"{node.name}()", reference_file.name, "")
        elif isinstance(node, ast.ClassDef) and _is_public(node.name):
            out += [""] * 2 + _signature_and_docstring(lines, node)
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and _is_public(m.name)
                       and f"{node.name}.{m.name}" not in suggested]
            for m in methods:
                out += [""] + _stub_function(lines, m, task, f"{node.name}.{m.name}()", reference_file.name, "    ")
        # Private helpers and anything else are the reference's business.
        if isinstance(node, (ast.Import, ast.ImportFrom)) and out and out[-1] == "":
            out.pop()
    out = _drop_unused_imports(out)
    text = "\n".join(out) + "\n"
    # Blank line after the import block, before constants or the first definition.
    return text.replace("\nfrom __future__ import annotations\n", "\n\nfrom __future__ import annotations\n\n", 1)


def _drop_unused_imports(out: list[str]) -> list[str]:
    """Drop each ``import a.b [as c]`` line (torch's aside: the student needs those) whose bound name the rest of
    the stub never mentions."""
    keep = []
    for i, line in enumerate(out):
        m = re.fullmatch(r"import ([\w.]+)(?: as (\w+))?", line)
        if m and not m.group(1).startswith("torch"):
            bound = m.group(2) or m.group(1).split(".")[0]
            rest = "\n".join(out[:i] + out[i + 1:])
            if not re.search(rf"\b{re.escape(bound)}\b", rest):
                continue
        keep.append(line)
    return keep


def stub_files() -> dict[Path, str]:
    sys.path.insert(0, str(ROOT))
    from adapters import TASK_MODULES  # the one list of task modules
    return {PACKAGE / f"{name}.py": make_stub(PACKAGE / "reference" / f"{name}.py", task)
            for task, name in TASK_MODULES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stubs that differ from the reference")
    args = parser.parse_args(argv)
    stale = []
    for path, text in stub_files().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stubs out of sync with the reference (run python staff/make_stubs.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
