"""Nothing a student reads outside ``hints/`` names a mechanism; the hints cover every term (staff only; fast).

``staff/design_terms.py`` lists, per task, the terms that would give the task's design away (a PyTorch facility,
a method's steps, a pitfall's solution) and the hint folder that explains each. This checks:

- no listed term occurs anywhere a student reads outside ``hints/``: every ``handout/*.typ`` file (Typst
  comments aside), the docstrings and ``#`` comments of the task stubs, of ``fsdp_assignment/support/*.py`` and of
  ``adapters.py``, and the assertion messages and failure texts of ``tests/public/*.py`` (the strings of every
  ``assert``'s message, every ``raise``, and every ``pytest.fail``/``skip``/``xfail``, read with ``ast``). A term
  in ``VOCABULARY`` is checked in its own task's places only (Task N's stub, the handout's Task N section,
  ``tests/public/test_taskN_*.py``); ``ALLOWED_IN`` lets one file name a term it must name;
- every listed term is covered: it occurs in the ``2-mechanism.md`` or ``3-recipe.md`` of its hint folder, a
  folder of Task N's hints;
- Task N has at least one hint folder, and every hint folder holds exactly the three level files.

Terms are literal strings, matched case-sensitively as substrings.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
HINTS = ROOT / "hints"
TASKS_TYP = ROOT / "handout" / "tasks.typ"
LEVELS = ("1-question.md", "2-mechanism.md", "3-recipe.md")
TASKS = range(1, 8)


def _design_terms():
    spec = importlib.util.spec_from_file_location("design_terms", ROOT / "staff" / "design_terms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TERMS = _design_terms()
DESIGN_TERMS: dict[int, dict[str, str]] = _TERMS.DESIGN_TERMS
VOCABULARY: dict[str, str] = _TERMS.VOCABULARY
ALLOWED_IN: dict[str, dict[str, str]] = _TERMS.ALLOWED_IN


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


def comments(source: str) -> list[tuple[str, str]]:
    """(where, comment) for every ``#`` comment of ``source``."""
    return [(f"line {tok.start[0]} comment", tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]


def _strings(node: ast.AST) -> str:
    """The text of every string constant under ``node`` (an f-string's literal parts included), joined."""
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def messages(source: str) -> list[tuple[str, str]]:
    """(where, text) for every failure text of ``source``: an ``assert``'s message, what a ``raise`` raises,
    and the arguments of ``pytest.fail``/``skip``/``xfail``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert) and node.msg is not None:
            parts = [node.msg]
        elif isinstance(node, ast.Raise) and node.exc is not None:
            parts = [node.exc]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("fail", "skip", "xfail"):
            parts = list(node.args) + [k.value for k in node.keywords]
        else:
            continue
        text = " ".join(_strings(p) for p in parts)
        if text.strip():
            out.append((f"line {node.lineno} message", text))
    return out


def typst_text(text: str) -> str:
    """A Typst source without its ``//`` comment lines (they never reach the PDF)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def task_sections(text: str) -> dict[int, str]:
    """Task number -> the handout text from its ``#task-header(N, ...)`` to the next task header (or the end)."""
    starts = [(int(m.group(1)), m.start()) for m in re.finditer(r"^#task-header\((\d+)\s*,", text, re.M)]
    ends = [s for _, s in starts[1:]] + [len(text)]
    return {n: text[s:e] for (n, s), e in zip(starts, ends)}


def found(terms, places: list[tuple[str, str]]) -> list[str]:
    return [f"{term!r} in {where}" for term in terms for where, text in places if term in text]


def student_texts() -> list[tuple[int | None, str, str]]:
    """(task or None, where, text) for everything a student reads outside ``hints/`` (module docstring)."""
    out: list[tuple[int | None, str, str]] = []
    for path in sorted((ROOT / "handout").glob("*.typ")):
        rel = path.relative_to(ROOT).as_posix()
        text = typst_text(path.read_text(encoding="utf-8"))
        if path == TASKS_TYP:
            sections = task_sections(text)
            first = min(text.find(s) for s in sections.values()) if sections else len(text)
            out.append((None, f"{rel}, before Task 1", text[:first]))
            out += [(n, f"{rel}, Task {n}", section) for n, section in sections.items()]
        else:
            out.append((None, rel, text))
    pys = [(n, _stub(n)) for n in TASKS]
    pys += [(None, p) for p in sorted((ROOT / "fsdp_assignment" / "support").glob("*.py"))]
    pys.append((None, ROOT / "adapters.py"))
    for task, path in pys:
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        out += [(task, f"{rel}: {where}", text) for where, text in docstrings(source) + comments(source)]
    for path in sorted((ROOT / "tests" / "public").glob("*.py")):
        m = re.match(r"test_task(\d)_", path.name)
        rel = path.relative_to(ROOT).as_posix()
        out += [(int(m.group(1)) if m else None, f"{rel}: {where}", text)
                for where, text in messages(path.read_text(encoding="utf-8"))]
    return out


def design_term_hits(places: list[tuple[int | None, str, str]]) -> list[str]:
    """Every (term, place) where a listed term occurs that the rules above do not allow."""
    hits = []
    for place_task, where, text in places:
        path = where.split(":")[0].split(",")[0]
        for task, terms in DESIGN_TERMS.items():
            for term in terms:
                if term not in text or term in ALLOWED_IN.get(path, {}):
                    continue
                if term in VOCABULARY and place_task != task:
                    continue
                hits.append(f"Task {task}'s {term!r} in {where}")
    return hits


def _hint_folders(task: int) -> list[Path]:
    root = HINTS / f"task{task}"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def test_every_task_has_a_term_list():
    assert set(DESIGN_TERMS) == set(TASKS), f"staff/design_terms.py lists tasks {sorted(DESIGN_TERMS)}, not 1-7"


def test_the_handout_has_one_section_per_task():
    assert sorted(task_sections(TASKS_TYP.read_text(encoding="utf-8"))) == list(TASKS), \
        "handout/tasks.typ: the #task-header(N, ...) lines that delimit the task sections changed; update this test"


def test_nothing_a_student_reads_names_a_design_term():
    hits = design_term_hits(student_texts())
    assert not hits, ("a mechanism outside hints/: " + "; ".join(hits) + ". State the contract (what must hold) "
                      "and leave the how to the hint folder named in staff/design_terms.py; for a stub, edit the "
                      "reference's docstrings and run python staff/make_stubs.py")


def test_the_places_read_include_every_kind():
    """Each kind of place is really read (a glob or a parser that silently finds nothing would pass the above)."""
    wheres = [where for _, where, _ in student_texts()]
    for kind in ("handout/handout.typ", "handout/tasks.typ, Task 7", "fsdp_assignment/task4_backward.py: <module>",
                 "fsdp_assignment/support/state.py: line", "adapters.py: ", "tests/public/test_task3_forward.py: line",
                 "tests/public/common.py: line"):
        assert any(w.startswith(kind) for w in wheres), f"no text read from {kind!r}"


def test_vocabulary_and_allowances_name_listed_terms():
    listed = {t for terms in DESIGN_TERMS.values() for t in terms}
    stray = [t for t in VOCABULARY if t not in listed]
    stray += [t for terms in ALLOWED_IN.values() for t in terms if t not in listed]
    assert not stray, f"staff/design_terms.py: VOCABULARY/ALLOWED_IN name terms DESIGN_TERMS does not list: {stray}"
    missing = [p for p in ALLOWED_IN if not (ROOT / p).is_file()]
    assert not missing, f"staff/design_terms.py: ALLOWED_IN names files that do not exist: {missing}"


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
    source = 'def f():\n    # queue_callback here\n    assert x, f"use {y} .data"\n    pytest.fail("resize_ it")\n'
    assert [w for w, t in comments(source) if "queue_callback" in t] == ["line 2 comment"]
    assert [t for _, t in messages(source)] == ["use   .data", "resize_ it"]
    assert design_term_hits([(None, "x.typ", "a `resize_(0)` here")]) == ["Task 2's 'resize_' in x.typ"]
    assert design_term_hits([(4, "tests/public/test_task4_x.py: line 1 message", "no all-reduce")]) == []
    assert design_term_hits([(5, "s", "all-reduce the sum of squares")]) == [
        "Task 5's 'all-reduce' in s", "Task 5's 'sum of squares' in s"]
    assert typst_text("// queue_callback\nplain") == "plain"
