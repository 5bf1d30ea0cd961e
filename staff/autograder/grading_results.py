"""results.json and the terminal's score table: what a graded run reports, and how it is written.

Every write holds every graded test (a test not finished is a failure with 0 points whose output says why) and
is atomic (temporary file + rename), so a kill at any moment leaves a valid results.json. Bonus tests carry the
tag ``bonus`` and are kept out of ``score``. Text from the submission goes through the plugin's ``clean``
(grading_plugin.sanitize: no terminal escapes or control characters) and is cut at ``OUTPUT_LIMIT``.
``ResultsJson`` is a part of grading_plugin.Grader.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .grading_limits import STARTUP_S, UNKNOWN_TEST_S
from .grading_selection import BONUS, Record

VISIBLE = "visible"
HIDDEN = "after_published"
OUTPUT_LIMIT = 7000  # characters of a test's output in results.json (head kept: it says what happened)


class ResultsJson:
    """The grading plugin's reports (a part of grading_plugin.Grader: self.records, self.points, self.limits,
    self.clean, ...)."""

    final = False
    stop_kind: str | None = None  # grading_plugin.Grader's: why the session stopped before some tests

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_sep("=", "FSDP assignment: score by task")
        for line in self.table().splitlines():
            terminalreporter.write_line(line)
        terminalreporter.write_sep("-", "time by task (seconds in test calls)")
        for line in self.timing().splitlines():
            terminalreporter.write_line(line)
        if self.results_path:
            terminalreporter.write_line(f"results: {self.results_path}")

    def timing(self) -> str:
        rows, total_calls = [], 0.0
        for task in self.points.TASK_POINTS:
            pub = sum(r.duration for r in self.records.values() if r.task == task and not r.hidden)
            hid = sum(r.duration for r in self.records.values() if r.task == task and r.hidden)
            total_calls += pub + hid
            rows.append(f"task {task}: public {pub:6.1f}  hidden {hid:6.1f}")
        bonus = sum(r.duration for r in self.records.values() if r.task == BONUS)
        if any(r.task == BONUS for r in self.records.values()):
            total_calls += bonus
            rows.append(f"bonus:  public {bonus:6.1f}")
        elapsed = time.time() - self.start
        rows.append(f"all test calls {total_calls:.1f} s; session {elapsed:.1f} s (the rest: collection, "
                    f"forkserver start-up, setup/teardown)")
        rows += self.limits.summary()
        return "\n".join(rows)

    final = False

    def test_output(self, rec: Record) -> str:
        visibility = "hidden" if rec.hidden else "public"
        title = self.points.TASK_TITLES.get(rec.task, "")
        score = rec.max_score if rec.passed else 0.0
        head = f"Task {rec.task} ({title}), {visibility} test: {score:.2f} / {rec.max_score:.2f} points"
        if rec.task == BONUS:
            head = (f"Bonus ({rec.bonus}), {visibility} test: {score:.2f} / {rec.max_score:.2f} bonus points (apart "
                    f"from the 100)")
        if rec.state == "pending":
            why = self.stop_reason if self.final and self.stop_reason else (
                "not run: the grading run was stopped before this test ran (a global time limit or a crash); "
                "it scores 0")
            body = why
        elif rec.state == "running":
            body = ("did not finish: the grading run was stopped while this test was running (a global time "
                    "limit or a crash); it scores 0")
        elif rec.passed:
            body = f"passed ({rec.duration:.1f} s)"
        elif rec.failed_phase in ("not run", "cut"):  # the reason, as it stands (no "failed:" before it)
            body = rec.failure
        else:
            phase = {"setup": "failed while setting up", "teardown": "failed while tearing down"}.get(
                rec.failed_phase or "", "failed")
            body = f"{phase}:\n\n{rec.failure}" if rec.failure else phase
        text = self.clean("\n".join([head, "", body, *rec.notes]))
        if len(text) > OUTPUT_LIMIT:
            text = text[:OUTPUT_LIMIT] + f"\n... (output cut at {OUTPUT_LIMIT} characters)"
        return text

    def task_scores(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for task in self.points.TASK_POINTS:
            out[task] = {"public": 0.0, "public_max": 0.0, "hidden": 0.0, "hidden_max": 0.0}
        for rec in self.records.values():
            if rec.task == BONUS:
                continue
            kind = "hidden" if rec.hidden else "public"
            out[rec.task][kind + "_max"] += rec.max_score
            if rec.passed:
                out[rec.task][kind] += rec.max_score
        return out

    def table(self, hidden: bool = True) -> str:
        """The per-task score table; ``hidden=False`` leaves the hidden tests' results out (results.json's
        top-level output is visible to students at once, the hidden tests only after publication)."""
        scores = self.task_scores()
        cols = ("public", "hidden", "total") if hidden else ("public",)
        lines = [f"{'task':<40} " + " ".join(f"{c:>13}" for c in cols)]
        total = total_max = 0.0
        for task, s in scores.items():
            got, mx = s["public"] + s["hidden"], s["public_max"] + s["hidden_max"]
            if not hidden:
                got, mx = s["public"], s["public_max"]
            total, total_max = total + got, total_max + mx
            name = f"{task}. {self.points.TASK_TITLES.get(task, '')}"
            cells = [f"{s['public']:>6.2f}/{s['public_max']:<6.2f}"]
            if hidden:
                cells += [f"{s['hidden']:>6.2f}/{s['hidden_max']:<6.2f}", f"{got:>6.2f}/{mx:<6.2f}"]
            lines.append(f"{name:<40} " + " ".join(cells))
        lines.append(f"{'total':<40} " + " ".join([f"{'':>13}"] * (len(cols) - 1) + [f"{total:>6.2f}/{total_max:<6.2f}"]))
        shown = [r for r in self.records.values() if (hidden or not r.hidden) and r.task != BONUS]
        passed = sum(r.passed for r in shown)
        lines.append(f"{passed} of {len(shown)} {'graded' if hidden else 'public'} tests passed")
        bonus = [r for r in self.records.values() if r.task == BONUS]
        if bonus:
            got, mx = self.bonus_score()
            lines.append(f"{'bonus (apart from the total)':<40} " + " ".join([f"{'':>13}"] * (len(cols) - 1)
                                                                             + [f"{got:>6.2f}/{mx:<6.2f}"]))
            lines.append(f"{sum(r.passed for r in bonus)} of {len(bonus)} bonus tests passed ("
                         + ", ".join(sorted({r.bonus for r in bonus})) + ")")
        if not hidden:
            n_hidden = sum(r.hidden for r in self.records.values())
            hidden_max = sum(r.max_score for r in self.records.values() if r.hidden)
            if n_hidden:
                lines.append(f"{n_hidden} hidden tests ({hidden_max:.2f} points) are graded too; their results "
                             f"appear when grades are published")
        return "\n".join(lines)

    def bonus_score(self) -> tuple[float, float]:
        bonus = [r for r in self.records.values() if r.task == BONUS]
        return sum(r.max_score for r in bonus if r.passed), sum(r.max_score for r in bonus)

    def results(self) -> dict:
        tests = []
        for nodeid in self.order:
            rec = self.records[nodeid]
            tests.append({
                "name": rec.name,
                "number": rec.number,
                "score": round(rec.max_score if rec.passed else 0.0, 4),
                "max_score": round(rec.max_score, 4),
                "status": "passed" if rec.passed else "failed",
                "output": self.test_output(rec),
                "visibility": HIDDEN if rec.hidden else VISIBLE,
                **({"tags": ["bonus", rec.bonus]} if rec.task == BONUS else {}),
            })
        tests.sort(key=lambda t: [int(x) for x in t["number"].split(".")])
        output = self.table(hidden=False)
        if not self.final:
            output += "\n\nThe grading run has not finished: tests not run yet score 0."
        if self.notes:
            output += "\n\n" + self.clean("\n".join(self.notes))
        extra = {"time": self.time_summary()}
        if any(rec.task == BONUS for rec in self.records.values()):
            got, mx = self.bonus_score()
            extra["bonus"] = {"score": round(got, 2), "max_score": round(mx, 2)}
        return {
            # The required tasks only: bonus tests are listed with their points but kept out of the total.
            "score": round(sum(t["score"] for t in tests if "bonus" not in t.get("tags", [])), 2),
            "extra_data": extra,
            "execution_time": int(round(time.time() - self.start)),
            "output": output,
            "stdout_visibility": "hidden",
            "tests": tests,
        }

    def time_summary(self) -> dict:
        """What time did to the run, from the records the tests' outputs come from (results.json's
        ``extra_data["time"]``; grade.py's progress line and closing line read it): the tests finished, the one
        running, those not run for time by reason ("budget": what was left of it was less than the test's limit, or
        it ran out; "share": its task's share went to failing tests; "stopped": the run stopped before them), those
        cut for time (run out of a limit cut to what was left of the budget, or running when the run ended), and
        the reference's seconds (each + STARTUP_S) of the tests that
        ran and of those left, for an estimate of the time left."""
        not_run: dict[str, list[str]] = {"budget": [], "share": [], "stopped": []}
        cut: list[str] = []
        running, finished, pending, ref_done, ref_left = "", 0, 0, 0.0, 0.0
        for nodeid in self.order:
            rec = self.records[nodeid]
            seconds = float(self.limits.times.get(nodeid, {}).get("seconds", UNKNOWN_TEST_S)) + STARTUP_S
            if rec.state == "done":
                finished += 1
                if rec.failed_phase != "not run":
                    ref_done += seconds
                elif rec.not_run_kind in not_run:
                    not_run[rec.not_run_kind].append(rec.name)
                if rec.failed_phase == "cut":  # its limit cut to what was left of the budget, and it ran out of it
                    cut.append(rec.name)
            elif self.final:  # the session ended without running it (pending) or finishing it (running)
                if rec.state == "running":
                    cut.append(rec.name)
                else:
                    not_run[self.stop_kind or "stopped"].append(rec.name)
            else:
                running = rec.name if rec.state == "running" else running
                pending += rec.state == "pending"
                ref_left += seconds
        return {"tests": len(self.order), "finished": finished, "running": running, "pending": pending,
                "not_run": not_run, "cut": cut, "budget_s": self.budget,
                "reference_s": {"finished": round(ref_done, 1), "left": round(ref_left, 1)}}

    def write(self) -> None:
        if not self.results_path or self.write_failed:
            return
        path = Path(self.results_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.results(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            self.write_failed = True
            print(f"grading: cannot write {path}: {err}", file=sys.stderr)
