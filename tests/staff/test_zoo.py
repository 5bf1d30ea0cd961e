"""The broken-submission zoo (staff/grader_selftest/zoo.py) in CI: each broken submission is graded on a few tests;
the tests it breaks score 0 and say why, the others pass, the run ends in time, results.json is valid and
genuine, and no process of the run survives. About three minutes in all (slow: CI runs them)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from staff.grader_selftest import zoo

pytestmark = [pytest.mark.staff, pytest.mark.timeout(1200)]


def _rank_user() -> tuple[str, str]:
    """The rank user to grade with here, if rank bodies can run as another user on this machine."""
    from staff.autograder.grade import usable_rank_user
    for user in ("fsdp_student", "nobody"):
        found, why = usable_rank_user(user, Path(zoo.ROOT))
        if found:
            return found, why
    return "none", why


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="fsdp-zoo-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


@pytest.mark.slow  # 10-20 s a case quiet, ~3 minutes in all
@pytest.mark.parametrize("case", zoo.CASES, ids=[c.id for c in zoo.CASES])
def test_zoo_case(case, workdir):
    user, why = _rank_user() if case.needs_rank_user else ("none", "")
    if case.needs_rank_user and user == "none":
        pytest.skip(f"needs rank bodies to run as an unprivileged user: {why}")
    result = zoo.run_case(case, workdir, rank_user=user)
    assert not result.problems, (f"zoo case {case.id} ({case.what}), {result.seconds:.1f} s:\n"
                                 + "\n".join(result.problems) + "\n---- grader output ----\n"
                                 + result.grader_output)


def test_every_case_applies_to_the_current_reference():
    for case in zoo.CASES:
        zoo.case_files(case)  # raises when an edit no longer matches the reference
