"""The stubs and the handout's task sections state contracts; the mechanisms live in the hints (staff only; fast).

``staff/design_terms.py`` lists, per task, the terms that would give the task's design away (a PyTorch facility,
a pitfall's solution) and the hint folder that explains each. This checks, for each task N:

- no listed term occurs in a docstring of the stub ``fsdp_assignment/taskN_*.py`` (module, classes, functions,
  methods: what ``make_stubs.py`` copies from the reference), nor in the handout's Task N section
  (``handout/tasks.typ``, from ``#task-header(N, ...)`` to the next ``#task-header``);
- every listed term is covered: it occurs in the ``2-mechanism.md`` or ``3-recipe.md`` of its hint folder, a
  folder of Task N's hints;
- Task N has at least one hint folder, and every hint folder holds exactly the three level files.

Terms are literal strings, matched case-sensitively as substrings.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
HINTS = ROOT / "hints"
TASKS_TYP = ROOT / "handout" / "tasks.typ"
LEVELS = ("1-question.md", "2-mechanism.md", "3-recipe.md")
TASKS = range(1, 8)


def _design_terms() -> dict[int, dict[str, str]]:
    spec = importlib.util.spec_from_file_location("design_terms", ROOT / "staff" / "design_terms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DESIGN_TERMS


DESIGN_TERMS = _design_terms()


def _stub(task: int) -> Path:
    (path,) = (ROOT / "fsdp_assignment").glob(f"task{task}_*.py")
    return path


def docstrings(source: str) -> list[tuple[str, str]]:
    """(where, docstring) for the module and every class, function and method of ``source``."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((getattr(node, "name", "<module>"), doc))
    return out


def task_sections(text: str) -> dict[int, str]:
    """Task number -> the handout text from its ``#task-header(N, ...)`` to the next task header (or the end)."""
    starts = [(int(m.group(1)), m.start()) for m in re.finditer(r"^#task-header\((\d+)\s*,", text, re.M)]
    ends = [s for _, s in starts[1:]] + [len(text)]
    return {n: text[s:e] for (n, s), e in zip(starts, ends)}


def found(terms, places: list[tuple[str, str]]) -> list[str]:
    return [f"{term!r} in {where}" for term in terms for where, text in places if term in text]


def _hint_folders(task: int) -> list[Path]:
    root = HINTS / f"task{task}"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def test_every_task_has_a_term_list():
    assert set(DESIGN_TERMS) == set(TASKS), f"staff/design_terms.py lists tasks {sorted(DESIGN_TERMS)}, not 1-7"


def test_the_handout_has_one_section_per_task():
    assert sorted(task_sections(TASKS_TYP.read_text(encoding="utf-8"))) == list(TASKS), \
        "handout/tasks.typ: the #task-header(N, ...) lines that delimit the task sections changed; update this test"


@pytest.mark.parametrize("task", TASKS)
def test_stub_docstrings_name_no_design_term(task):
    path = _stub(task)
    hits = found(DESIGN_TERMS[task], docstrings(path.read_text(encoding="utf-8")))
    assert not hits, (f"{path.relative_to(ROOT)} gives Task {task}'s design away: {hits}. State the contract in the "
                      f"reference's docstring and leave the mechanism to the hint folder named in staff/design_terms.py "
                      f"(then python staff/make_stubs.py)")


@pytest.mark.parametrize("task", TASKS)
def test_handout_task_section_names_no_design_term(task):
    section = task_sections(TASKS_TYP.read_text(encoding="utf-8"))[task]
    hits = found(DESIGN_TERMS[task], [(f"handout/tasks.typ, Task {task}", section)])
    assert not hits, (f"the handout's Task {task} section gives the design away: {hits}. Pose the problem there; the "
                      f"mechanism belongs in the hint folder named in staff/design_terms.py")


@pytest.mark.parametrize("task", TASKS)
def test_every_term_is_covered_by_a_hint_of_its_task(task):
    missing = []
    for term, folder in DESIGN_TERMS[task].items():
        folder_path = ROOT / folder
        if folder_path.parent != HINTS / f"task{task}":
            missing.append(f"{term!r}: {folder} is not a folder of hints/task{task}/")
            continue
        texts = [(folder_path / level).read_text(encoding="utf-8") for level in LEVELS[1:]
                 if (folder_path / level).is_file()]
        if not any(term in text for text in texts):
            missing.append(f"{term!r}: not in {folder}/{LEVELS[1]} or {LEVELS[2]}")
    assert not missing, f"Task {task}: design terms no level-2 or level-3 hint covers: {missing}"


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_hints_of_three_levels(task):
    folders = _hint_folders(task)
    assert folders, f"hints/task{task}/ has no hint folder (hints/task{task}/<NN-topic>/{{{','.join(LEVELS)}}})"
    for folder in folders:
        files = sorted(p.name for p in folder.iterdir())
        assert files == list(LEVELS), (f"{folder.relative_to(ROOT)} holds {files}; a hint folder holds exactly "
                                       f"{list(LEVELS)}, one file per level")


def test_the_scans_find_a_planted_term():
    """The checks above can fail: a term in a method's docstring, or in a task's section, is found."""
    source = 'class A:\n    def f(self):\n        """Free it with ``resize_(0)``."""\n'
    assert found(["resize_"], docstrings(source)) == ["'resize_' in f"]
    text = '#task-header(1, "a")\nplain\n#task-header(2, "b")\nuse `swap_tensors`\n'
    sections = task_sections(text)
    assert found(["swap_tensors"], [("1", sections[1])]) == []
    assert found(["swap_tensors"], [("2", sections[2])]) == ["'swap_tensors' in 2"]
