"""A lie earns nothing, graded (issue 25): staff/grader_selftest/lies.py's submissions, each an honest bug and the same
bug with the lines that make the ranks' reports deny it.

The grader's rule (grading_plugin.Grader.refute): when the kernel's witness breaks a test's bound, every graded
test marked ``evidence("memory")`` or ``evidence("bytes")`` for that property fails, since its verdict rests on the
ranks' own reports. A lie then scores no more than its honest twin exactly when every test the honest twin fails
is one that rule reaches. Checked here two ways:

- statically, against the last full grading of each pair (``lies.json``, ``python -m staff.grader_selftest.lies
  --write``, about 8 minutes): each test the honest twin failed carries the marker, and the lie scored no more;
- by grading each lying submission for real on the witnessed test and two marked tests it passes when nobody
  asks the kernel (about a minute in all): the witnessed test fails on the kernel's count and the marked tests
  fail with the refutation, which names it.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from staff.grader_selftest import lies

pytestmark = pytest.mark.staff

WITNESSED = "test_task7_fully_shard.py::test_units_are_resharded_after_forward_and_backward"
PROPERTY = {"never_free": "memory", "never_free_unwatched": "memory", "all_reduce": "bytes"}
# Per lie: marked tests the lying submission passes when the kernel is not asked (its reports are clean there).
REFUTED_SAMPLE = {
    "never_free": ["test_forward_matches_single_process", "test_nested_frozen_and_unused_parameters"],
    "all_reduce": ["test_tied_weights_are_updated_once", "test_gradients_without_reshard_after_forward"],
}


def _evidence_by_test() -> dict[str, set[str]]:
    """``file.py::function`` -> the properties its evidence marker names, for every test file (from the source)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("*/test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            props = set()
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.evidence":
                    props |= {a.value for a in dec.args if isinstance(a, ast.Constant)}
            out[f"{path.name}::{node.name}"] = props
    return out


def test_every_test_an_honest_twin_fails_is_reached_by_the_kernels_verdict():
    record = json.loads(lies.RECORD.read_text())
    assert set(record) == {lie.id for lie in lies.LIES}, f"lies.json is stale: rerun lies.py --write ({set(record)})"
    evidence = _evidence_by_test()
    for lie_id, entry in record.items():
        prop = PROPERTY[lie_id]
        assert entry["lying_score"] <= entry["honest_score"] + 1e-6, f"{lie_id}: the lie pays: {entry}"
        for side in ("honest", "lying"):
            assert any(prop in line for line in entry[f"{side}_refuted"]), \
                f"{lie_id}, {side}: the kernel's witness refuted nothing in the last full grading: {entry}"
        missing = []
        for name in entry["honest_failed"]:
            test = name.split("[")[0]
            assert test in evidence, f"{lie_id}: {test} (in lies.json) is not a test any more: rerun lies.py --write"
            if test != WITNESSED and prop not in evidence[test]:
                missing.append(test)
        assert not missing, (f"{lie_id}: the honest twin fails these tests, which lack @pytest.mark.evidence("
                             f"{prop!r}), so the lie could pass them: {sorted(set(missing))}")


def test_the_sample_is_marked():
    evidence = _evidence_by_test()
    for lie_id, names in REFUTED_SAMPLE.items():
        for name in names:
            found = [k for k in evidence if k.endswith("::" + name)]
            assert found and all(PROPERTY[lie_id] in evidence[k] for k in found), (lie_id, name, found)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lie_id", sorted(REFUTED_SAMPLE))  # never_free_unwatched: lies.json, and test_grading_plugin
def test_a_lying_submission_loses_the_tests_its_reports_decide(lie_id, tmp_path):
    lie = next(x for x in lies.LIES if x.id == lie_id)
    names = [WITNESSED.split("::")[1]] + REFUTED_SAMPLE[lie_id]
    data = lies.grade(lie, True, tmp_path, ["-k", " or ".join(names)])
    tests = {t["name"].split("::", 1)[1].split("[")[0]: t for t in data["tests"]}
    assert set(tests) == set(names), f"graded {sorted(tests)}, expected {names}\n{data['_stdout'][-3000:]}"
    witnessed = tests[names[0]]
    assert witnessed["status"] == "failed" and "the kernel's witness disagrees" in witnessed["output"], \
        witnessed["output"]
    for name in names[1:]:
        t = tests[name]
        assert t["status"] == "failed" and t["score"] == 0, f"{lie_id}: {name} passed: the lie paid\n{t['output']}"
        body = t["output"].split("\n\n", 1)[1]  # after the points line: what decided (its own checks passed)
        assert body.startswith("failed: the kernel's witness in") and "refuted" in body, t["output"]
    assert "kernel's witness refuted" in data["output"], data["output"]
    assert not data["_survivors"], data["_survivors"]
