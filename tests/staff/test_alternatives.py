"""The tests grade behaviour, not the reference's design (issue 30): staff alternative implementations of Tasks 3, 4
and 6, each taking a mechanism the reference does not (staff/alternatives/README.md), get full marks.

- static, cheap: each alternative is a drop-in for its task file (defines every name the other task files import
  from it) and really avoids the reference's mechanism (no all-gather into the flat buffer; no autograd.Function;
  no order lists);
- slow: the three together, swapped into the reference's task files, graded by the real grading command on every
  graded test, required and bonus (``staff.alternatives.grading``, the mutants' grading path): full marks. One
  grading run (about 140 s quiet), paid for in CI by a saving of the same size (staff/ci_durations.md). Each
  alternative alone: ``python -m staff.alternatives.grading --alone`` (README, staff commands outside CI).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from staff.alternatives import grading
from staff.grader_selftest.mutant_grading import TASK_FILES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.staff


def _tree(n: int) -> ast.Module:
    return ast.parse(grading.ALTERNATIVES[n].read_text())


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):  # a name it re-exports from a module it imports
            names |= {a.asname or a.name for a in node.names}
    return names


def _attributes_of(tree: ast.Module, owner: str) -> set[str]:
    """Every ``owner.<name>`` used in the module (``dist.all_gather`` -> "all_gather")."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == owner}


def test_each_alternative_defines_what_the_other_task_files_import_from_it():
    for n, path in grading.ALTERNATIVES.items():
        module = Path(TASK_FILES[n]).stem
        wanted = set()
        for other in (ROOT / "fsdp_assignment" / "reference").glob("task*.py"):
            for node in ast.walk(ast.parse(other.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == module:
                    wanted |= {a.name for a in node.names}
        missing = wanted - _defined(_tree(n))
        assert not missing, f"{path.relative_to(ROOT)} lacks {sorted(missing)}, which other task files import"


def test_each_alternative_takes_another_mechanism_than_the_reference():
    # Task 3: an all-gather into a list of shards, never one into a single tensor.
    used = _attributes_of(_tree(3), "dist")
    assert "all_gather" in used and not used & {"all_gather_into_tensor", "all_gather_single", "_all_gather_base"}, used
    # Task 4: no autograd.Function (the reference's identity on the inputs), hooks instead.
    tree = _tree(4)
    functions = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                 and any(ast.unparse(base).endswith("Function") for base in node.bases)]
    assert not functions and "apply" not in _attributes_of(tree, "RegisterPostBackward"), functions
    assert "register_post_accumulate_grad_hook" in ast.unparse(tree) and "register_prehook" in ast.unparse(tree)
    # Task 6: no order lists on SharedState (the reference's forward_order / recording_order).
    text = grading.ALTERNATIVES[6].read_text()
    assert not re.search(r"\.(forward_order|recording_order)\b", text)


def _points():
    spec = importlib.util.spec_from_file_location("_points", ROOT / "tests" / "points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_alternatives_together_get_full_marks(tmp_path):
    """The reference's task files with the Task 3, 4 and 6 alternatives swapped in, graded on every graded test:
    every test passes, the score is the full 100 and the bonus is full."""
    verdict, data = grading.grade(grading.ALTERNATIVES, tmp_path)
    low = grading.shortfall(data)
    assert data.get("tests") and not verdict.killed and not low, (
        f"the alternatives together: first failure {verdict.killer or '(none)'} ({verdict.tests} tests graded, "
        f"{verdict.seconds:.0f} s)\n{verdict.detail}\n" + "\n\n".join(low[:5]))
    assert data["score"] == pytest.approx(_points().total_points(), abs=0.01), data["score"]
    bonus = data.get("extra_data", {}).get("bonus", {})
    assert bonus.get("score") == pytest.approx(_points().BONUS_POINTS, abs=0.01), bonus
    print(f"\nalternatives of Tasks 3, 4, 6 together: {data['score']} + bonus {bonus['score']}, {verdict.tests} tests, "
          f"{verdict.seconds:.0f} s")
