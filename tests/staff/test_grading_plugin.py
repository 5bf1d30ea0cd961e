"""The grading plugin (staff/autograder/grading_plugin.py) on a tiny fake test tree: points per test, outcomes,
visibility, a results.json that is complete at every moment (even when pytest is killed mid-test), the time
budget, -x, and the Gradescope schema. Seconds, not minutes: the fake tests import nothing heavy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from staff.autograder import results_schema

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]

POINTS = """
TASK_POINTS = {1: 10, 2: 6}
BONUS_POINTS = 5
TASK_TITLES = {1: "one", 2: "two"}
DEFAULT_WEIGHT = 1.0
"""

PUBLIC = '''
import os, time
import pytest

pytestmark = pytest.mark.task1


@pytest.fixture
def broken_fixture():
    raise RuntimeError("fixture trouble")


def test_pass():
    pass


def test_fail():
    assert 1 == 2, "one is not two"


def test_skip():
    pytest.skip("no GPU here")


def test_setup_error(broken_fixture):
    pass


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_param(backend):
    pass


def test_not_implemented():
    raise NotImplementedError("Task 1: implement thing() in fsdp_assignment/task1_meta_init.py")
'''

HIDDEN = '''
import os, time
import pytest

pytestmark = pytest.mark.task2


@pytest.mark.weight(2)
def test_hidden_pass():
    pass


def test_slow():
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))

'''


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "tests" / "public").mkdir(parents=True)
    (tmp_path / "tests" / "hidden").mkdir()
    (tmp_path / "tests" / "points.py").write_text(POINTS)
    (tmp_path / "tests" / "public" / "test_public.py").write_text(PUBLIC)
    (tmp_path / "tests" / "hidden" / "test_hidden.py").write_text(HIDDEN)
    (tmp_path / "tests" / "hidden" / "test_ungraded.py").write_text("def test_no_task_marker():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.pytest.ini_options]
        markers = ["task1: one", "task2: two", "no_task: x"]
    """))
    return tmp_path


def _cmd(tree: Path, results: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "staff.autograder.grading_plugin", "-p", "no:cacheprovider",
            "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree), "-q", "--grade-results", str(results),
            "tests/public", "tests/hidden", *extra]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FSDP_"))}
    env.update(PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **extra)
    return env


def _run(tree: Path, *extra: str, **env) -> dict:
    results = tree / "results.json"
    proc = subprocess.run(_cmd(tree, results, *extra), cwd=tree, env=_env(**env), capture_output=True, text=True,
                          timeout=120)
    assert results.exists(), proc.stdout + proc.stderr
    data = json.loads(results.read_text())
    assert results_schema.validate(data) == [], results_schema.validate(data)
    data["_stdout"] = proc.stdout
    return data


def _by_name(data: dict) -> dict:
    return {t["name"].split("::", 1)[1]: t for t in data["tests"]}


def test_points_outcomes_and_visibility(tree):
    data = _run(tree)
    tests = _by_name(data)
    # task 1: 6 graded tests (the nccl variant is not graded), weight 1 each: 10/6 points; task 2: weights 2 + 1.
    assert set(tests) == {"test_pass", "test_fail", "test_skip", "test_setup_error", "test_param[gloo]",
                          "test_not_implemented", "test_hidden_pass", "test_slow"}
    for name in ("test_pass", "test_fail", "test_skip", "test_setup_error", "test_param[gloo]", "test_not_implemented"):
        assert tests[name]["max_score"] == pytest.approx(10 / 6, abs=1e-4)
        assert tests[name]["visibility"] == "visible"
    assert tests["test_hidden_pass"]["max_score"] == pytest.approx(4.0)
    assert tests["test_slow"]["max_score"] == pytest.approx(2.0)
    assert tests["test_hidden_pass"]["visibility"] == "after_published"
    assert [tests[n]["status"] for n in ("test_pass", "test_param[gloo]", "test_hidden_pass", "test_slow")] == \
        ["passed"] * 4
    for name in ("test_fail", "test_skip", "test_setup_error", "test_not_implemented"):
        assert tests[name]["status"] == "failed" and tests[name]["score"] == 0
    assert "one is not two" in tests["test_fail"]["output"]
    assert "skipped (no GPU here)" in tests["test_skip"]["output"]
    assert "failed while setting up" in tests["test_setup_error"]["output"]
    assert "fixture trouble" in tests["test_setup_error"]["output"]
    assert "Task 1: implement thing()" in tests["test_not_implemented"]["output"]
    assert tests["test_pass"]["output"].startswith("Task 1 (one), public test: 1.67 / 1.67 points")
    assert data["score"] == pytest.approx(2 * 10 / 6 + 6, abs=0.01)
    assert "total" in data["output"] and "2. two" in data["output"]
    assert "1 hidden tests" not in data["output"] and "2 hidden tests (6.00 points) are graded too" in data["output"]
    assert "hidden" not in data["output"].splitlines()[0]  # the hidden results stay out of the visible summary
    assert "score by task" in data["_stdout"]  # the table on the terminal too
    assert data["stdout_visibility"] == "hidden"


def test_points_do_not_change_with_k(tree):
    tests = _by_name(_run(tree, "-k", "hidden_pass or test_pass"))
    assert set(tests) == {"test_pass", "test_hidden_pass"}
    assert tests["test_pass"]["max_score"] == pytest.approx(10 / 6, abs=1e-4)
    assert tests["test_hidden_pass"]["max_score"] == pytest.approx(4.0)


def test_exitfirst_marks_the_rest_not_run(tree):
    data = _run(tree, "-x", "--grade-first", "test_fail")
    tests = _by_name(data)
    assert tests["test_fail"]["status"] == "failed"
    rest = [t for n, t in tests.items() if n != "test_fail"]
    assert rest and all(t["status"] == "failed" and "not run: the run stopped early" in t["output"] for t in rest)


def test_budget_marks_the_rest_not_run(tree):
    data = _run(tree, "--grade-budget", "0")
    assert all(t["status"] == "failed" and "grading time budget" in t["output"] for t in data["tests"])
    assert len(data["tests"]) == 8


def test_killed_run_leaves_complete_results(tree):
    results = tree / "results.json"
    proc = subprocess.Popen(_cmd(tree, results, "--grade-first", "test_pass", "--grade-first", "test_slow"),
                            cwd=tree, env=_env(FAKE_SLEEP="60"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until test_slow is running
            try:
                tests = _by_name(json.loads(results.read_text()))
                if tests["test_slow"]["output"].split("\n\n")[1].startswith("did not finish"):
                    break
            except (OSError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.1)
        else:
            pytest.fail("test_slow never started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    data = json.loads(results.read_text())
    assert results_schema.validate(data) == []
    tests = _by_name(data)
    assert len(tests) == 8
    assert tests["test_pass"]["status"] == "passed"
    assert "did not finish" in tests["test_slow"]["output"] and tests["test_slow"]["score"] == 0
    assert all("not run" in t["output"] for n, t in tests.items() if n not in ("test_pass", "test_slow"))
    assert "has not finished" in data["output"]


def test_schema_checker_catches_mistakes():
    good = {"score": 1.0, "execution_time": 3, "output": "", "tests": [
        {"name": "a", "number": "1.1", "score": 1.0, "max_score": 1.0, "status": "passed", "output": "",
         "visibility": "visible"}]}
    assert results_schema.validate(good) == []
    bad = json.loads(json.dumps(good))
    bad["tests"][0].update(status="error", visibility="secret", score=2.0)
    del bad["tests"][0]["number"]
    bad["surprise"] = 1
    problems = "\n".join(results_schema.validate(bad))
    for word in ("status", "visibility", "outside", "number", "surprise"):
        assert word in problems


ORDERED_PUBLIC = '''
import os
import pytest


def _log(name):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(name + "\\n")


@pytest.mark.task1
def test_public_one():
    _log("public")


@pytest.mark.task2
def test_public_two():
    _log("public")


@pytest.mark.task1
def test_check_breaks_on_the_results():
    _log("public")
    results = [{"events": [1, 2]}, {"events": [1]}]  # rank 1 sent one event too few
    for rank, got in enumerate(results):
        assert got["events"][1] == 2, f"rank {rank}: wrong second event"


@pytest.mark.task1
def test_harness_breaks_around_the_run():
    from tests.harness import run_ranks
    for rank, got in enumerate(run_ranks(3)):
        assert got
'''

# run_ranks raising in its own clean-up after its loop over the ranks (issue 32: a RecursionError from removing a
# leftover tree was reported as "the test's check of rank 2's results").
FAKE_HARNESS = '''
def run_ranks(world_size):
    for rank in range(world_size):
        pass
    raise RecursionError("maximum recursion depth exceeded while removing the run's folder")
'''

ORDERED_HIDDEN = '''
import os
import pytest

from tests.public.test_public import _log


@pytest.mark.task1
def test_hidden_one():
    _log("hidden")


@pytest.mark.task2
def test_hidden_two():
    _log("hidden")
'''


def test_every_public_test_runs_before_any_hidden_one_and_broken_checks_name_the_rank(tree):
    """Hidden tests last (whatever a hidden test's ranks might leave behind, no visible test runs after it); a
    test whose own check breaks on a rank's results (IndexError, not an assertion) says whose and where; and an
    error the harness raises around the run names no rank."""
    (tree / "tests" / "__init__.py").write_text("")
    (tree / "tests" / "public" / "__init__.py").write_text("")
    (tree / "tests" / "public" / "test_public.py").write_text(ORDERED_PUBLIC)
    (tree / "tests" / "hidden" / "test_hidden.py").write_text(ORDERED_HIDDEN)
    (tree / "tests" / "harness.py").write_text(FAKE_HARNESS)
    log = tree / "order.log"
    data = _run(tree, ORDER_LOG=str(log))
    order = log.read_text().split()
    assert order == ["public"] * 3 + ["hidden"] * 2, order
    out = _by_name(data)["test_check_breaks_on_the_results"]["output"]
    assert "The test's check of rank 1's results raised IndexError: list index out of range" in out, out
    assert 'at: assert got["events"][1] == 2' in out, out
    out = _by_name(data)["test_harness_breaks_around_the_run"]["output"]
    assert "The test harness itself raised RecursionError" in out and "not a check of this test's rank output" \
        in out, out
    assert "rank 2" not in out and "check of rank" not in out, out


# A kernel witness's failure is that test's own (issue 35): it fails the witnessed test and no other, whatever
# other tests decide the same property; a failure of another kind in a witnessed run refutes nothing either.
WATCHED = '''
import pytest

pytestmark = pytest.mark.task1


class RankFailure(AssertionError):  # the harness's, as the plugin sees it
    def __init__(self, message, kind):
        super().__init__(message)
        self.kind = kind


@pytest.mark.evidence("memory")
def test_decided_on_its_own_run():
    pass


@pytest.mark.evidence("bytes", "memory")
def test_witness_fails():
    raise RankFailure("the kernel's witness disagrees with this run: rank 0: the kernel saw its resident memory "
                      "rise 300.0 MiB above its level; rank 0: the kernel counted 9 bytes written", kind="witness")


@pytest.mark.evidence("memory")
def test_raises_where_watched():
    raise RankFailure("rank 0 of 2 raised ImportError: only in a watched run", kind="raised")
'''


def test_a_witness_failure_fails_its_own_test_only(tree):
    (tree / "tests" / "public" / "test_public.py").write_text(WATCHED)
    data = _run(tree)
    tests = _by_name(data)
    assert tests["test_witness_fails"]["status"] == "failed" and tests["test_raises_where_watched"]["status"] == \
        "failed", data
    decided = tests["test_decided_on_its_own_run"]
    assert decided["status"] == "passed" and decided["score"] == decided["max_score"] > 0, decided["output"]
    assert "refute" not in data.get("output", "") + decided["output"], data.get("output")
