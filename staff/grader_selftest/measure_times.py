"""Measure the reference's time per graded test, and which task functions each test calls; write test_times.json.

    python -m staff.grader_selftest.measure_times              # 3 timed runs + 1 traced run, on a quiet machine
    python -m staff.grader_selftest.measure_times --runs 1     # quicker, noisier

The grading plugin's time limits (grading_limits.py) derive each test's time limit and each task's share of the
grading budget from these figures, and uses the traced calls to know which later tests call a function that
already hung (they run as probes, with a shorter limit). Regenerate the file whenever tests are added, renamed or made much slower
(tests/staff/test_grading_budget.py fails when a graded test is missing from it).

Each run grades the reference's task files in a fresh staged tree (as the mutation self-test does) with
``grade.py --grade-record``: the call time of every test. A test's figure is its minimum over the timed runs
(the best estimate of its quiet time: load only ever adds); the traced run (``FSDP_TRACE_TASK_CALLS``, which
slows every Python call) gives only the calls. Staff-only: not in the bundle (the file it writes is).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from staff.autograder import grade
from staff.autograder.grading_limits import TIMES_FILE
from staff.grader_selftest import mutations

OUT = TIMES_FILE  # the grading plugin's per-test limits: shipped in the bundle, next to the plugin


def record_run(tree: Path, workdir: Path, name: str, *, trace: bool) -> dict:
    """One grading run of the reference; {nodeid: {"seconds", "calls"}}."""
    record = workdir / name
    record.mkdir()
    results = workdir / f"{name}.json"
    cmd = grade.command("--results", str(results), "--rank-user", "none", "--budget", "100000", "--timeout", "3600",
                        "--", "--grade-record", str(record), *(["--grade-record-calls"] if trace else []))
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=3700)
    data = json.loads((record / "record.json").read_text()) if (record / "record.json").exists() else {}
    graded = json.loads(results.read_text()) if results.exists() else {}
    failed = [t["name"] for t in graded.get("tests", []) if t["status"] != "passed"]
    if not data or failed:
        raise SystemExit(f"measure_times: the reference did not pass every test in run {name} "
                         f"(failed: {failed[:10]}):\n{proc.stdout[-3000:]}")
    if not trace:
        return data
    # The traced run: only its calls count.
    return {k: {"calls": v["calls"]} for k, v in data.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="timed runs (the minimum per test is kept)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-times-"))
    loads = []
    try:
        tree = workdir / "tree"
        mutations.stage_tree(tree, mutations.reference_student_files())
        start = time.monotonic()
        traced = record_run(tree, workdir, "traced", trace=True)
        timed = []
        for i in range(args.runs):
            loads.append(os.getloadavg()[0])
            timed.append(record_run(tree, workdir, f"timed{i}", trace=False))
            print(f"run {i + 1}/{args.runs} done (load {loads[-1]:.1f})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    tests = {}
    for nodeid in sorted(traced):
        seconds = [run[nodeid]["seconds"] for run in timed if nodeid in run]
        tests[nodeid] = {"seconds": round(min(seconds), 3) if seconds else None, "calls": traced[nodeid]["calls"]}
    import torch
    data = {
        "about": "The reference's call time per graded test (minimum over timed runs) and the task functions it "
                 "calls; written by staff/grader_selftest/measure_times.py, read by grading_plugin.py.",
        "measured": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "timed_runs": args.runs,
                     "load_1min_at_each_run": [round(x, 2) for x in loads], "cpus": os.cpu_count(),
                     "python": platform.python_version(), "torch": torch.__version__,
                     "total_seconds": round(sum(t["seconds"] or 0 for t in tests.values()), 1),
                     "wall_seconds": round(time.monotonic() - start, 1)},
        "tests": tests,
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: {len(tests)} tests, {data['measured']['total_seconds']} s of test calls "
          f"(loads {data['measured']['load_1min_at_each_run']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
