"""The Gradescope bundle end to end (staff/autograder/build_bundle.py, grade.py).

The bundle is built, checked for the reference (none may be inside: a planted copy must be caught), unzipped
into a fresh directory laid out like Gradescope's /autograder (source/, submission/, results/, run_autograder),
set up with setup.sh (its install step skipped: this machine's torch is used, nothing is downloaded), and then
run_autograder grades two submissions:

- the reference's task files, zipped by the release's make_submission.sh, next to a hostile conftest.py,
  pytest.ini and pyproject.toml that must be ignored -> full marks, every graded test passed (this run is
  tests/staff/conftest.py's ``graded_reference``, shared with the image and release checks; its time is printed,
  not asserted);
- the stubs, the release's zip of them with one file taken out -> 0 points; every test says which task and
  function to implement, and the output says which file was missing (tests/staff/conftest.py's ``graded_stubs``,
  shared with tests/staff/test_release.py);
- a broken submission (two zoo cases: a collective only rank 0 calls, and a results.json forged at the
  grader's results path with summed gradients) on three tests -> the broken tests fail and say why, the
  other passes, the forgery is gone, no process survives.

Both results.json files must validate against Gradescope's schema. About two minutes quiet: the grading runs are
`slow` (CI runs them; `-m "not slow"` keeps only the bundle's contents check).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from staff.autograder import build_bundle, results_schema
from staff.grader_selftest import mutations, zoo

HOSTILE_FILES = ("conftest.py", "tests/conftest.py", "pytest.ini", "pyproject.toml")  # tests/staff/conftest.py's

pytestmark = [pytest.mark.staff, pytest.mark.timeout(2400)]

def _points():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_points", ROOT / "tests" / "points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "autograder.zip"
    build_bundle.build(out)
    return out


def test_bundle_contents_and_no_reference(bundle):
    with zipfile.ZipFile(bundle) as zf:
        entries = {info.filename: zf.read(info) for info in zf.infolist()}
        modes = {info.filename: (info.external_attr >> 16) & 0o777 for info in zf.infolist()}
    assert {"setup.sh", "run_autograder"} <= set(entries)
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111, "the scripts must be executable"
    for needed in ("adapters.py", "tests/harness.py", "tests/conftest.py", "tests/points.py",
                   "staff/autograder/grade.py", "staff/autograder/grading_plugin.py", "staff/autograder/rank_user.py"):
        assert needed in entries
    assert any(n.startswith("tests/hidden/test_") for n in entries) and any(n.startswith("tests/public/test_")
                                                                            for n in entries)
    assert not any("reference" in n.lower() for n in entries)
    assert not any(n.endswith(("mutations.py", "mutant_list.py", "zoo.py")) for n in entries), "staff-only tools must stay out"
    assert build_bundle.check_no_reference(entries) == []
    # The check catches a planted copy, under any name, and a stub replaced by the solution.
    planted = dict(entries)
    planted["fsdp_assignment/support/extra.py"] = (ROOT / "fsdp_assignment" / "reference" /
                                                   "task4_backward.py").read_bytes()
    assert any("task4_backward.py" in p for p in build_bundle.check_no_reference(planted))
    swapped = dict(entries)
    swapped["fsdp_assignment/task6_prefetch.py"] = mutations.reference_student_files()[
        "fsdp_assignment/task6_prefetch.py"].encode()
    assert any("not the generated stub" in p for p in build_bundle.check_no_reference(swapped))


@pytest.fixture(scope="module")
def autograder(bundle, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gradescope") / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(bundle) as zf:
        zf.extractall(root / "source")
    for name in ("setup.sh", "run_autograder"):
        os.chmod(root / "source" / name, 0o755)
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # as Gradescope does
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), FSDP_AUTOGRADER_SKIP_INSTALL="1",
               FSDP_AUTOGRADER_NO_USERADD="1")
    proc = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def _grade(root: Path, files: dict[str, bytes], *args: str, env_extra: dict | None = None) -> tuple[dict, float, str]:
    for d in ("submission", "results"):
        shutil.rmtree(root / d, ignore_errors=True)
        (root / d).mkdir()
    for rel, data in files.items():
        path = root / "submission" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "PYTEST_"))}
    env.update(AUTOGRADER_ROOT=str(root), FSDP_AUTOGRADER_PYTHON=sys.executable, **(env_extra or {}))
    start = time.monotonic()
    proc = subprocess.run([str(root / "run_autograder"), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    seconds = time.monotonic() - start
    results = root / "results" / "results.json"
    assert results.exists(), proc.stdout[-5000:] + proc.stderr[-3000:]
    data = json.loads(results.read_text())
    assert results_schema.validate(data) == [], results_schema.validate(data)
    return data, seconds, proc.stdout


@pytest.mark.slow
def test_reference_gets_full_marks(graded_reference):
    """The reference's task files, zipped by the release's make_submission.sh, next to a hostile conftest.py,
    pytest.ini and pyproject.toml: full marks, every graded test passed, none cut by a limit. The grading run is
    tests/staff/conftest.py's ``graded_reference`` (one per test run, through the bundle's run_autograder)."""
    assert set(HOSTILE_FILES) <= set(graded_reference.submitted), graded_reference.submitted
    data = graded_reference.data
    assert results_schema.validate(data) == [], results_schema.validate(data)
    failed = [t["name"] + "\n" + t["output"][:1500] for t in data["tests"] if t["status"] != "passed"]
    assert not failed, "\n\n".join(failed)
    assert data["score"] == pytest.approx(_points().total_points(), abs=0.01)
    visibilities = {t["visibility"] for t in data["tests"]}
    assert visibilities == {"visible", "after_published"}
    tasks = {int(t["number"].split(".")[0]) for t in data["tests"] if "bonus" not in t.get("tags", [])}
    assert tasks == set(_points().TASK_POINTS)
    bonus = data.get("extra_data", {}).get("bonus", {})  # graded apart from the score (tests/points.py)
    assert bonus.get("score") == pytest.approx(_points().BONUS_POINTS, abs=0.01), bonus
    print(f"\nwhole grading run (public + hidden, {len(data['tests'])} tests) through run_autograder: "
          f"{graded_reference.grade_s:.1f} s wall; pytest's own execution_time {data['execution_time']} s")
    assert "not run" not in json.dumps(data), "no test may be cut by the budget or a time limit"


@pytest.mark.slow
def test_stubs_get_zero_and_say_what_to_implement(graded_stubs):
    """The stubs, with task7_fully_shard.py left out (a file the student forgot: graded as the stub, and said so),
    graded through run_autograder: 0 points, and every test says what to implement. The grading run is
    tests/staff/conftest.py's ``graded_stubs`` (the release's zip of the stubs, shared with test_release.py)."""
    data, seconds = graded_stubs.data, graded_stubs.grade_s
    assert results_schema.validate(data) == [], results_schema.validate(data)
    assert graded_stubs.left_out == "fsdp_assignment/task7_fully_shard.py"
    assert data["score"] == 0
    assert "task7_fully_shard.py: not found in your submission" in data["output"]
    for t in data["tests"]:
        assert t["status"] == "failed" and t["score"] == 0, t["name"]
        if "bonus" in t.get("tags", []):  # the stub's guard names the bonus
            assert t["output"].startswith("Bonus (") and re.search(
                r"NotImplementedError: Bonus \((HSDP|CPU offload)\): ", t["output"]), t["output"][:1500]
            continue
        own_task = int(t["number"].split(".")[0])
        assert t["output"].startswith(f"Task {own_task} ("), t["output"][:200]
        m = re.search(r"NotImplementedError: Task (\d): implement (\S+)", t["output"])
        assert m, f"{t['name']}: the output does not name the task and function to implement:\n{t['output'][:1500]}"
    print(f"\nstubs graded in {seconds:.1f} s")


@pytest.mark.slow
def test_broken_submission_through_the_bundle(autograder):
    """Two zoo cases in one submission, graded through run_autograder on a few tests: a collective only rank 0
    calls (a hang), and a results.json forged at Gradescope's results path plus summed gradients."""
    cases = {c.id: c for c in zoo.CASES}
    both = zoo.Case("hang+forged", "both", edits=cases["hang"].edits + cases["forged_results"].edits,
                    forged_results=True)
    files = {rel: text.encode() for rel, text in zoo.case_files(both).items()}
    tag = os.urandom(8).hex()
    results_path = autograder / "results" / "results.json"
    select = f"{zoo.GRAD_2} or {zoo.RS_AVG} or {zoo.TIED_2}"
    data, seconds, stdout = _grade(autograder, files, "--timeout-cap", "6", "--", "-k", select,
                                   env_extra={zoo.TAG_VAR: tag, zoo.RESULTS_VAR: str(results_path)})
    tests = {t["name"].split("::", 1)[1]: t for t in data["tests"]}
    assert set(tests) == {zoo.GRAD_2, zoo.RS_AVG, zoo.TIED_2}, sorted(tests)
    assert tests[zoo.TIED_2]["status"] == "passed"
    assert tests[zoo.GRAD_2]["status"] == "failed" and re.search(cases["hang"].message, tests[zoo.GRAD_2]["output"])
    assert tests[zoo.RS_AVG]["status"] == "failed" and "MEAN over ranks" in tests[zoo.RS_AVG]["output"]
    assert data["score"] == pytest.approx(tests[zoo.TIED_2]["score"], abs=0.01) and "forged" not in json.dumps(data)
    time.sleep(0.2)
    assert zoo.tagged_processes(tag) == [], "processes of the grading run survived it"
    assert "has not finished" not in data["output"], f"the run did not end by itself ({seconds:.1f} s)"
