"""The hidden tests are split in two (issue 18): what a rank imports (tests/hidden/scenarios/) holds models, inputs
and bodies that report data, and no expected value, threshold or message; the checks stay in
tests/hidden/test_*.py, which no rank imports (a rank imports only its body's module). Student code runs in the
ranks and can read whatever they imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

HIDDEN = Path(__file__).resolve().parents[1] / "hidden"


def _bodies(tree: ast.Module) -> set[str]:
    return {node.args[0].id for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "run_ranks" and node.args and isinstance(node.args[0], ast.Name)}


@pytest.mark.parametrize("path", sorted(HIDDEN.glob("test_*.py")), ids=lambda p: p.name)
def test_hidden_test_modules_define_no_rank_body(path):
    tree = ast.parse(path.read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    local = sorted(_bodies(tree) & defined)
    assert not local, (f"{path.name} defines {local}, which run in ranks: a rank imports the module its body lives "
                       f"in, checks and all; move them to tests/hidden/scenarios/")


@pytest.mark.parametrize("path", sorted(p for p in (HIDDEN / "scenarios").glob("*.py") if p.name != "__init__.py"), ids=lambda p: p.name)
def test_scenarios_carry_no_checks(path):
    tree = ast.parse(path.read_text())
    found = [f"line {n.lineno}: {type(n).__name__}" for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    found += [f"line {n.lineno}: imports {n.module or n.names[0].name}" for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom))
              and any(x in (getattr(n, "module", None) or "") + " ".join(a.name for a in n.names)
                      for x in ("pytest", "tests.hidden.test_", "check_", "assert_close", "expected_"))]
    found += [f"line {n.lineno}: calls {n.func.id}" for n in ast.walk(tree) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id.startswith(("check_", "assert_", "expected_"))]
    assert not found, f"{path.name} (imported by ranks) carries checks: {found}"
