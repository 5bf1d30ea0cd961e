"""Time limits: per test, per task share of the budget, and hang blame (the grading plugin's "Time limits").

Decides how long each graded test may run (``limit``), which tests are not run because their task (or their
bonus: each bonus has a share of its own) spent its share of ``--grade-budget`` on failures or because a function
they call hangs whatever the configuration (``why_not_run``), and which tests run as probes with a shorter limit
(``probe_limit``), which tests are not started because what is left of the budget is less than they need, and
which failures are "cut for time" (a limit cut to what was left of the budget, run out of: no evidence of a hang,
never blamed; ``cut_failure``). Reads
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

from .grading_selection import BONUS, part_of  # noqa: F401  (part_of: plan's parts)

TIMES_FILE = Path(__file__).resolve().parent / "test_times.json"
BACKSTOP_MARGIN_S = 60.0     # after the harness's deadline: its stack dumps and kills, then the test's own
# single-process checks in the parent; pytest-timeout fires only when the parent itself is blocked
# A test's limit is TEST_TIMEOUT_FACTOR x (its reference time + STARTUP_S): the same slowdown margin for every test.
# The measured time (a test's call, ranks forked from a warm forkserver) leaves out most of what a loaded machine
# adds to starting ranks (fork, process group, rendezvous), so each test is counted a second longer than measured.
# The old rule, max(30 s, 15 x t), allowed 15x to a test of 2 s or more and up to 600x to the quickest; the
# witnessed test (1.07 s) got 28x and took 22x at load 10-13, while the tests that run its code got 48x-107x
# (issue 35): a loaded machine could time out one test and spare its twins.
STARTUP_S = 1.0
TEST_TIMEOUT_FACTOR = 30.0    # the reference ran 9.5x slower at load 10 (issue 8), the witnessed test 22x at 10-13
TEST_TIMEOUT_FLOOR_S = TEST_TIMEOUT_FACTOR * STARTUP_S  # what the quickest test gets (30 s, as before)
PROBE_FACTOR = 12.0           # a probe's limit (a test that calls a function that hung elsewhere): the same rule at
PROBE_FLOOR_S = PROBE_FACTOR * STARTUP_S  # 12x, above what a test needs at load 10 (9.5x), no more
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


def part_order(part: int | str) -> tuple:
    return (1, str(part)) if isinstance(part, str) else (0, str(part).zfill(3))


BONUS_TITLES = {"hsdp": "HSDP", "cpu_offload": "CPU offload"}


def part_label(part: int | str, short: bool = False) -> str:
    """ "Task 4", "The HSDP bonus" (``short``: "Task 4", "that bonus")."""
    if isinstance(part, str) and part.startswith(BONUS):
        name = part.partition(":")[2]
        return "that bonus" if short else f"The {BONUS_TITLES.get(name, name or 'bonus')} bonus"
    return f"Task {part}"


def _function_label(name: str) -> str:
    file, _, func = name.partition(":")
    return f"{func}() (Task {file[4]}, fsdp_assignment/{file})"


class TimeLimits:
    """Per-test time limits, per-task shares of the budget, and hung functions (see the module docstring).

    The arithmetic, with t the reference's quiet time of a test and B the budget:
    limit(test) = TEST_TIMEOUT_FACTOR * (t + STARTUP_S); need(test) = LOAD_FACTOR * max(t, NEED_FLOOR_S);
    share(part) = B * need(part's tests) / need(all tests), where a part is a task or one bonus (HSDP, CPU offload:
    each bonus is graded on its own clock, so one bonus's failures never leave another's tests unrun). A test runs
    for at most min(limit, B - elapsed), and is not started when B - elapsed < min(limit, need): a test whose limit
    was cut and that ran out of it is "cut for time", not a hang (a cut limit is not evidence: cut_failure); the
    time of every test that does not pass is charged to its part ("lost"),
    and once a part has lost its share, its later tests are not run. So hangs cost a part at most its share plus one
    limit, and the other parts keep the rest of the budget; tests that pass are never charged (a loaded machine
    slows every part alike: only the global budget bounds them)."""

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
        # Per part (a task number, or "bonus:<name>" for each bonus; part_of): its share, what its tests that did
        # not pass took, which tests those were, and how many of its tests are left.
        self.part: dict[str, int | str] = {}  # node id -> its part (plan)
        self.share: dict[int | str, float] = {}
        self.lost: dict[int | str, float] = {}
        self.failed: dict[int | str, list[str]] = {}
        self.left: dict[int | str, int] = {}
        # functions blamed together (one per hung rank) -> {"tests": the tests they hung in, "passed": how many
        # later tests that call them all passed (the hang is confined to a branch: keep probing)}
        self.hung: dict[frozenset, dict] = {}
        # why the last test why_not_run turned away was not run: "hang", "share" or "budget" (the last two: for time)
        self.not_run_kind: str | None = None
        # (seconds, its whole limit) when the running test's limit was cut to what was left of the budget, else None
        self.cut: tuple[float, float] | None = None
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
        return TEST_TIMEOUT_FACTOR * (self.reference_seconds(nodeid) + STARTUP_S)

    def plan(self, tests: list[tuple[str, int | str]]) -> None:
        """The selected tests, in run order with their parts (part_of): each part's share of the budget."""
        need: dict[int | str, float] = {}
        for nodeid, part in tests:
            self.part[nodeid] = part
            need[part] = need.get(part, 0.0) + LOAD_FACTOR * max(self.reference_seconds(nodeid), NEED_FLOOR_S)
            self.left[part] = self.left.get(part, 0) + 1
        total = sum(need.values())
        for part in need:
            self.lost[part], self.failed[part] = 0.0, []
            self.share[part] = (self.budget * need[part] / total) if (self.budget and total) else float("inf")

    def set_backstops(self, items, graded) -> None:
        """pytest-timeout's backstop (it interrupts a blocked pytest process, without the ranks' stacks): set at
        collection, since pytest-timeout reads a test's marker in a hook wrapper that runs before any of ours do."""
        if self.enabled and self.record_dir is None:
            for item in items:
                if item.nodeid in graded:
                    item.add_marker(pytest.mark.timeout(self.limit(item.nodeid) + BACKSTOP_MARGIN_S), append=False)

    def why_not_run(self, nodeid: str, task: int | str, elapsed: float) -> str | None:
        """Why the test is not run, or None (it runs). ``task`` is its record's task; its part (a bonus has its
        own) comes from ``plan``."""
        if not self.enabled:
            return None
        part = self.part.get(nodeid, task)
        calls = set(self.times.get(nodeid, {}).get("calls", []))
        self.probing = [functions for functions in self.hung if functions <= calls]
        for functions in self.probing:
            seen = self.hung[functions]
            # distinct test functions: the parametrizations of one test take the same branch, so they confirm
            # nothing about the others (three [False-W] cases of one test hung one after the other)
            if len({t.split("[")[0] for t in seen["tests"]}) >= HANG_CONFIRMATIONS and not seen["passed"]:
                self._skip(part)
                self.probing = []
                self.not_run_kind = "hang"
                names = " and ".join(_function_label(f) for f in sorted(functions))
                return (f"not run: {names} hung in {len(seen['tests'])} tests ({', '.join(seen['tests'])}) and no "
                        f"test that calls {'it' if len(functions) == 1 else 'them'} has passed since, so it hangs "
                        f"whatever the configuration; this test calls {'it' if len(functions) == 1 else 'them'} "
                        f"too (it would wait for the same hang; fix the hang to have it graded)")
        if self.budget is None:
            return None
        if self.lost.get(part, 0.0) >= self.share.get(part, float("inf")):
            self._skip(part)
            self.not_run_kind = "share"
            return self.out_of_share(part)
        full = self.probe_limit(nodeid) if self.probing else self.limit(nodeid)
        if self.budget - elapsed < min(full, self.need(nodeid)):
            # Less left than the test needs on a busy machine: not started (a later, shorter test may still fit).
            # With at least that left but less than its limit, it starts with what is left (start_test), and a
            # failure that ran out of it is "cut for time" (cut_failure), never a hang: a limit the budget cut is
            # not evidence (issue 42: "timed out after 5.65505 s ... a collective that not every rank calls?").
            self._skip(part)
            self.probing = []
            self.not_run_kind = "budget"
            return self.out_of_budget(nodeid, full, self.budget - elapsed)
        return None

    def need(self, nodeid: str) -> float:
        """What a test is expected to take on a busy machine (load 10): its share of the budget's arithmetic."""
        return LOAD_FACTOR * max(self.reference_seconds(nodeid), NEED_FLOOR_S)

    def out_of_budget(self, nodeid: str, full: float, left: float) -> str:
        """The output of a test not started because too little was left of the budget."""
        return (f"not run: the grading time budget ({self.budget:.0f} s) had {max(left, 0.0):.0f} s left when this "
                f"test's turn came, less than it needs on a busy machine ({self.need(nodeid):.0f} s; its time "
                f"limit is {full:.0f} s), so it was not started: it was not graded, and nothing in it failed. The "
                f"time went to the tests before it (a busy grading machine runs every test slower; a test that "
                f"hangs waits for its whole limit). To have it graded: ask the course staff to grade the submission "
                f"again; they grade it with `python -m staff.autograder.grade --zip`, which has no time budget "
                f"unless given one (--budget) and gives every test its whole limit.")

    def cut_failure(self, exc, call_seconds: float) -> str | None:
        """For a failure of the running test: if its limit was cut to what was left of the budget and it failed
        by running out of that (the harness's timeout, or a failure once 80% of it had passed: the harness shrinks
        its collective timeouts to the deadline too), what its output says instead of the failure (None
        otherwise: a failure well before the cut deadline is the code's own)."""
        if self.cut is None:
            return None
        seconds, full = self.cut
        if not (_is_hang(exc) or call_seconds >= 0.8 * seconds):
            return None
        return (f"did not finish, cut for time: this test started with {seconds:.0f} s left of the grading time "
                f"budget ({self.budget:.0f} s), less than its time limit ({full:.0f} s), and ran out of it. That "
                f"is the grader's time running out, not evidence of a hang or of a wrong result: the test was not "
                f"graded on its merits (0 points), and no function is blamed for a hang. To have it graded, ask the "
                f"course staff to grade the submission again (`python -m staff.autograder.grade --zip` gives every "
                f"test its whole limit).")

    def out_of_share(self, part: int | str) -> str:
        """The output of a test not run because its part spent its share on failures: what ran out (the grader's
        time, not this test's code), and what to do."""
        failed = self.failed.get(part, [])
        names = ", ".join(n.rpartition("/")[2] for n in failed[:6]) + (", ..." if len(failed) > 6 else "")
        return (f"not run, for time: this test was not started, so it was not graded; nothing in it failed. "
                f"{part_label(part)}'s tests that failed before it ({names}) took {self.lost[part]:.0f} s and used "
                f"up {part_label(part, short=True)}'s share of the grading time ({self.share[part]:.0f} s of "
                f"{self.budget:.0f} s). The grader gives each task, and each bonus, a share of its time that its "
                f"failing tests may use, so that they cannot take the time of the others' tests. To have this test graded, make those tests pass, or fail faster: a test that hangs waits "
                f"for its full time limit (its output says how long), a collective that a rank never joins waits "
                f"for the collective timeout.")

    def _skip(self, part: int | str) -> None:
        self.left[part] = self.left.get(part, 1) - 1

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
        self.cut = None
        if self.budget is not None and self.budget - elapsed < seconds:  # what is left (why_not_run: >= its need)
            self.cut = (max(1.0, self.budget - elapsed), seconds)
            seconds = self.cut[0]
        os.environ["FSDP_RANK_DEADLINE"] = f"{time.time() + seconds:.3f}"
        return seconds  # (pytest-timeout's backstop was set at collection: limit + BACKSTOP_MARGIN_S)

    def probe_limit(self, nodeid: str) -> float:
        return PROBE_FACTOR * (self.reference_seconds(nodeid) + STARTUP_S)

    def probe_note(self) -> str | None:
        """What the running test's output says when it runs as a probe (None when it does not)."""
        if not self.probing:
            return None
        names = "; ".join(f"{' and '.join(_function_label(f) for f in sorted(fs))} hung in "
                          f"{', '.join(self.hung[fs]['tests'])}" for fs in self.probing)
        return (f"note: a probe: {names}, and this test calls the same, so it runs with a shorter time limit "
                f"(12 times the reference's time plus a second, enough for a machine ten times slower); if it does "
                f"not take the branch that hangs, it passes")

    def end_test(self, nodeid: str, task: int | str, elapsed: float, call_seconds: float, passed: bool) -> None:
        os.environ.pop("FSDP_RANK_DEADLINE", None)
        self.cut = None
        task = self.part.get(nodeid, task)
        if passed:  # it called every function of these sets and did not hang: the hang is confined to a branch
            for functions in self.probing:
                self.hung[functions]["passed"] += 1
        self.probing = []
        if not passed and task in self.lost and self.started_at is not None:
            self.lost[task] += elapsed - self.started_at
            self.failed[task].append(nodeid)
        self._skip(task)
        if self.record_dir is not None:
            self.durations[nodeid] = call_seconds
            os.environ.pop("FSDP_TRACE_TASK_CALLS", None)

    def record_failure(self, nodeid: str, name: str, exc) -> list[str]:
        """Remember the functions a hang is blamed on; returns their labels."""
        if not self.enabled or not _is_hang(exc) or self.cut is not None:  # a cut limit is no evidence of a hang
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
            rows.append("shares of the budget (lost to failing tests/share s): " + ", ".join(
                f"{t}: {self.lost[t]:.0f}/{self.share[t]:.0f}" for t in sorted(self.share, key=part_order)))
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
