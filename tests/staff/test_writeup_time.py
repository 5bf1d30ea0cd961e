"""The handout's, the template's and the README's writeup time is the count in staff/writeup_time.md (issues 31, 37
and 41), recomputed from its table: the minutes to produce each artefact (a run, a print) counted as a TA timed
them, and the central count at most 8 hours (issue 41).

Fast: reads four text files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "staff" / "writeup_time.md"
ONCE_MIN = 25  # the Models box and the template's instructions, read once (the notes' Method)


def totals() -> dict[str, float]:
    text = NOTES.read_text(encoding="utf-8")
    rates_line = re.search(r"Rates \(minutes\), low / central / high: (.*?)\n\n", text, re.S).group(1)
    rates = [[float(x) for x in m.split(" / ")] for m in re.findall(r"(\d+(?:\.\d+)? / \d+(?:\.\d+)? / \d+(?:\.\d+)?)", rates_line)]
    # reading factor, artefact, produce factor (on minutes), read number, derived number, part, design part
    assert len(rates) == 7, rates_line
    rows = [list(map(int, r)) for r in re.findall(r"^\| (?:Q\d+|tables)" + r" \| (\d+)" * 7 + r" \|$", text, re.M)]
    assert len(rows) == 16, len(rows)  # 15 questions and the tables
    out = {}
    for i, level in enumerate(("low", "central", "high")):
        out[level] = ONCE_MIN + sum(sum(c * rate[i] for c, rate in zip(row, rates)) for row in rows)
    return out


def test_the_handout_quotes_the_counted_writeup_time():
    t = totals()
    data = (ROOT / "handout" / "data.typ").read_text(encoding="utf-8")
    hours = re.search(r'#let writeup-hours = "(\d+)-(\d+)"', data)
    central = re.search(r'#let writeup-hours-central = "(\d+)"', data)
    assert hours and central, "handout/data.typ lost writeup-hours or writeup-hours-central"
    assert (int(hours.group(1)), int(hours.group(2))) == (round(t["low"] / 60), round(t["high"] / 60)), (hours.groups(), t)
    assert int(central.group(1)) == round(t["central"] / 60), (central.group(1), t)
    notes = NOTES.read_text(encoding="utf-8")
    for level in ("low", "central", "high"):
        assert f"{level} {t[level]:.0f} min ({t[level] / 60:.1f} h)" in notes, f"the notes' {level} total is not the table's"


def test_the_template_quotes_the_same_count():
    """WRITEUP_TEMPLATE.md's "Time spent" section states the handout's figures (issue 37: one count, said once
    per place a student reads it)."""
    t = totals()
    template = (ROOT / "WRITEUP_TEMPLATE.md").read_text(encoding="utf-8")
    section = template.split("## Time spent")[1].split("\n## ")[0]
    want = f"about {round(t['low'] / 60)} to {round(t['high'] / 60)} hours, {round(t['central'] / 60)} centrally"
    assert want in section, f"the template's Time spent section does not say {want!r}: {section!r}"


def test_the_central_count_fits_a_week_beside_the_code():
    """Issue 41: counted with each artefact's production time, the writeup takes at most 8 hours centrally."""
    t = totals()
    assert t["central"] <= 8 * 60, f"the counted writeup takes {t['central']:.0f} min centrally, over 8 hours"
    notes = NOTES.read_text(encoding="utf-8")
    assert "| question | reading | artefacts | produce |" in notes, "the count has no production column"


def test_the_readme_quotes_the_same_count():
    """The README's sentence on the writeup's time states the handout's range (it said "8 to 15 hours" while the
    handout said 9 to 17)."""
    t = totals()
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    want = f"about {round(t['low'] / 60)} to {round(t['high'] / 60)} hours, {round(t['central'] / 60)} centrally"
    assert want in readme, f"README.md does not say {want!r}"
    others = {m for m in re.findall(r"(\d+) to (\d+) hours", readme)} - {(str(round(t["low"] / 60)), str(round(t["high"] / 60)))}
    assert not others, f"README.md states another writeup range too: {others}"
