"""The writeup's answer key: complete, generated numbers, and never in the student release (staff only).

Fast: no benchmark runs (``python staff/answer_key/regenerate.py`` does that, by hand); the release is built into
a temporary directory without its slow end-to-end checks (those are ``tests/staff/test_release.py``'s).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
KEY = ROOT / "staff" / "answer_key" / "ANSWER_KEY.md"
NUMBERS = ROOT / "staff" / "answer_key" / "NUMBERS.md"


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_key_grades_every_deliverable_with_its_points():
    points = _load("_points", "tests/points.py")
    text = KEY.read_text(encoding="utf-8")
    entries = dict(re.findall(r"^\*\*(Q\d+) \((\d+)\)\.\*\*", text, re.MULTILINE))
    assert {q: int(p) for q, p in entries.items()} == points.WRITEUP_QUESTION_POINTS, \
        "ANSWER_KEY.md's '**Qn (points).**' entries differ from tests/points.py"
    blocks = re.split(r"^(?=\*\*Q\d+ \(\d+\)\.\*\*)", text, flags=re.MULTILINE)[1:]
    for block in blocks:
        q = re.match(r"\*\*(Q\d+)", block).group(1)
        block = block.split("\n## ")[0]
        assert "Full" in block and "Partial" in block, f"{q}: no full/partial credit criteria"
    assert re.search(r"\*\*Tables \(2 each\)\.\*\*", text) and set(points.WRITEUP_TABLE_POINTS.values()) == {2}
    assert "## Bonus" in text and "No credit" in text


REGENERATE = "python staff/answer_key/regenerate.py"


def _run_record(text: str) -> dict:
    m = re.search(r"^<!-- run: (\{.*\}) -->$", text, re.MULTILINE)
    assert m, f"NUMBERS.md has no '<!-- run: {{...}} -->' record of its run: regenerate it ({REGENERATE})"
    return json.loads(m.group(1))


def test_the_numbers_are_generated_and_name_their_machine():
    text = NUMBERS.read_text(encoding="utf-8")
    assert text.startswith("<!-- STAFF ANSWER KEY"), "NUMBERS.md must carry the answer-key marker"
    assert REGENERATE in text
    assert re.search(r"^- Machine: .+ cores", text, re.MULTILINE) and "Load average" in text
    assert "implementation `reference`" in text, "the numbers must come from the reference's benchmark run"
    for q in ("Q2", "Q4", "Q8", "Q10 and Q15", "Q14", "Q16", "Q17", "Q18", "Q19", "Q20", "Q22", "Q24"):
        assert f"## {q} " in text, f"NUMBERS.md has no section for {q}"
    # Every [N: ...] the key refers to exists.
    for ref in set(re.findall(r"\[N: (Q[^\]]+)\]", KEY.read_text(encoding="utf-8"))):
        assert f"## {ref} " in text, f"ANSWER_KEY.md refers to [N: {ref}], which NUMBERS.md does not have"


def test_the_numbers_come_from_a_default_size_run_of_the_current_sources():
    """Not --quick, every W of the defaults (1, 2, 4), made by a run (not --from a folder), and fresh: the
    fingerprint of the code that determines the numbers (regenerate.py's FINGERPRINTED: benchmarks, reference,
    support, adapters, regenerate.py itself; docstrings and comments excluded) equals the one recorded."""
    record = _run_record(NUMBERS.read_text(encoding="utf-8"))
    assert not record["quick"], f"NUMBERS.md was made from a --quick run: re-run {REGENERATE} (default sizes)"
    assert not record["from_dir"], f"NUMBERS.md was made with --from a folder nothing vouches for: re-run {REGENERATE}"
    ws = record["world_sizes"]
    assert ws.get("memory") == [1, 2, 4] and ws.get("scaling") == [1, 2, 4] and ws.get("comm") == [2, 4], (
        f"NUMBERS.md lacks a W of the defaults (memory and scaling W = 1, 2, 4; comm W = 2, 4): {ws}; re-run {REGENERATE}")
    regenerate = _load("_regenerate", "staff/answer_key/regenerate.py")
    assert record["fingerprinted"] == list(regenerate.FINGERPRINTED)
    assert record["sources_sha256"] == regenerate.sources_fingerprint(), (
        f"NUMBERS.md is stale: the code of {', '.join(regenerate.FINGERPRINTED)} changed since it was made; re-run "
        f"{REGENERATE} (about 5 minutes on 2 cores) and commit NUMBERS.md")


def test_the_fingerprint_ignores_docstrings_and_comments_but_not_code():
    regenerate = _load("_regenerate", "staff/answer_key/regenerate.py")
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # why\n'
    same = 'def f(x):\n    """Another doc."""\n    # a new comment\n    return x + 1\n'
    other = 'def f(x):\n    """Doc."""\n    return x + 2\n'
    assert regenerate._code_only(code) == regenerate._code_only(same)
    assert regenerate._code_only(code) != regenerate._code_only(other)


def test_every_number_the_key_quotes_is_in_numbers_md_or_the_question():
    """The key types no measurement: every decimal or thousands-grouped number in it (1.5 points aside, written
    as "(1.5)" or "1.5:") is in NUMBERS.md, the template's questions or the handout's sources."""
    key = KEY.read_text(encoding="utf-8").split("## Bonus")[0]
    key = re.sub(r"\(\d+(?:\.\d+)?\)|\b\d+(?:\.\d+)?(?=:| \(0\.5 (?:each|per))", "", key)  # points of parts
    sources = NUMBERS.read_text(encoding="utf-8") + (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8") + \
        "".join(p.read_text(encoding="utf-8") for p in (ROOT / "handout").glob("*.typ"))
    quoted = set(re.findall(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.])", key))
    missing = sorted(n for n in quoted if n not in sources)
    assert not missing, f"ANSWER_KEY.md quotes numbers found neither in NUMBERS.md nor in the questions: {missing}"


def test_the_handouts_bands_are_the_numbers_md_run():
    """The "staff run" column of the handout's bands table (handout/benchmarks.typ, @tab-bands) is NUMBERS.md's
    Bands section, rounded as printed: a rerun of regenerate.py that moves a band's figure fails here until the
    handout is updated (the last round's key came from another run than the one students make)."""
    typ = (ROOT / "handout" / "benchmarks.typ").read_text(encoding="utf-8")
    table = typ[typ.index("table.header([quantity (table)]"):typ.index("<tab-bands>")]
    staff = [re.findall(r"\d+\.\d+|\d+(?=%)", row[1]) for row in re.findall(r"\[([^\]]*)\], \[([^\]]*)\], \[", table)]
    bands = NUMBERS.read_text(encoding="utf-8").split("## Bands")[1].split("\n## ")[0]
    measured = [float(x) for x in re.findall(r"(?<![\w.])\d+\.\d+|\d+(?=%)", bands)]
    wrong = []
    for figures in staff:
        for fig in figures:
            digits = len(fig.split(".")[1]) if "." in fig else 0
            if not any(round(m, digits) == float(fig) for m in measured):
                wrong.append(fig)
    assert sum(map(len, staff)) >= 6, f"the bands table lost its figures: {staff}"
    assert not wrong, (f"handout/benchmarks.typ's bands quote {wrong}, which NUMBERS.md's Bands section does not "
                       "have: copy the new run's figures into @tab-bands")


def test_the_release_has_no_answer_key_and_its_check_catches_one(tmp_path):
    release = _load("_release", "staff/release.py")
    dest = tmp_path / "release"
    release.build_release(dest, allow_stale=True, quiet=True)
    assert not release.answer_key_leaks(dest), release.answer_key_leaks(dest)
    assert not any("answer" in p.name.lower() and "key" in p.name.lower() for p in dest.rglob("*"))
    # Planted anywhere, under any name, the check reports it.
    shutil.copy(KEY, dest / "notes.md")
    (dest / "docs").mkdir(exist_ok=True)  # the release has docs/ (the collectives demo)
    shutil.copy(NUMBERS, dest / "docs" / "answer_key.md")
    problems = release.check_release(dest)
    leaks = [p for p in problems if p.startswith("answer key in the release")]
    assert any("notes.md" in p and "marker" in p for p in leaks), problems
    assert any("docs/answer_key.md" in p for p in leaks), problems
