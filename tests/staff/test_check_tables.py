"""staff/answer_key/check_tables.py catches a hand edit of any number in any column of any pasted table.

Fast (well under a second of checks): no benchmark runs, the staff run's own tables and JSON
(staff/answer_key/results/) are the submission.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "staff" / "answer_key" / "results"
NAMES = ("memory", "comm", "step", "scaling")


def _check_tables():
    spec = importlib.util.spec_from_file_location("_check_tables_cols", ROOT / "staff" / "answer_key" / "check_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pasted() -> str:
    return "\n\n".join((RESULTS / f"{n}.md").read_text() for n in NAMES)


def _results() -> dict:
    return {n: json.loads((RESULTS / f"{n}.json").read_text()) for n in NAMES}


def _edits(cell: str) -> list[str]:
    """One hand edit of each number the cell prints (its last digit moved by one), or of its words when it has none."""
    found = list(re.finditer(r"\d", cell))
    if not found:
        return [cell + " (edited)" if cell else "edited"]
    out = []
    for m in re.finditer(r"\d(?:[\d,]*\d)?(?:\.\d+)?", cell):
        last = m.end() - 1
        out.append(cell[:last] + str((int(cell[last]) + 1) % 10) + cell[last + 1:])
    return out


def test_an_untouched_paste_and_one_under_a_repeated_header_pass():
    check = _check_tables()
    pasted = _pasted()
    assert check.check(pasted, _results()) == ([], [])
    head = next(x for x in pasted.splitlines() if x.startswith("| scaling | strategy | W |"))
    doubled = pasted.replace(head, head + "\n|" + " --- |" * (head.count("|") - 1) + "\n" + head, 1)
    assert check.check(doubled, _results())[0] == []


def test_one_hand_edit_in_any_column_of_any_table_is_caught_with_its_row_and_column():
    """Every table, every column, every number of a cell (a median and its min-max, n included): the first data row
    of each table, and of the memory table also a row whose cells differ from the first's (FSDP, W = 4)."""
    check = _check_tables()
    pasted, results = _pasted(), _results()
    tables = check.pasted_tables(pasted)
    kinds = {k for header, _ in tables for k, (head, *_r) in check.KINDS.items() if header[:len(head)] == head}
    assert kinds == set(check.KINDS), f"the staff tables do not include every kind: {set(check.KINDS) - kinds}"
    lines = pasted.splitlines()
    tried = set()
    for header, rows in tables:
        kind = next(k for k, (head, *_r) in check.KINDS.items() if header[:len(head)] == head)
        nkey = check.KINDS[kind][1]
        # the first row, and rows whose key edits land on another row: FSDP at W = 4, DDP at W = 1 (its W = 2 row
        # prints the same numbers)
        picks = [rows[0]] + [r for r in rows if kind == "memory" and r[:2] in (["FSDP", "4"], ["DDP (torch)", "1"])]
        for row in picks:
            line = next(x for x in lines if [c.strip() for c in x.strip().strip("|").split("|")] == row)
            for col, cell in enumerate(row):
                for edited in _edits(cell):
                    cells = list(row)
                    cells[col] = edited
                    text = pasted.replace(line, "| " + " | ".join(cells) + " |", 1)
                    problems, _ = check.check(text, results)
                    if col < nkey:  # a key cell edited: no such row, another row's numbers, or a row twice
                        assert any(p.startswith(f"{kind}: row ") for p in problems), (kind, header[col], edited)
                    else:
                        where = f"row {' | '.join(row[:nkey])}, column '{header[col]}'"
                        assert any(p.startswith(f"{kind}: {where}") for p in problems), (kind, header[col], edited, problems)
                    tried.add((kind, header[col]))
    every = {(k, c) for header, _ in tables for k, (head, *_r) in check.KINDS.items() if header[:len(head)] == head
             for c in header}
    assert tried == every, every - tried  # every column of every table, each of its numbers


def test_the_issue_31_misses_are_caught():
    """The edits the loaded-run review found missed: a ratio's max (which flips Q11(a)), optim, the peak's min-max,
    exposed communication, the model error."""
    check = _check_tables()
    pasted, results = _pasted(), _results()

    def caught(row_start: str, old: str, new: str, column: str) -> bool:
        line = next(x for x in pasted.splitlines() if x.startswith(row_start))
        assert old in line, (old, line)
        problems, _ = check.check(pasted.replace(line, line.replace(old, new, 1)), results)
        return any(f"column '{column}'" in p for p in problems)

    ratio = next(x for x in pasted.splitlines() if x.startswith("| FSDP + prefetch / FSDP step time | 2 | gloo"))
    mx = ratio.split("|")[6].strip()
    assert caught(ratio[:40], f"| {mx} |", "| 0.98 |", "max")
    fsdp4 = next(x for x in pasted.splitlines() if x.startswith("| FSDP | 4 |")).split("|")
    assert caught("| FSDP | 4 |", f"| {fsdp4[9].strip()} |", "| 9.47 |", "optim MiB")
    assert caught("| FSDP | 4 |", f"| {fsdp4[5].strip()} |", "| +9.9% |", "model error")
    peak = fsdp4[3].strip()
    assert caught("| FSDP | 4 |", peak, peak.replace("(", "(1", 1), "peak MiB")
    step = next(x for x in pasted.splitlines() if x.startswith("| FSDP | 2 | gloo"))
    pct = re.search(r"(\d+)% of the profiled step", step).group(1)
    assert caught("| FSDP | 2 | gloo", f"{pct}% of", f"{int(pct) - 10}% of", "exposed comm")


def test_word_only_edits_and_a_deleted_column_are_caught():
    """Issue 37: a numeric cell whose words change ("profiled" to "timed", "over ranks" to "over rounds", a dropped
    x or %) passed, and a column deleted from a pasted table was skipped silently."""
    check = _check_tables()
    pasted, results = _pasted(), _results()
    exposed = re.search(r"\| FSDP \| 2 \| [^|]+ \|[^|]+\|[^|]+\| ([^|]*profiled[^|]*) \|", pasted)
    assert exposed, "no FSDP row with an exposed-communication cell that says 'profiled'"
    cell = exposed.group(1)
    edits = [cell.replace("profiled", "timed"), cell.replace("over ranks", "over rounds") if "over ranks" in cell else None]
    vs_one = re.search(r"\| (\d+\.\d+x) \|", pasted).group(1)
    pct = re.search(r"\| ([+-]?\d+\.\d%) \|", pasted).group(1)
    for old, new in [(cell, e) for e in edits if e] + [(vs_one, vs_one[:-1]), (pct, pct[:-1])]:
        problems, _ = check.check(pasted.replace(f"| {old} |", f"| {new} |", 1), results)
        assert problems, f"{old!r} -> {new!r} passed"
    # spacing is layout, not an edit
    assert check.check(pasted.replace(f"| {cell} |", f"| {'  '.join(cell.split(' '))} |", 1), results)[0] == []
    # a deleted column: header, separator and every row lose their 'model error' cell
    lines = pasted.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("| strategy | W | peak MiB |"))
    col = [c.strip() for c in lines[head].strip("|").split("|")].index("model error")
    i = head
    while i < len(lines) and lines[i].startswith("|"):
        cells = lines[i].strip().strip("|").split("|")
        del cells[col]
        lines[i] = "|" + "|".join(cells) + "|"
        i += 1
    problems, _ = check.check("\n".join(lines), results)
    assert any("lacks the column(s) 'model error'" in p for p in problems), problems
