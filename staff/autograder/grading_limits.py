"""Time limits: per test, per task share of the budget, and hang blame (the grading plugin's "Time limits").

Decides how long each graded test may run (``limit``), which tests are not run because their task spent its
share of ``--grade-budget`` on failures or because a function they call hangs whatever the configuration
(``why_not_run``), and which tests run as probes with a shorter limit (``probe_limit``). Reads
``test_times.json`` (the reference's measured time per test and the task functions it calls; ``measure_times.py``
writes it, through ``--grade-record``, also handled here). The plugin (grading_plugin.py) calls it around each test.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from .grading_selection import BONUS, task_order

TIMES_FILE = Path(__file__).resolve().parent / "test_times.json"
BACKSTOP_MARGIN_S = 60.0     # after the harness's deadline: its stack dumps and kills, then the test's own
# single-process checks in the parent; pytest-timeout fires only when the parent itself is blocked
TEST_TIMEOUT_FLOOR_S = 30.0   # no test gets less: start-up alone (fork, process group) takes seconds under load
TEST_TIMEOUT_FACTOR = 15.0    # x the reference's quiet time; the reference ran 9.5x slower at load 10 (issue 8)
PROBE_FLOOR_S = 12.0          # a probe's limit (a test that calls a function that hung elsewhere): start-up under
PROBE_FACTOR = 10.0           # load, and 10x the reference's time (it ran 9.5x slower at load 10), no more
HANG_CONFIRMATIONS = 3        # hung in this many test functions, none passing in between: it hangs always
LOAD_FACTOR = 10.0            # what a task is expected to need: 10x its reference time (load 10), ...
NEED_FLOOR_S = 2.0            # ... counting each test as at least this long (start-up: fork, process group)
UNKNOWN_TEST_S = 5.0          # a test missing from the times file (regenerate it: measure_times.py)

_FRAME = re.compile(r'File "[^"\n]*?fsdp_assignment[/\\](task(\d)_\w+\.py)", line \d+,? in (\w+)')


def hung_functions(message: str, known: set[str]) -> list[str]:
    """The task functions a hang is blamed on: in each stack or traceback of ``message`` (most recent call first
    for faulthandler's dumps, last for tracebacks), the innermost frame of a task file whose function is one the
    reference calls (``known``: "taskN_x.py:function"). A student's own helper is not in ``known``; the known
    function that called it is blamed."""
    found: list[str] = []
    blocks = re.split(r"\n\s*\n|(?=Traceback \(most recent call last\))|(?=Thread 0x)|(?=Current thread 0x)",
                      message)
    for block in blocks:
        frames = [f"{m.group(1)}:{m.group(3)}" for m in _FRAME.finditer(block)]
        if "Traceback (most recent call last)" in block:
            frames.reverse()  # tracebacks list the innermost frame last
        for frame in frames:
            if frame in known:
                if frame not in found:
                    found.append(frame)
                break
    return found


def _is_hang(exc) -> bool:
    """The harness's timeout (tests.harness.RankFailure, kind "timeout"): its message holds every hung rank's
    stack. A rank that raised after a collective timed out shows only its own traceback, often a victim's (it
    waited in an ordinary all-gather while the culprit sat in a collective no one else called): not a hang here."""
    return getattr(exc, "kind", None) == "timeout"


def _function_label(name: str) -> str:
    file, _, func = name.partition(":")
    return f"{func}() (Task {file[4]}, fsdp_assignment/{file})"


class TimeLimits:
    """Per-test time limits, per-task shares of the budget, and hung functions (see the module docstring).

    The arithmetic, with t the reference's quiet time of a test and B the budget:
    limit(test) = max(TEST_TIMEOUT_FLOOR_S, TEST_TIMEOUT_FACTOR * t); need(test) = LOAD_FACTOR * max(t, NEED_FLOOR_S);
    share(task) = B * need(task's tests) / need(all tests). A test runs for at most min(limit, B - elapsed); the time
    of every test that does not pass is charged to its task ("lost"), and once a task has lost its share, its later
    tests are not run. So hangs cost a task at most its share plus one limit, and the other tasks keep the rest of
    the budget; tests that pass are never charged (a loaded machine slows every task alike: only the global
    budget bounds them)."""

    def __init__(self, config, budget: float | None):
        self.budget = budget
        self.record_dir = config.getoption("--grade-record")
        self.record_calls = config.getoption("--grade-record-calls")
        option = config.getoption("--grade-times")
        self.enabled = option != "none" and self.record_dir is None
        path = Path(option) if option and option != "none" else TIMES_FILE
        self.times: dict[str, dict] = {}
        if self.enabled and path.is_file():
            self.times = json.loads(path.read_text()).get("tests", {})
        self.known = {c for entry in self.times.values() for c in entry.get("calls", [])}
        self.share: dict[int, float] = {}
        self.lost: dict[int, float] = {}      # seconds of tests that did not pass, per task
        self.left: dict[int, int] = {}       # tests not yet run, per task
        # functions blamed together (one per hung rank) -> {"tests": the tests they hung in, "passed": how many
        # later tests that call them all passed (the hang is confined to a branch: keep probing)}
        self.hung: dict[frozenset, dict] = {}
        self.probing: list[frozenset] = []    # the blamed sets the running test calls (it runs as a probe)
        self.started_at: float | None = None
        self.durations: dict[str, float] = {}
        self.unknown: list[str] = []

    def reference_seconds(self, nodeid: str) -> float:
        entry = self.times.get(nodeid)
        if entry is None:
            if nodeid not in self.unknown:
                self.unknown.append(nodeid)
            return UNKNOWN_TEST_S
        return float(entry["seconds"])

    def limit(self, nodeid: str) -> float:
        return max(TEST_TIMEOUT_FLOOR_S, TEST_TIMEOUT_FACTOR * self.reference_seconds(nodeid))

    def plan(self, tests: list[tuple[str, int]]) -> None:
        """The selected tests, in run order with their tasks: each task's share of the budget."""
        need: dict[int, float] = {}
        for nodeid, task in tests:
            need[task] = need.get(task, 0.0) + LOAD_FACTOR * max(self.reference_seconds(nodeid), NEED_FLOOR_S)
            self.left[task] = self.left.get(task, 0) + 1
        total = sum(need.values())
        for task in need:
            self.lost[task] = 0.0
            self.share[task] = (self.budget * need[task] / total) if (self.budget and total) else float("inf")

    def set_backstops(self, items, graded) -> None:
        """pytest-timeout's backstop (it interrupts a blocked pytest process, without the ranks' stacks): set at
        collection, since pytest-timeout reads a test's marker in a hook wrapper that runs before any of ours do."""
        if self.enabled and self.record_dir is None:
            for item in items:
                if item.nodeid in graded:
                    item.add_marker(pytest.mark.timeout(self.limit(item.nodeid) + BACKSTOP_MARGIN_S), append=False)

    def why_not_run(self, nodeid: str, task: int, elapsed: float) -> str | None:
        if not self.enabled:
            return None
        calls = set(self.times.get(nodeid, {}).get("calls", []))
        self.probing = [functions for functions in self.hung if functions <= calls]
        for functions in self.probing:
            seen = self.hung[functions]
            # distinct test functions: the parametrizations of one test take the same branch, so they confirm
            # nothing about the others (three [False-W] cases of one test hung one after the other)
            if len({t.split("[")[0] for t in seen["tests"]}) >= HANG_CONFIRMATIONS and not seen["passed"]:
                self._skip(task)
                self.probing = []
                names = " and ".join(_function_label(f) for f in sorted(functions))
                return (f"not run: {names} hung in {len(seen['tests'])} tests ({', '.join(seen['tests'])}) and no "
                        f"test that calls {'it' if len(functions) == 1 else 'them'} has passed since, so it hangs "
                        f"whatever the configuration; this test calls {'it' if len(functions) == 1 else 'them'} "
                        f"too (it would wait for the same hang; fix the hang to have it graded)")
        if self.budget is None:
            return None
        if self.lost.get(task, 0.0) >= self.share.get(task, float("inf")):
            self._skip(task)
            return (f"not run: {'the bonus' if task == BONUS else f'Task {task}'}'s earlier tests that failed took {self.lost[task]:.0f} s, its share of "
                    f"the grading time ({self.share[task]:.0f} s of {self.budget:.0f} s; tests that hang spend it: "
                    f"each waits for its time limit); the other tasks keep theirs")
        return None

    def _skip(self, task: int) -> None:
        self.left[task] = self.left.get(task, 1) - 1

    def start_test(self, item, task: int, elapsed: float) -> float | None:
        """Set this test's time limit (returned): the harness's deadline and pytest-timeout's backstop."""
        self.started_at = elapsed
        if self.record_dir is not None:
            if self.record_calls:  # read by the harness in each rank (tests/rank_isolation.py, trace_task_calls)
                os.environ["FSDP_TRACE_TASK_CALLS"] = str(Path(self.record_dir) / f"calls-{len(self.durations)}.txt")
            self.durations.setdefault(item.nodeid, 0.0)
            return None
        if not self.enabled:
            return None
        # The harness's own timeouts count from the ranks' start, so the forkserver's start-up (the first test
        # imports torch there) does not eat into them.
        seconds = self.limit(item.nodeid)
        if self.probing:
            seconds = min(seconds, self.probe_limit(item.nodeid))
        if self.budget is not None:
            seconds = max(1.0, min(seconds, self.budget - elapsed))
        os.environ["FSDP_RANK_DEADLINE"] = f"{time.time() + seconds:.3f}"
        return seconds  # (pytest-timeout's backstop was set at collection: limit + BACKSTOP_MARGIN_S)

    def probe_limit(self, nodeid: str) -> float:
        return max(PROBE_FLOOR_S, PROBE_FACTOR * self.reference_seconds(nodeid))

    def probe_note(self) -> str | None:
        """What the running test's output says when it runs as a probe (None when it does not)."""
        if not self.probing:
            return None
        names = "; ".join(f"{' and '.join(_function_label(f) for f in sorted(fs))} hung in "
                          f"{', '.join(self.hung[fs]['tests'])}" for fs in self.probing)
        return (f"note: a probe: {names}, and this test calls the same, so it runs with a shorter time limit "
                f"(enough for it at 10x the reference's time); if it does not take the branch that hangs, it passes")

    def end_test(self, nodeid: str, task: int, elapsed: float, call_seconds: float, passed: bool) -> None:
        os.environ.pop("FSDP_RANK_DEADLINE", None)
        if passed:  # it called every function of these sets and did not hang: the hang is confined to a branch
            for functions in self.probing:
                self.hung[functions]["passed"] += 1
        self.probing = []
        if not passed and task in self.lost and self.started_at is not None:
            self.lost[task] += elapsed - self.started_at
        self._skip(task)
        if self.record_dir is not None:
            self.durations[nodeid] = call_seconds
            os.environ.pop("FSDP_TRACE_TASK_CALLS", None)

    def record_failure(self, nodeid: str, name: str, exc) -> list[str]:
        """Remember the functions a hang is blamed on; returns their labels."""
        if not self.enabled or not _is_hang(exc):
            return []
        blamed = frozenset(hung_functions(str(exc), self.known))
        if not blamed:
            return []
        where = name.split(": ", 1)[-1]
        if blamed in self.hung:
            self.hung[blamed]["tests"].append(where)
            return []
        self.hung[blamed] = {"tests": [where], "passed": 0}
        return [_function_label(f) for f in sorted(blamed)]

    def summary(self) -> list[str]:
        rows = []
        if self.enabled and self.share and self.budget:
            rows.append("task shares of the budget (lost to failing tests/share s): " + ", ".join(
                f"{t}: {self.lost[t]:.0f}/{self.share[t]:.0f}" for t in sorted(self.share, key=task_order)))
        if self.hung:
            rows.append("hung: " + "; ".join(f"{' and '.join(_function_label(f) for f in sorted(fs))} in "
                                             f"{len(h['tests'])} test(s) ({', '.join(h['tests'])}), "
                                             f"{h['passed']} later caller(s) passed" for fs, h in self.hung.items()))
        if self.enabled and not self.times:
            rows.append(f"no per-test time limits: {TIMES_FILE.name} not found (python staff/autograder/"
                        f"measure_times.py writes it)")
        elif self.unknown:
            rows.append(f"{len(self.unknown)} test(s) missing from the times file (limits assume "
                        f"{UNKNOWN_TEST_S:g} s; regenerate it with measure_times.py): {', '.join(self.unknown[:5])}")
        return rows

    def write_record(self) -> None:
        if self.record_dir is None:
            return
        out = {}
        for i, (nodeid, seconds) in enumerate(self.durations.items()):
            path = Path(self.record_dir) / f"calls-{i}.txt"
            calls = sorted({c for c in path.read_text().split() if "<" not in c}) if path.exists() else []
            out[nodeid] = {"seconds": round(seconds, 3), "calls": calls}
        (Path(self.record_dir) / "record.json").write_text(json.dumps(out, indent=1, sort_keys=True))
