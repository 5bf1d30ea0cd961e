"""A hang cannot drain the grading budget (staff/autograder/grading_plugin.py, "Time limits"; issue 8).

Fast checks, on a tiny fake test tree (no torch in the tests) and on the plugin's pieces:
- every graded test has a measured time in staff/autograder/test_times.json (else: measure_times.py);
- a hang is blamed on the innermost task function the reference knows, from faulthandler's stacks or a
  traceback; later tests that call it run as probes (a shorter limit), so a hang confined to one branch costs only
  the tests that take it; once it hung in 3 tests with none passing in between, the rest that call it are "not
  run: <function> hung in <tests>" at once; tests that do not call it run as usual;
- each test gets a deadline (FSDP_RANK_DEADLINE, which the harness honours) and a task that loses its share of the
  budget cannot spend another's: its later tests are not run, the next task's tests run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from staff.autograder import grading_plugin
from staff.autograder.grading_plugin import TimeLimits, hung_functions

pytestmark = pytest.mark.staff

KNOWN = {"task1_meta_init.py:materialize_meta_module", "task3_forward.py:unshard", "task7_fully_shard.py:fully_shard"}

# What the harness shows for a hang (faulthandler's dump: most recent call first) ...
STACKS = '''timed out after 6 s: ranks 0, 1 of 2 did not finish; a collective that not every rank calls?

---- rank 0 stacks (most recent call first) ----
Current thread 0x00007f0d (most recent call first):
  File "/g/fsdp_assignment/task3_forward.py", line 40 in _my_own_helper
  File "/g/fsdp_assignment/task3_forward.py", line 57 in unshard
  File "/g/fsdp_assignment/task7_fully_shard.py", line 90 in fully_shard
  File "/g/tests/public/test_task7_fully_shard.py", line 12 in _body

---- rank 1 stacks (most recent call first) ----
Current thread 0x00007f0e (most recent call first):
  File "/g/fsdp_assignment/task7_fully_shard.py", line 95 in fully_shard
  File "/g/tests/public/test_task7_fully_shard.py", line 12 in _body
'''
# ... and for a collective that timed out inside a rank (a traceback: most recent call last).
TRACEBACK = '''rank 0 of 2 raised RuntimeError: [gloo/transport/tcp/pair.cc:534] Timed out waiting 6000ms for recv

Traceback (most recent call last):
  File "/g/tests/public/test_task1_meta_init.py", line 30, in _body
    adapters.materialize_meta_module(model, "cpu")
  File "/g/fsdp_assignment/task1_meta_init.py", line 44, in materialize_meta_module
    _replay(unit)
  File "/g/fsdp_assignment/task1_meta_init.py", line 60, in _replay
    dist.all_reduce(x)
RuntimeError: Timed out waiting 6000ms for recv
'''


def test_a_hang_is_blamed_on_the_innermost_known_task_function():
    assert hung_functions(STACKS, KNOWN) == ["task3_forward.py:unshard", "task7_fully_shard.py:fully_shard"]
    assert hung_functions(TRACEBACK, KNOWN) == ["task1_meta_init.py:materialize_meta_module"]
    assert hung_functions("timed out after 6 s\n  File \"/g/tests/x.py\", line 1 in _body\n", KNOWN) == []
    assert grading_plugin._is_hang(type("F", (), {"kind": "timeout", "__str__": lambda s: "x"})())
    # A collective timeout shows one rank's traceback, maybe a victim's: not blamed (it ends by itself in 10 s).
    timed_out = type("F", (), {"kind": "raised", "__str__": lambda s: TRACEBACK})()
    assert not grading_plugin._is_hang(timed_out)
    wrong = type("F", (), {"kind": "raised", "__str__": lambda s: "rank 0 of 2 raised AssertionError: 1 != 2"})()
    assert not grading_plugin._is_hang(wrong)


def test_shares_follow_what_each_task_needs_at_load_10():
    class Config:
        def getoption(self, name):
            return {"--grade-record": None, "--grade-record-calls": False, "--grade-times": "none"}[name]

    limits = TimeLimits(Config(), budget=480)
    limits.enabled = True
    limits.times = {"a": {"seconds": 10.0}, "b": {"seconds": 0.1}, "c": {"seconds": 2.0}}
    # The same margin for every test: 30 x (its time + 1 s of start-up), 30 s for the quickest.
    assert limits.limit("a") == pytest.approx(330.0) and limits.limit("b") == pytest.approx(33.0)
    assert limits.limit("a") / (10.0 + 1) == pytest.approx(limits.limit("b") / (0.1 + 1))
    limits.plan([("a", 1), ("b", 2), ("c", 2)])
    # needs (each test counts at least 2 s): task 1 10 x 10 = 100; task 2 10 x 2 + 10 x 2 = 40
    # -> shares 480 x 100/140 and 480 x 40/140
    assert limits.share == pytest.approx({1: 480 * 100 / 140, 2: 480 * 40 / 140})
    assert limits.why_not_run("a", 1, elapsed=0.0) is None
    limits.started_at = 0.0
    limits.end_test("a", 1, elapsed=1000.0, call_seconds=1000.0, passed=True)  # slow but passing: not charged
    assert limits.lost[1] == 0.0
    limits.started_at = 0.0
    limits.end_test("a", 1, elapsed=limits.share[1] + 1, call_seconds=0.0, passed=False)  # a hang: charged
    assert limits.why_not_run("a", 1, elapsed=400.0) is not None  # task 1 lost its share: no more of its tests
    assert limits.why_not_run("b", 2, elapsed=400.0) is None      # task 2 keeps its own


def test_every_graded_test_has_a_measured_time():
    data = json.loads(grading_plugin.TIMES_FILE.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", " or ".join([*(f"task{n}" for n in range(1, 8)), "bonus"]),
                           "tests/public", "tests/hidden"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    graded = [line for line in proc.stdout.splitlines() if "::" in line and "nccl" not in line]
    assert graded, proc.stdout[-2000:] + proc.stderr[-2000:]
    missing = [n for n in graded if n not in data["tests"] or data["tests"][n].get("seconds") is None]
    assert not missing, (f"{len(missing)} graded tests have no measured time in {grading_plugin.TIMES_FILE.name}: "
                         f"{missing[:5]}; run python -m staff.grader_selftest.measure_times")
    # The traced calls name functions the reference still has (a renamed function would never be skipped).
    import ast
    defined = set()
    for path in (ROOT / "fsdp_assignment" / "reference").glob("task[0-9]_*.py"):
        defined |= {f"{path.name}:{n.name}" for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    calls = {c for entry in data["tests"].values() for c in entry["calls"]}
    stale = sorted(calls - defined)
    assert not stale, f"test_times.json names functions the reference no longer has: {stale[:5]}; regenerate it"
    assert len(calls) > 20, "the traced calls are missing: regenerate test_times.json"


# ---- the plugin on a fake tree ------------------------------------------------------------------------------
POINTS = """
TASK_POINTS = {1: 10, 2: 10}
TASK_TITLES = {1: "one", 2: "two"}
DEFAULT_WEIGHT = 1.0
"""

TESTS = '''
import os, time
import pytest


class FakeRankFailure(AssertionError):
    """What tests.harness raises (the plugin reads only .kind and the message)."""
    def __init__(self, message, kind):
        super().__init__(message)
        self.kind = kind


def _hang_until_the_deadline(functions):
    """FAKE_HANG_IN: "file:function" for each hung rank (comma-separated), as the harness shows their stacks."""
    time.sleep(float(os.environ.get("FAKE_WAIT", "0")))  # as the harness would: wait out a timeout, then fail
    message = "timed out after 3 s: ranks of 2 did not finish"
    for rank, function in enumerate(functions.split(",")):
        file, name = function.split(":")
        message += (f"\\n\\n---- rank {rank} stacks (most recent call first) ----\\n"
                    f"Current thread 0x01 (most recent call first):\\n"
                    f"  File \\"/g/fsdp_assignment/{file}\\", line 9 in helper\\n"
                    f"  File \\"/g/fsdp_assignment/{file}\\", line 20 in {name}\\n"
                    f"  File \\"/g/tests/public/test_x.py\\", line 20 in _body\\n")
    raise FakeRankFailure(message, "timeout")


def _act(name):
    """FAKE_PLAN: the tests (by name) that hang; every other test passes."""
    if name in os.environ.get("FAKE_PLAN", "").split(","):
        _hang_until_the_deadline(os.environ["FAKE_HANG_IN"])


@pytest.mark.task1
def test_1a():
    _act("1a")


@pytest.mark.task1
def test_1b():
    _act("1b")


@pytest.mark.task1
def test_1c():
    _act("1c")


@pytest.mark.task1
def test_1d():
    _act("1d")


@pytest.mark.task1
def test_1e():
    _act("1e")


'''

# In a module of its own: a test that is not run must not leave the previous test's module fixtures up.
TESTS_2 = '''
import os
import pytest


@pytest.mark.task2
def test_2a_passes():
    assert os.environ.get("FSDP_RANK_DEADLINE"), "every graded test runs with a deadline"
'''


def _fake_tree(tmp_path: Path, times: dict) -> Path:
    (tmp_path / "tests" / "public").mkdir(parents=True)
    (tmp_path / "tests" / "points.py").write_text(POINTS)
    (tmp_path / "tests" / "public" / "test_fake.py").write_text(TESTS)
    (tmp_path / "tests" / "public" / "test_fake2.py").write_text(TESTS_2)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["task1: one", "task2: two"]\n')
    (tmp_path / "times.json").write_text(json.dumps({"tests": {
        f"tests/public/test_fake{'2' if name.startswith('test_2') else ''}.py::{name}": entry
        for name, entry in times.items()}}))
    return tmp_path


def _grade(tree: Path, *extra: str, **env) -> dict:
    results = tree / "results.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "staff.autograder.grading_plugin", "-p", "no:cacheprovider",
           "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree), "-q", "--grade-results", str(results),
           "--grade-times", str(tree / "times.json"), "tests/public", *extra]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FSDP_"))}
    clean.update(PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **env)
    proc = subprocess.run(cmd, cwd=tree, env=clean, capture_output=True, text=True, timeout=600)
    data = json.loads(results.read_text())
    return {t["name"].split("::", 1)[1]: t for t in data["tests"]} | {"_stdout": proc.stdout,
                                                                        "_time": data["extra_data"]["time"]}


# A third module: task-2 tests run after test_2a_passes (collection order); each hangs if FAKE_PLAN names it
# ("2y" for test_2y_...), and test_2x_wrong fails at once on a wrong value.
BIG_TEST = '''
import pytest
from test_fake import _act
'''
WRONG_TEST = '''

@pytest.mark.task2
def test_2x_wrong():
    raise AssertionError("rank 0: loss 2.5, expected 2.25")
'''
BIG_TEST_EACH = '''

@pytest.mark.task2
def {name}():
    _act("{short}")
'''


def _add_big_test(tree: Path, seconds: float, *, names: dict[str, float] | None = None) -> None:
    """test_fake3.py with test_2z_big (its reference time ``seconds``) or the tests ``names`` (name: seconds)."""
    names = names or {"test_2z_big": seconds}
    (tree / "tests" / "public" / "test_fake3.py").write_text(BIG_TEST + "".join(
        WRONG_TEST if n == "test_2x_wrong" else BIG_TEST_EACH.format(name=n, short=n[5:7]) for n in names))
    times = json.loads((tree / "times.json").read_text())
    for name, t in names.items():
        times["tests"][f"tests/public/test_fake3.py::{name}"] = {"seconds": t, "calls": [FN]}
    (tree / "times.json").write_text(json.dumps(times))


FN, VICTIM = "task1_meta_init.py:materialize_meta_module", "task3_forward.py:unshard"
BLAMED = ("materialize_meta_module() (Task 1, fsdp_assignment/task1_meta_init.py) and unshard() (Task 3, "
          "fsdp_assignment/task3_forward.py)")


def _calls_tree(tmp_path: Path) -> Path:
    """1a-1d call the culprit and the victim, 1e only the victim (most tests call unshard)."""
    both = {"seconds": 0.1, "calls": [FN, VICTIM]}
    return _fake_tree(tmp_path, {"test_1a": both, "test_1b": both, "test_1c": both, "test_1d": both,
                                 "test_1e": {"seconds": 0.1, "calls": [VICTIM]},
                                 "test_2a_passes": {"seconds": 0.1, "calls": []}})


def test_a_function_that_hangs_in_every_test_is_probed_three_times_then_not_run(tmp_path):
    """Rank 0 hangs in materialize_meta_module (the culprit), rank 1 waits in unshard (a victim): the next tests that
    call both run as probes (shorter limit) until 3 hung with none passing; the 4th is not run at once; a test
    that calls only the victim runs as usual."""
    tests = _grade(_calls_tree(tmp_path), "--grade-budget", "60", FAKE_HANG_IN=f"{FN},{VICTIM}",
                   FAKE_PLAN="1a,1b,1c,1d")
    assert tests["test_1a"]["status"] == "failed"
    assert f"{BLAMED} hung here" in tests["test_1a"]["output"]
    assert "time limit: 33 s" in tests["test_1a"]["output"] and "note: a probe" not in tests["test_1a"]["output"]
    for name in ("test_1b", "test_1c"):  # probes: run with 12 x (0.1 + 1) s, and they hang too
        out = tests[name]["output"]
        assert tests[name]["status"] == "failed" and "time limit: 13 s" in out, out
        assert f"note: a probe: {BLAMED} hung in test_fake.py::test_1a" in out, out
        assert "timed out after 3 s" in out, out  # it ran (the fake hang's message)
    skipped = tests["test_1d"]
    assert skipped["status"] == "failed" and skipped["score"] == 0
    assert skipped["output"].split("\n\n")[1].startswith(
        f"not run: {BLAMED} hung in 3 tests (test_fake.py::test_1a, test_fake.py::test_1b, test_fake.py::test_1c) "
        f"and no test that calls them has passed since"), skipped["output"]
    # 1e calls only the victim: not a probe, its full limit, graded as usual
    assert tests["test_1e"]["status"] == "passed" and "time limit: 33 s" in tests["test_1e"]["output"]
    assert "note: a probe" not in tests["test_1e"]["output"]
    assert tests["test_2a_passes"]["status"] == "passed", tests["test_2a_passes"]["output"]
    assert "in 3 test(s)" in tests["_stdout"] and "0 later caller(s) passed" in tests["_stdout"]


def test_a_hang_confined_to_one_branch_costs_only_the_tests_that_take_it(tmp_path):
    """The culprit hangs only in some tests (one configuration): a probe that passes shows the hang is confined,
    so every later test that calls the function still runs (as a probe) and keeps its points if it passes, even
    after three hangs."""
    tests = _grade(_calls_tree(tmp_path), "--grade-budget", "60", FAKE_HANG_IN=f"{FN},{VICTIM}",
                   FAKE_PLAN="1a,1c,1d")
    assert [tests[f"test_1{c}"]["status"] for c in "abcde"] == ["failed", "passed", "failed", "failed", "passed"]
    for name in ("test_1b", "test_1c", "test_1d"):
        assert "note: a probe" in tests[name]["output"], tests[name]["output"]
    assert "not run" not in tests["test_1d"]["output"] and "timed out after 3 s" in tests["test_1d"]["output"]
    assert tests["test_1b"]["score"] > 0 and tests["test_1e"]["score"] > 0
    assert "in 3 test(s)" in tests["_stdout"] and "1 later caller(s) passed" in tests["_stdout"]


def test_a_task_that_loses_its_share_to_hangs_runs_no_more_tests(tmp_path):
    """A hang in a function the reference never calls (a student's own): nothing is skipped by name, but once the
    task's failing tests have taken its share, its other tests are not run; the next task runs. (Task 2's big
    test, whose need makes task 1's share small, has a limit larger than the whole budget: it is not started.)"""
    # Needs: task 1 five tests at 10 x 2 s (the floor) = 100; task 2 at 10 x 0.1 s + 10 x 1000 s. Budget 100 s ->
    # task 1's share is 100 x 100 / 10120 = 1 s, which the 2 s hang exceeds.
    none = {"seconds": 0.1, "calls": []}
    tree = _fake_tree(tmp_path, {"test_1a": none, "test_1b": none, "test_1c": none, "test_1d": none, "test_1e": none,
                                 "test_2a_passes": none})
    _add_big_test(tree, seconds=1000.0)
    tests = _grade(tree, "--grade-budget", "100", FAKE_HANG_IN="task1_meta_init.py:my_own_helper", FAKE_WAIT="2",
                   FAKE_PLAN="1a,1b,1c")
    assert tests["test_1a"]["status"] == "failed"
    assert "time limit: 33 s" in tests["test_1a"]["output"], tests["test_1a"]["output"]
    for name in ("test_1b", "test_1c", "test_1d", "test_1e"):
        body = tests[name]["output"].split("\n\n")[1]
        assert body.startswith("not run, for time: this test was not started, so it was not graded; nothing in it "
                               "failed. Task 1's tests that failed before it (test_fake.py::test_1a"), body
        assert "and used up Task 1's share of the grading time (1 s of 100 s)" in body, body
        assert "make those tests pass, or fail faster" in body, body
    assert tests["test_2a_passes"]["status"] == "passed", tests["test_2a_passes"]["output"]
    assert "shares of the budget" in tests["_stdout"]
    time = tests["_time"]  # results.json's count, from the same records
    assert [n.split("::")[1] for n in time["not_run"]["share"]] == ["test_1b", "test_1c", "test_1d", "test_1e"]
    assert [n.split("::")[1] for n in time["not_run"]["budget"]] == ["test_2z_big"], time


def _grade_command(tree: Path, capsys, monkeypatch, *, budget: float | None, timeout: float,
                   **env) -> tuple[dict, str]:
    """The grading command itself (grade.grade_tree: pytest with the plugin, its progress, its closing line) on a
    fake tree (its staff/ is this repository's), in this process; results.json's tests by name, and its log."""
    from staff.autograder import grade
    (tree / "staff").symlink_to(ROOT / "staff")
    results = tree / "results.json"
    real_env = grade.grading_env
    monkeypatch.setattr(grade, "grading_env", lambda *a: real_env(*a) | env)  # what the fake tests read
    grade.grade_tree(tree, results, budget=budget, timeout=timeout, rank_user=None, memory_mb=256,
                     timeout_cap=None, extra=["--grade-times", str(tree / "times.json")], notes=[])
    data = json.loads(results.read_text())
    return {t["name"].split("::", 1)[1]: t for t in data["tests"]}, capsys.readouterr().out


def test_a_limit_the_budget_cut_is_no_evidence_and_the_closing_line_counts_what_time_took(tmp_path, monkeypatch,
                                                                                          capsys):
    """Issue 42: a test started with 5.66 s of budget left, its limit cut to that; it timed out and failed as a
    hang ("a collective that not every rank calls?"), the hang blame named a function, and the closing line said
    "0 of 86 tests did not finish or were not run for time" while 23 were not run. With 100 s of budget (about 98
    left when task 2's last tests come):
    - test_2y_cut (limit 30 x (3 + 1) = 120 s, needs 10 x 3 = 30 s at load 10) starts with what is left, and its
      ranks "hang" until that cut deadline: "did not finish, cut for time", no hang's message, no function blamed;
    - test_2x_wrong, cut the same way, fails at once on a wrong value: a failure on its merits, shown as one;
    - test_2z_big (needs 10 x 12 = 120 s, more than is left) is not started: "not run", saying why and what to do;
    and the closing line counts the two, from the records the outputs come from."""
    none = {"seconds": 0.1, "calls": []}
    tree = _fake_tree(tmp_path, {"test_1a": none, "test_1b": none, "test_1c": none, "test_1d": none, "test_1e": none,
                                 "test_2a_passes": none})
    _add_big_test(tree, 0, names={"test_2x_wrong": 3.0, "test_2y_cut": 3.0, "test_2z_big": 12.0})
    tests, log = _grade_command(tree, capsys, monkeypatch, budget=100, timeout=160, FAKE_PLAN="2y,2z",
                                FAKE_HANG_IN=FN)
    body = {n: t["output"].split("\n\n", 1)[1] for n, t in tests.items()}
    assert all(tests[n]["status"] == "passed" for n in tests if not n.startswith(("test_2x", "test_2y", "test_2z"))), \
        tests
    cut = tests["test_2y_cut"]
    assert cut["status"] == "failed" and cut["score"] == 0
    assert re.match(r"did not finish, cut for time: this test started with \d+ s left of the grading time budget "
                    r"\(100 s\), less than its time limit \(120 s\), and ran out of it\. That is the grader's time "
                    r"running out, not evidence of a hang", body["test_2y_cut"]), body["test_2y_cut"]
    assert "timed out" not in cut["output"] and "hung" not in cut["output"], cut["output"]
    assert "hung:" not in log, log  # no function blamed (grading_limits' summary row)
    assert re.search(r"time limit: (9\d|100) s", cut["output"]), cut["output"]  # it ran, with what was left
    wrong = tests["test_2x_wrong"]
    assert body["test_2x_wrong"].startswith("failed:\n\nrank 0: loss 2.5, expected 2.25"), wrong["output"]
    big = tests["test_2z_big"]
    assert big["status"] == "failed" and big["score"] == 0
    assert re.match(r"not run: the grading time budget \(100 s\) had \d+ s left when this test's turn came, less "
                    r"than it needs on a busy machine \(120 s; its time limit is 390 s\), so it was not started: it "
                    r"was not graded, and nothing in it failed\.", body["test_2z_big"]), body["test_2z_big"]
    assert "ask the course staff to grade the submission again" in big["output"] and "grade --zip" in big["output"]
    assert "time limit: " not in big["output"] and "hung" not in big["output"], big["output"]
    # The closing line counts what the outputs say: one not run and one cut for time, of nine.
    assert [n for n, b in body.items() if b.startswith(("not run", "did not finish"))] == ["test_2y_cut",
                                                                                           "test_2z_big"]
    assert re.search(r"^grade: 2 of 9 tests were not run or cut for time, so not graded on their merits: 1 not "
                     r"started because the grading time budget \(100 s\) had less left than they need or had run "
                     r"out; 1 cut for time \(their limit cut to what was left of the budget and run out of",
                     log, re.MULTILINE), log
    assert "to grade every test, run it with no --budget and no --timeout" in log, log


def test_a_test_running_when_the_run_is_killed_is_cut_for_time_and_counted(tmp_path, capsys, monkeypatch):
    """A TA's run has no budget (nothing is turned away); a run killed at --timeout while a test runs: that test
    "did not finish" (cut for time), the rest "not run", and the closing line counts both, never calling it a hang
    (the fake test would report one had it been let finish: FAKE_PLAN)."""
    none = {"seconds": 0.1, "calls": []}
    tree = _fake_tree(tmp_path, {"test_1a": none, "test_1b": none, "test_1c": none, "test_1d": none, "test_1e": none,
                                 "test_2a_passes": none})
    tests, log = _grade_command(tree, capsys, monkeypatch, budget=None, timeout=25, FAKE_PLAN="1b", FAKE_WAIT="600",
                                FAKE_HANG_IN=FN)
    assert "no time budget: every test runs with its whole time limit" in log, log
    assert tests["test_1a"]["status"] == "passed", tests["test_1a"]["output"]
    body = tests["test_1b"]["output"].split("\n\n", 1)[1]
    assert body.startswith("did not finish: the grading run was stopped while this test was running"), body
    assert "hung" not in tests["test_1b"]["output"], tests["test_1b"]["output"]
    assert re.search(r"^grade: 5 of 6 tests were not run or cut for time, so not graded on their merits: 4 not run "
                     r"because the run stopped before them; 1 cut for time \(their limit cut to what was left of "
                     r"the budget and run out of, or running when the run was killed at --timeout: not a hang\)",
                     log, re.MULTILINE), log


def test_a_tas_run_has_no_budget_and_gradescope_keeps_its_clock():
    """grade --zip (a TA) and a tree: no budget by default, and a --timeout only a wedged grader reaches (every
    test's limit and backstop added up); Gradescope mode: 540 s and a budget of 480 s, as run_autograder passes;
    given one of them, the other follows it."""
    from staff.autograder import grade, grading_limits as gl
    budget, timeout = grade.clocks(None, None, gradescope=False)
    assert budget is None and timeout > sum(gl.TEST_TIMEOUT_FACTOR * (t["seconds"] + gl.STARTUP_S) for t in
                                            json.loads(gl.TIMES_FILE.read_text())["tests"].values())
    assert grade.clocks(None, None, gradescope=True) == (480, 540)
    assert grade.clocks(None, 300, gradescope=False) == (240, 300)
    assert grade.clocks(1140, None, gradescope=False) == (1140, 1200)
    cmd = grade.pytest_command(ROOT, ROOT / "r.json", None, [], [])
    assert "--grade-budget" not in cmd
    assert "--grade-budget" in grade.pytest_command(ROOT, ROOT / "r.json", 480, [], [])


BONUS_POINTS = POINTS + "BONUS_POINTS = 10\n"
BONUS_TESTS = {
    "test_bonus_hsdp.py": '''
import os, time
import pytest

pytestmark = pytest.mark.bonus("hsdp")


@pytest.mark.weight(4)
def test_hsdp_2x2():
    time.sleep(float(os.environ["FAKE_WAIT"]))  # fails slowly: a hang until its collective timeout
    raise AssertionError("all-gather bytes per step 231348; the formula 2 (K-1)/K P gives 231344")


@pytest.mark.weight(2)
def test_hsdp_degenerate():
    raise AssertionError("fails fast")
''',
    "test_bonus_offload.py": '''
import pytest

pytestmark = pytest.mark.bonus("cpu_offload")


@pytest.mark.weight(4)
def test_cpu_offload():
    pass
''',
}


def test_each_bonus_is_graded_on_its_own_clock(tmp_path):
    """Issue 36: the CPU offload test (4.00/4.00 alone) was "not run" because the HSDP tests had failed slowly
    first, and the bonuses shared one share of the budget. Each bonus has its own now: the HSDP tests fail slowly
    and spend HSDP's share (its second test is not run, saying why in words a student can act on), and the offload
    test, after them, is graded and passes."""
    # Needs: task 1 at 10 x 1000 s; each bonus test at 10 x 2 s (the floor). Budget 100 s -> HSDP's share is
    # 100 x 40 / 10060 = 0.4 s, the offload's 0.2 s (one share of 0.6 s for both before), and HSDP's first test
    # fails after 1 s.
    (tmp_path / "tests" / "public").mkdir(parents=True)
    (tmp_path / "tests" / "points.py").write_text(BONUS_POINTS)
    (tmp_path / "tests" / "public" / "test_fake.py").write_text(TESTS)
    for name, text in BONUS_TESTS.items():
        (tmp_path / "tests" / "public" / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["task1: one", "bonus(n): b"]\n')
    fast = {"seconds": 0.1, "calls": []}
    times = {f"tests/public/test_fake.py::test_1{c}": {"seconds": 1000.0 if c == "a" else 0.1, "calls": []}
             for c in "abcde"}
    times |= {f"tests/public/{f}::{t}": fast for f, t in (("test_bonus_hsdp.py", "test_hsdp_2x2"),
                                                          ("test_bonus_hsdp.py", "test_hsdp_degenerate"),
                                                          ("test_bonus_offload.py", "test_cpu_offload"))}
    (tmp_path / "times.json").write_text(json.dumps({"tests": times}))
    tests = _grade(tmp_path, "--grade-budget", "100", FAKE_WAIT="1")
    assert tests["test_hsdp_2x2"]["status"] == "failed" and "231348" in tests["test_hsdp_2x2"]["output"]
    offload = tests["test_cpu_offload"]
    assert offload["status"] == "passed" and offload["score"] == pytest.approx(4.0), offload["output"]
    body = tests["test_hsdp_degenerate"]["output"].split("\n\n")[1]
    assert body.startswith("not run, for time: this test was not started, so it was not graded; nothing in it "
                           "failed. The HSDP bonus's tests that failed before it (test_bonus_hsdp.py::test_hsdp_2x2) "
                           "took 1 s and used up that bonus's share of the grading time (0 s of 100 s)"), body
    assert "make those tests pass, or fail faster" in body, body
    assert "bonus:hsdp: 1/0" in tests["_stdout"] and "bonus:cpu_offload: 0/0" in tests["_stdout"], tests["_stdout"]


def test_the_handout_says_when_a_test_is_not_run_and_its_time_limit_as_the_grader_decides():
    """handout/grading.typ states the grader's rules with its numbers: the time limit and a probe's (the same margin
    for every test), the three hangs, each bonus's own share; and the grader's reasons for "not run" are the three
    the handout lists (the hang, the share, the whole run's time)."""
    from staff.autograder import grading_limits as gl
    text = " ".join((ROOT / "handout" / "grading.typ").read_text().split())
    assert f"A test may run {gl.TEST_TIMEOUT_FACTOR:g} × ($t$ + {gl.STARTUP_S:g} s)" in text
    assert f"run {gl.TEST_TIMEOUT_FACTOR:g} times slower than quiet" in text
    assert f"a shorter limit, {gl.PROBE_FACTOR:g} × ($t$ + {gl.STARTUP_S:g} s)" in text
    assert gl.HANG_CONFIRMATIONS == 3 and "hung in three different tests" in text
    assert "scores 0 without running in exactly three cases" in text and "each bonus on its own" in text
    code = "".join((ROOT / "staff" / "autograder" / name).read_text()
                   for name in ("grading_plugin.py", "grading_limits.py", "grading_results.py"))
    reasons = set(re.findall(r'f?"(not run[:,][^"{]*)', code)) - {"not run: <function> hung in <tests>"}  # (a doc)
    assert reasons == {
        "not run: ",  # (1) "not run: <function> hung in 3 tests ..."
        "not run, for time: this test was not started, so it was not graded; nothing in it failed. ",  # (2)
        "not run: the grading time budget (", "not run: the run stopped early (",  # (3) the whole run
        "not run: the grading run was stopped before this test ran (a global time limit or a crash); "}, reasons
    assert "(3) The whole run stopped before the test started (its time ran out, or it crashed), or the grading " \
        "time left was less than the test needs on a busy machine." in " ".join(text.split())
    assert '"did not finish, cut for time"' in text and "not evidence of a hang" in " ".join(text.split())


# ---- real hanging submissions, graded in full (slow: whole grading runs) -------------------------------------
# CI grades one: hang_task4, a deadlock (rank 0 alone calls a collective) inside backward, the case a student
# meets most. The other three (hang_task1, hang_task6, and hang_branch, which grades twice) cost about 15 of CI's
# minutes and go through the same code: `python -m staff.grader_selftest.zoo --hangs` grades all four with the same
# checks (README, "Staff commands outside CI"); the fake-tree tests above cover the probe and budget logic.
CI_HANG_CASES = ["hang_task4"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", CI_HANG_CASES)
def test_a_hanging_submission_loses_only_the_tests_that_reach_the_hang(case, tmp_path):
    """The reference with one hang put in (zoo.HANG_CASES), graded like Gradescope (540 s, budget 480 s): every
    test that lost points calls the hung function (so it lost them on the merits, not to the budget), the hang
    cost its task points, and the run ends by itself with no process left. `python -m staff.grader_selftest.zoo
    --hangs` grades every case (hang_branch too: a hang in one branch of post_forward must cost only the tests
    that take the branch) and prints the scores."""
    from staff.grader_selftest import zoo
    result = zoo.run_hang_case(next(c for c in zoo.HANG_CASES if c.id == case), tmp_path)
    assert not result["problems"], "\n".join(result["problems"]) + "\n" + result["summary"]


def test_the_hang_cases_outside_ci_exist():
    """What CI leaves to `zoo.py --hangs` is there to run: every case id is known, and CI's are among them."""
    from staff.grader_selftest import zoo
    ids = [c.id for c in zoo.HANG_CASES]
    assert set(CI_HANG_CASES) <= set(ids) and {"hang_task1", "hang_task6", "hang_branch"} <= set(ids), ids
