"""A lie earns nothing, graded (issues 25 and 35): staff/grader_selftest/lies.py's submissions, each an honest bug and
the same bug with the lines that make the ranks' reports deny it.

Every graded test marked ``evidence("memory"/"bytes")`` is judged by the kernel's witness of its own run against its
own bound, and a witness failure fails that test only (no refutation reaches other tests). A lie then scores no
more than its honest twin exactly where each test its honest twin fails resolves the defect from the kernel's
counts (or from what the lie cannot rewrite). Checked here two ways:

- against the last recorded grading of each pair (``lies.json``, ``python -m staff.grader_selftest.lies --evidence
  --write``: the evidence tests only, about 3 minutes a submission at load 7): every lie is recorded, says which
  tests it was graded on, and scores no more than its twin, unless it is in KNOWN_TO_PAY, the gaps not closed
  yet, each with why (the list may only shrink: a listed lie that no longer pays fails here until it is removed);
- by grading the never_free lie for real on Task 3's forward test, whose model is big enough for its bound to
  resolve one forward that frees nothing (about a minute): it fails there on the kernel's count, and only there.
"""

from __future__ import annotations

import json

import pytest

from staff.grader_selftest import lies

pytestmark = pytest.mark.staff

# Lies that still outscore their honest twin in lies.json (graded on the evidence tests, load 10-17), and why. The list
# may only shrink. Issue 35 item 1 is done where a test's model resolves the defect: Task 3's forward test and the
# hidden really-frees tests (wide GPTs built unit by unit) and Task 7's resharding test catch never_free's lie; the
# byte bounds catch an all-reduce in 19 tests at W >= 2 (all_reduce regraded quiet after Task 4's shared-input test was
# widened to 103K elements: 33.59 both, it paid 0.80 before). Not where the model is a few KiB a unit.
KNOWN_TO_PAY = {
    "never_free_small": "29 memory tests whose models are 0.1-0.2 MiB a unit (Tasks 2-7, LoRA, the differential "
                        "test) pass the lie: their witness bounds only gross excess (4.01 vs 37.59). Issue 40's "
                        "held-after-backward bounds failed it in six more Task 4 tests, but also failed the staff's "
                        "solution by 0.1-1.2 MiB graded as the rank user on the setup.sh image: they are off",
    "never_free_no_task7": "as never_free_small, with Task 7's tests lost by both (3.21 vs 32.79)",
    "rs_waited_at_once": "overlap is seen only by the in-rank log, which the lie rewrites, and no kernel witness can "
                         "judge it (48.58 vs 52.78): the staff review flags the lie's lines for a person (kind "
                         "harness), which costs it no points",
}
# Lies without a record graded since issue 35 retired the refutation (an old record no longer says anything), and
# why: each would take two gradings of 7-8 minutes at load 10-14 (the list may only shrink).
NOT_REGRADED = {
    # It lies wherever never_free_small lies and is honest nowhere: its lie passes at least what never_free_small's
    # does; its honest twin is never_free_small's (4.01 on the evidence tests).
    "never_free",
}


def _record() -> dict:
    return json.loads(lies.RECORD.read_text())


def test_every_lie_is_recorded_and_none_pays_unless_known():
    record = _record()
    ids = {lie.id for lie in lies.LIES}
    missing = ids - set(record) - NOT_REGRADED
    assert not missing, f"lies.json lacks {sorted(missing)}: run python -m staff.grader_selftest.lies --evidence " \
                        f"--only {' '.join(sorted(missing))} --write"
    assert set(record) <= ids - NOT_REGRADED, f"lies.json records lies that are gone (or stale): " \
                                              f"{sorted(set(record) - (ids - NOT_REGRADED))}"
    assert set(KNOWN_TO_PAY) <= ids, f"KNOWN_TO_PAY names lies that are gone: {sorted(set(KNOWN_TO_PAY) - ids)}"
    for lie_id, entry in record.items():
        assert entry.get("subset") in ("all", "evidence"), f"{lie_id}: lies.json must say what was graded: {entry}"
        pays = entry["lying_score"] > entry["honest_score"] + 1e-6
        if lie_id in KNOWN_TO_PAY:
            assert pays, (f"{lie_id} no longer outscores its honest twin ({entry['lying_score']} <= "
                          f"{entry['honest_score']}): remove it from KNOWN_TO_PAY")
        else:
            assert not pays, f"{lie_id}: the lie pays ({entry['lying_score']} > {entry['honest_score']}): {entry}"


def test_deleting_a_task_gains_nothing():
    """Issue 35: with never_free's bug, leaving Task 7 as its stub scored 51.18 against 42.19 with Task 7 done, because
    refutation reached the other tasks' tests only through Task 7. Each test stands on its own now."""
    record = _record()
    stub, done = record.get("never_free_no_task7"), record.get("never_free_small")
    if stub is None or done is None or stub["subset"] != done["subset"]:
        pytest.skip("lies.json lacks never_free_no_task7 or never_free_small graded on the same tests")
    assert stub["honest_score"] <= done["honest_score"] + 1e-6, (stub["honest_score"], done["honest_score"])


def test_a_kernel_witness_failure_is_recorded_for_the_memory_lies():
    """Where a test's model resolves the defect, the kernel fails the lie there (Task 3's forward test and the hidden
    really-frees tests, when graded)."""
    for lie_id in ("never_free_small", "never_free"):
        entry = _record().get(lie_id)
        if entry is None or "lying_witness_failed" not in entry:
            continue
        assert any("test_forward_matches_single_process[True" in t for t in entry["lying_witness_failed"]), \
            f"{lie_id}: the kernel's witness failed none of Task 3's forward tests in the last grading: {entry}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_never_free_lie_fails_where_the_model_resolves_it(tmp_path):
    lie = next(x for x in lies.LIES if x.id == "never_free")
    data = lies.grade(lie, True, tmp_path, ["-k", "test_forward_matches_single_process"])
    tests = {t["name"].split("::", 1)[1]: t for t in data["tests"]}
    assert len(tests) == 6, f"graded {sorted(tests)}\n{data['_stdout'][-3000:]}"
    for name, t in tests.items():
        if "[True" in name:  # resharding after forward: the lie keeps every block, the kernel sees it
            assert t["status"] == "failed" and "the kernel's witness disagrees" in t["output"], t["output"]
        else:  # nothing is freed after forward without resharding: nothing to lie about, it passes
            assert t["status"] == "passed", t["output"]
    assert not data["_survivors"], data["_survivors"]
