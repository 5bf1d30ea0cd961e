"""Honest code flags nothing at run time (issue 36 item 3): the staff's implementations, graded by the real grading
command on a few tests that run every task file, leave the runtime audit (tests/rank_audit.py) nothing to report:
the audit's log beside results.json (FSDP_AUDIT_LOG, set by grade.py) stays empty. Staged as
tests/staff/test_alternatives.py stages them:

- the reference's task files in the students' layout (what a correct student hands in);
- the three staff alternatives together (staff/alternatives/README.md).

And the same path with one line added that reads a frame reports that line (the audit is on in the grading
command). What review.py makes of the log (results.json's staff review) is tested with review.py.
Slow: three gradings of three tests each.
"""

from __future__ import annotations

import json

import pytest

from staff.alternatives import grading
from staff.grader_selftest.mutant_grading import grade_mutant

pytestmark = [pytest.mark.staff, pytest.mark.slow, pytest.mark.timeout(900)]

# Three tests that together run every task file (staff/autograder/test_times.json lists the functions each calls).
SELECT = ("test_meta_init_then_training_matches_eager or test_prefetch_changes_no_number or "
          "test_resume_from_full_and_sharded_checkpoints_equals_no_interruption")


@pytest.mark.parametrize("tasks", [(), (3, 4, 6)], ids=["reference", "alternatives"])
def test_staff_implementations_flag_nothing_at_run_time(tmp_path, tasks):
    name = "audit-" + ("-".join(map(str, tasks)) or "reference")
    assert _graded(grading.submission_files(tasks), tmp_path, name) == []


def test_a_reach_in_a_task_file_is_reported_with_its_line(tmp_path):
    """The same path with one line that reads a frame: the finding reaches the log with its file and line."""
    files = grading.submission_files(())
    rel = "fsdp_assignment/task3_forward.py"
    files[rel] = files[rel].rstrip("\n") + "\nimport sys as _sys; _sys._getframe(0)\n"
    line = files[rel].count("\n")
    findings = _graded(files, tmp_path, "audit-reach")
    found = {(f["file"], f["line"], f["kind"], f["what"].split("(")[0]) for f in findings}
    assert found == {(rel, line, "frames", "sys._getframe")}, found


def _graded(files: dict, tmp_path, name: str) -> list[dict]:
    """Grade ``files`` on SELECT (every test must pass); the audit's findings."""
    verdict = grade_mutant(files, tmp_path, name, ["-k", SELECT], timeout=900, timeout_cap=120)
    assert not verdict.killed, verdict
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert len(data["tests"]) >= 3, [t["name"] for t in data["tests"]]
    log = tmp_path / "audit.jsonl"  # beside results.json, where grade.py points FSDP_AUDIT_LOG
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
