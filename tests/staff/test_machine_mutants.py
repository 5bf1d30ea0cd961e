"""Machine-generated mutants (staff/grader_selftest/machine_mutants.py): the committed report is about the current
reference, and a random sample of the mutants it reports killed is still killed (CI: so the rate cannot drift)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "staff" / "grader_selftest" / "machine_mutants.json"
pytest.importorskip("cosmic_ray", reason="cosmic-ray is a staff extra: pip install -e '.[staff]'")
from staff.grader_selftest import machine_mutants


def _report() -> list[dict]:
    return [o for run in json.loads(REPORT.read_text())["runs"] for o in run["outcomes"]]


def test_report_matches_the_current_reference():
    for o in _report():
        # Lines move when a docstring grows; the mutation itself (its line's text before and after) must not.
        change = machine_mutants.mutation_of(o["id"])
        assert change is not None and o["code_line"] in change[0] and \
            (o["mutated_line"] in change[1] or not o["mutated_line"] or not change[1]), (
            f"{o['id']} in machine_mutants.json no longer matches the reference; re-run machine_mutants.py")
        assert o["status"] in ("killed", "survived", "equivalent", "uncalled"), o
        assert o["status"] != "equivalent" or o.get("reason"), f"{o['id']}: an equivalent mutant needs its reason"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_random_sample_of_killed_mutants_is_still_killed():
    killed = [o["id"] for o in _report() if o["status"] == "killed"]
    seed = random.randrange(10 ** 6)
    ids = random.Random(seed).sample(killed, min(2, len(killed)))
    files = sorted({i.split(":")[0] for i in ids})
    mutants = [p for p in machine_mutants.enumerate_mutants(files) if p[0].id in ids]
    assert len(mutants) == len(ids), f"sample seed {seed}: {ids} not all found; re-run machine_mutants.py"
    outcomes = machine_mutants.run(mutants, workers=2, log=lambda *a: None)
    survived = [o["id"] for o in outcomes if o["status"] != "killed"]
    assert not survived, f"sample seed {seed}: mutants the report has killed now survive: {survived}"
