"""Grade the staff alternative implementations (staff/alternatives/README.md) as submissions.

    python -m staff.alternatives.grading            # the three together (CI's check): full marks, bonus included
    python -m staff.alternatives.grading --alone    # each alternative alone, the reference's other six files

A submission is the reference's seven task files in the students' layout with the chosen alternatives swapped in,
staged and graded by the real grading command on every graded test, required and bonus, exactly as a mutant is
(``staff.grader_selftest.mutant_grading.grade_mutant``: one grading path for every staged submission). Full marks
means every graded test passed: the alternatives are correct, and the tests grade behaviour, not the reference's
mechanism. A whole grading run is about 140 s on the 2-core machine, quiet.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from staff.grader_selftest.mutant_grading import TASK_FILES, Verdict, grade_mutant, reference_student_files

HERE = Path(__file__).resolve().parent
# Task number -> the alternative's file, a drop-in replacement for fsdp_assignment/<same name>.
ALTERNATIVES = {n: HERE / "fsdp_assignment" / TASK_FILES[n] for n in (3, 4, 6)}


def submission_files(tasks) -> dict[str, str]:
    """The reference's task files in the students' layout, with the alternatives of ``tasks`` swapped in."""
    files = reference_student_files()
    for n in tasks:
        files[f"fsdp_assignment/{TASK_FILES[n]}"] = ALTERNATIVES[n].read_text()
    return files


def grade(tasks, workdir: Path, name: str | None = None, pytest_args: list[str] = ()) -> tuple[Verdict, dict]:
    """Grade the submission with the alternatives of ``tasks``: the verdict (``killed`` means a test failed:
    the first failure is named) and results.json."""
    name = name or "alternatives-" + "-".join(str(n) for n in sorted(tasks))
    # The whole suite: the timeout is the run's backstop, generous for a loaded machine.
    verdict = grade_mutant(submission_files(tasks), workdir, name, list(pytest_args), timeout=1500, timeout_cap=90)
    results = workdir / f"{name}.json"
    return verdict, (json.loads(results.read_text()) if results.exists() else {})


def shortfall(data: dict) -> list[str]:
    """The graded tests below their maximum, with the first lines of their output."""
    return [f"{t['name']}: {t['score']}/{t['max_score']}\n{t['output'][:800]}" for t in data.get("tests", [])
            if t["score"] < t["max_score"] - 1e-6]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alone", action="store_true", help="grade each alternative alone (three runs)")
    args = parser.parse_args(argv)
    runs = [[n] for n in ALTERNATIVES] if args.alone else [list(ALTERNATIVES)]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="fsdp-alternatives-") as tmp:
        for tasks in runs:
            verdict, data = grade(tasks, Path(tmp))
            bonus = data.get("extra_data", {}).get("bonus", {})
            low = shortfall(data)
            ok = not verdict.killed and data.get("tests") and not low
            failed += not ok
            which = f"Task {tasks[0]}'s alternative" if len(tasks) == 1 else \
                f"the alternatives of Tasks {', '.join(map(str, tasks))}"
            print(f"{which}: {'FULL MARKS' if ok else 'NOT FULL MARKS'} "
                  f"score {data.get('score')}, bonus {bonus.get('score')}/{bonus.get('max_score')}, "
                  f"{verdict.tests} tests, {verdict.seconds:.0f} s"
                  + ("" if ok else f"; first failure: {verdict.killer}\n{verdict.detail}\n" + "\n".join(low[:5])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
