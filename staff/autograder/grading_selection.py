"""Selection and points: which collected tests are graded, what each is worth, and the order they run in.

Graded: every test with a task marker (``task1`` .. ``task7``) that runs on gloo, and the bonus tests
(``@pytest.mark.bonus``); a task's points (tests/points.py) are split over its graded tests by weight, computed
before ``-k``/``-m`` deselect any. Order: ``--grade-first``, then ``--grade-first-task``, then task by task, every
public test before any hidden one. ``Selection`` holds the grading plugin's collection hooks (grading_plugin.py
assembles the plugin from it, grading_limits.py and grading_results.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

GRADED_BACKEND = "gloo"
BONUS = "bonus"  # the ``task`` of a bonus test's record (its points come from BONUS_POINTS, not TASK_POINTS)


def load_points(rootpath: Path):
    """tests/points.py under ``rootpath``, loaded by path (it is not a package import the tests depend on)."""
    path = Path(rootpath) / "tests" / "points.py"
    spec = importlib.util.spec_from_file_location("_fsdp_points", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def task_of(item) -> int | None:
    for marker in item.iter_markers():
        m = re.fullmatch(r"task(\d+)", marker.name)
        if m:
            return int(m.group(1))
    return None


def bonus_of(item) -> str | None:
    """The bonus a test belongs to (``@pytest.mark.bonus("hsdp")``), or None."""
    marker = item.get_closest_marker("bonus")
    return None if marker is None else str(marker.args[0] if marker.args else "bonus")


def part_of(task, bonus: str | None):
    """The part of the grading budget a test's time is charged to (grading_limits.TimeLimits): its task, or its
    own bonus ("bonus:hsdp"), so that one bonus's failures never leave another bonus's tests unrun."""
    return f"{BONUS}:{bonus}" if task == BONUS and bonus else task


def task_order(task) -> tuple[int, int]:
    """Sort key of a task: 1..7 in order, the bonus after them."""
    return (1, 0) if task == BONUS else (0, task)


def weight_of(item, default: float) -> float:
    marker = item.get_closest_marker("weight")
    if marker is None:
        return float(default)
    value = marker.args[0] if marker.args else marker.kwargs.get("n", default)
    return float(value)


def backend_of(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None else None


EVIDENCE = ("memory", "bytes")


def evidence_of(item) -> frozenset[str]:
    """The properties a test decides from what the ranks report (``@pytest.mark.evidence("memory", "bytes")``)."""
    found = set()
    for mark in item.iter_markers("evidence"):
        found.update(a for a in mark.args if a in EVIDENCE)
    return frozenset(found)


class Record:
    """One graded test, as results.json will show it."""

    def __init__(self, item, task, weight: float, hidden: bool, max_score: float):
        self.nodeid = item.nodeid
        self.task, self.weight, self.hidden, self.max_score = task, weight, hidden, max_score
        self.bonus = bonus_of(item) if task == BONUS else None
        self.number = ""
        self.state = "pending"  # -> "running" -> "done"
        self.failed_phase: str | None = None
        self.failure = ""
        self.call_passed = False
        self.duration = 0.0
        self.notes: list[str] = []
        # With failed_phase "not run": why (grading_limits.TimeLimits.not_run_kind): "hang" (a function it calls
        # hangs always), "share" (its task's share of the budget went to failing tests), "budget" (what was left of
        # the budget was less than its time limit); the last two are for time (results.json's extra_data["time"]).
        self.not_run_kind: str | None = None
        # The properties the test decides (marker evidence("memory", "bytes")), each judged by the kernel's witness
        # of this test's own run: its failure fails this test and no other.
        self.evidence = evidence_of(item)

    @property
    def passed(self) -> bool:
        return self.state == "done" and self.call_passed and self.failed_phase is None

    @property
    def name(self) -> str:
        path, _, rest = self.nodeid.partition("::")
        who = f"Bonus ({self.bonus})" if self.task == BONUS else f"Task {self.task}"
        return f"{who} {'hidden' if self.hidden else 'public'}: {Path(path).name}::{rest}"


class Selection:
    """The grading plugin's collection hooks (a part of grading_plugin.Grader: self.points, self.records, ...)."""

    # ---- collection -------------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        """Before -k/-m: keep the graded tests only, and fix each one's points over all of them."""
        graded, deselected = [], []
        bonus_points = getattr(self.points, "BONUS_POINTS", 0)
        for item in items:
            task = task_of(item)
            if task is None and bonus_of(item) is not None and bonus_points:
                task = BONUS
            backend = backend_of(item)
            if task is None or (task != BONUS and task not in self.points.TASK_POINTS) or \
                    backend not in (None, GRADED_BACKEND):
                deselected.append(item)
            else:
                graded.append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = graded
        weights: dict = {}
        for item in graded:
            task = task_of(item) or BONUS
            weights[task] = weights.get(task, 0.0) + weight_of(item, self.points.DEFAULT_WEIGHT)
        self.weights_total = weights
        for item in graded:
            task = task_of(item) or BONUS
            weight = weight_of(item, self.points.DEFAULT_WEIGHT)
            rel = Path(str(item.path)).resolve().relative_to(config.rootpath.resolve()).as_posix() \
                if Path(str(item.path)).resolve().is_relative_to(config.rootpath.resolve()) else str(item.path)
            hidden = rel.startswith("tests/hidden/")
            points = bonus_points if task == BONUS else self.points.TASK_POINTS[task]
            max_score = points * weight / weights[task]
            self.records[item.nodeid] = Record(item, task, weight, hidden, max_score)
        missing = sorted(set(self.points.TASK_POINTS) - set(weights))
        if missing:
            self.notes.append(f"no graded tests were collected for task(s) {', '.join(map(str, missing))}")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session) -> None:
        """After -k/-m: order the selected tests, number them, and write the first results.json."""
        index = {item.nodeid: i for i, item in enumerate(session.items)}

        def key(item):
            rec = self.records.get(item.nodeid)
            first = next((i for i, s in enumerate(self.first) if s in item.nodeid), len(self.first))
            task = rec.task if rec else 99
            # Every public test before any hidden one: a hidden test's rank runs student code that can read
            # the hidden module it was imported with; whatever it might leave behind, no visible test runs after.
            return (first, rec.hidden if rec else True, task != self.first_task if self.first_task else False,
                    task_order(task), index[item.nodeid])

        session.items.sort(key=key)
        selected = {item.nodeid for item in session.items}
        self.records = {k: v for k, v in self.records.items() if k in selected}
        self.order = [item.nodeid for item in session.items if item.nodeid in self.records]
        per_task: dict[int, int] = {}
        for nodeid in sorted(self.order, key=lambda n: (task_order(self.records[n].task), self.records[n].hidden,
                                                        index[n])):
            rec = self.records[nodeid]
            per_task[rec.task] = per_task.get(rec.task, 0) + 1
            rec.number = f"{self.bonus_number if rec.task == BONUS else rec.task}.{per_task[rec.task]}"
        self.limits.plan([(n, part_of(self.records[n].task, self.records[n].bonus)) for n in self.order])
        self.limits.set_backstops(session.items, self.records)
        self.write()

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # a staff problem (test modules never import student code), but say so
            self.notes.append(f"collection error in {report.nodeid or 'the test tree'} (tell the course staff): "
                              f"{str(report.longrepr)[-1500:]}")
