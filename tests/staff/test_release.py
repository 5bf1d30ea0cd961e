"""The student release works on its own (staff only; not in the student release).

``test_release_end_to_end`` builds the release (``staff/release.py``) into a temporary directory and then, as a
new student would:

1. checks it statically: no reference, hidden tests or staff tooling; nothing mentions or imports the reference;
   adapters default to the student's code; every Python file compiles (``release.check_release``);
2. creates a fresh virtualenv and installs the release with the README's install command, run verbatim with the
   virtualenv first on PATH. The virtualenv is made with ``--system-site-packages`` so that torch (and pytest,
   submitit) come from this machine instead of being downloaded again; the project itself is installed by the
   README's command (editable), and the test checks that ``fsdp_assignment`` then resolves to the release;
3. runs the README's test command with ``FSDP_IMPL`` unset: every public test must fail, each with a
   ``NotImplementedError`` naming a task ("Task 3: ..."), none may error at collection or hang;
4. runs ``make_submission.sh --skip-tests`` with a writeup: the zip holds the seven task files and the writeup,
   under their repository paths;
5. copies the reference's seven task files over the stubs (imports rewritten for the stub location:
   ``from ..support`` -> ``from .support``, see ``release.reference_task_files``) and runs the README's test
   command again: every test must pass.

It takes about two runs of the public suite plus ~20 s (about 2 minutes on the 2-core CI machine).

``test_release_submission_is_graded_by_the_bundle`` closes the loop with the autograder: ``make_submission.sh``
run inside the release makes a zip that the Gradescope bundle grades: 0 with the stubs, full marks with the
reference's task files, from the one grading of each that the staff checks share (tests/staff/conftest.py:
``graded_stubs``, the release's zip of the stubs graded by run_autograder, and ``graded_reference``, the release's
zip of the reference's files graded through the bundle on setup.sh's image).

``test_make_submission_reports_failing_tests`` checks the script's own reporting on a tiny fake repository (a
passing and a failing test, a missing writeup, a missing task file) in a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from tests.staff.test_make_submission import a_pdf, filled_writeup

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]


def _release_module():
    spec = importlib.util.spec_from_file_location("release", ROOT / "staff" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    # A student's machine: none of the staff CI's knobs (FSDP_IMPL, FSDP_REQUIRE_SLURM, ...) leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")
           and k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "VIRTUAL_ENV", "PYTHONHOME")}
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _junit_cases(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                text = (child.get("message") or "") + "\n" + (child.text or "")
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}", "classname": case.get("classname", ""),
                      "outcome": outcome, "text": text})
    return cases


def _tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_release_end_to_end(tmp_path):
    release = _release_module()
    timings = {}
    t0 = time.monotonic()

    # 1. Build and check statically.
    dest = tmp_path / "fsdp-assignment"
    # Staleness of handout.pdf is test_handout.py's business; here it must only be present.
    release.build_release(dest, allow_stale=True, quiet=True)
    problems = release.check_release(dest)
    assert not problems, "release check:\n  " + "\n  ".join(problems)
    install_cmd, test_cmd = release.readme_commands((dest / "README.md").read_text(encoding="utf-8"))
    timings["build"] = time.monotonic() - t0

    # 2. A fresh virtualenv; install with the README's command.
    t = time.monotonic()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                   capture_output=True, timeout=300)
    env = _clean_env(venv)
    proc = _run(install_cmd, dest, env, timeout=900)
    assert proc.returncode == 0, f"`{install_cmd}` failed in the release:\n{_tail(proc)}"
    proc = _run('python -c "import fsdp_assignment, adapters; print(fsdp_assignment.__file__); '
                'print(adapters.__file__); print(adapters.implementation())"', tmp_path, env, timeout=120)
    assert proc.returncode == 0, _tail(proc)
    pkg_file, adapters_file, impl = proc.stdout.split()
    assert Path(pkg_file).resolve().is_relative_to(dest.resolve()), f"fsdp_assignment resolves to {pkg_file}"
    assert Path(adapters_file).resolve().is_relative_to(dest.resolve()), f"adapters resolves to {adapters_file}"
    assert impl == "student"
    timings["venv + install"] = time.monotonic() - t

    # 3. The stubs: every public test fails with NotImplementedError naming a task (a bonus test: the bonus).
    # tests/public only: the release's other test files (the harness's, the benchmarks', SLURM's) are CI's own
    # top-level files less their staff-only parts, and nothing here judged their outcome: running them cost 90 s.
    t = time.monotonic()
    junit = tmp_path / "stubs.xml"
    proc = _run(f"{test_cmd} tests/public -q -p no:cacheprovider --junitxml={junit}", dest, env, timeout=900)
    assert proc.returncode == 1, f"`{test_cmd}` with the stubs: exit code {proc.returncode}, expected 1\n{_tail(proc)}"
    cases = [c for c in _junit_cases(junit) if c["classname"].startswith("tests.public.")]
    assert cases, f"no public tests ran:\n{_tail(proc)}"
    run = [c for c in cases if c["outcome"] != "skipped"]
    passed = [c["id"] for c in run if c["outcome"] == "passed"]
    assert not passed, f"{len(passed)} public tests pass with the stubs: {passed[:10]}"
    unnamed = [c["id"] for c in run
               if "NotImplementedError" not in c["text"]
               or not re.search(r"\bTask [1-7]:|\bBonus \((HSDP|CPU offload)\):", c["text"])]
    assert not unnamed, (f"{len(unnamed)} public tests fail without a NotImplementedError naming a task, e.g. "
                         f"{unnamed[:5]}:\n" + next(c["text"][-1500:] for c in run if c["id"] == unnamed[0]))
    tasks = {re.search(r"test_task(\d)", c["classname"]).group(1) for c in run if "test_task" in c["classname"]}
    assert tasks == {str(n) for n in range(1, 8)}, f"public tests found only for tasks {sorted(tasks)}"
    timings[f"public tests, stubs ({len(run)} failing as expected)"] = time.monotonic() - t

    # 4. make_submission.sh in the release (tests skipped here: the script's reporting is tested below).
    t = time.monotonic()
    (dest / "WRITEUP.md").write_text(filled_writeup())  # make_submission.sh refuses empty answers
    proc = _run("./make_submission.sh --skip-tests", dest, env, timeout=300)
    assert proc.returncode == 0, _tail(proc)
    names = set(zipfile.ZipFile(dest / "submission.zip").namelist())
    assert names == set(release.TASK_FILES) | {"WRITEUP.md"}, sorted(names)
    timings["make_submission"] = time.monotonic() - t

    # 5. The reference's task files dropped in: the README's command, in this venv, passes Task 1's and Task 7's
    # public tests (the installed package runs the dropped-in files, first and last task). That every public and
    # hidden test passes in a release tree with the tasks up to its own is test_layering.py's; with all of them,
    # graded through the bundle, graded_reference's: the whole suite a third time here cost 3 of CI's minutes.
    t = time.monotonic()
    release.drop_in_reference(dest)
    junit = tmp_path / "reference.xml"
    proc = _run(f"{test_cmd} -q -p no:cacheprovider -m 'task1 or task7' --junitxml={junit}", dest, env, timeout=900)
    cases = [c for c in _junit_cases(junit) if c["classname"].startswith("tests.public.")]
    bad = [c["id"] for c in cases if c["outcome"] in ("failure", "error")]
    assert proc.returncode == 0 and not bad, (f"with the reference's task files: exit code {proc.returncode}, "
                                              f"{len(bad)} failing: {bad[:10]}\n{_tail(proc)}")
    n_passed = sum(c["outcome"] == "passed" for c in cases)
    ran = {re.search(r"test_task(\d)", c["classname"]).group(1) for c in cases
           if c["outcome"] == "passed" and "test_task" in c["classname"]}
    assert ran == {"1", "7"}, f"with the reference's task files, passing public tests only for tasks {sorted(ran)}"
    timings[f"public tests, reference ({n_passed} passing)"] = time.monotonic() - t

    report = ", ".join(f"{k}: {v:.1f}s" for k, v in timings.items())
    print(f"\nrelease check timings: {report}; total {time.monotonic() - t0:.1f}s")


def test_make_submission_reports_failing_tests(tmp_path):
    """The script runs the public tests, says loudly when they fail, still builds the zip, and refuses (exit 1,
    clear message) when something required is missing. A fake repository: one passing and one failing test."""
    repo = tmp_path / "repo"
    (repo / "tests" / "public").mkdir(parents=True)
    shutil.copy(ROOT / "make_submission.sh", repo / "make_submission.sh")
    (repo / "fsdp_assignment").mkdir()
    release = _release_module()
    for rel in release.TASK_FILES:
        (repo / rel).write_text("# task\n")
    (repo / "tests" / "public" / "test_task1_fake.py").write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    raise NotImplementedError('Task 1: fake')\n")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "memory.md").write_text("| a |\n")
    (repo / "benchmarks" / "results" / "cache.pt").write_text("not included")
    env = _clean_env()
    env["PYTHON"] = sys.executable

    # No writeup: refused, nothing written.
    proc = subprocess.run(["bash", "make_submission.sh", "--skip-tests"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "WRITEUP.md or writeup.pdf" in proc.stderr, proc.stdout + proc.stderr
    assert not (repo / "submission.zip").exists()

    # With a writeup: tests run, the failure is reported loudly, the zip is built anyway.
    (repo / "writeup.pdf").write_bytes(a_pdf())  # make_submission.sh checks that it is a real PDF
    proc = subprocess.run(["bash", "make_submission.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "SOME PUBLIC TESTS FAIL" in out and "1/2" in out, out
    names = set(zipfile.ZipFile(repo / "submission.zip").namelist())
    assert names == set(release.TASK_FILES) | {"writeup.pdf", "benchmarks/results/memory.md"}, sorted(names)

    # A task file missing: refused with its name.
    (repo / release.TASK_FILES[3]).unlink()
    proc = subprocess.run(["bash", "make_submission.sh", "--skip-tests"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and release.TASK_FILES[3] in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_release_submission_is_graded_by_the_bundle(graded_stubs, graded_reference):
    """make_submission.sh, run inside the release, makes a zip that the autograder bundle grades: 0 with the
    stubs, full marks with the reference's task files dropped in. Both grading runs are shared ones
    (tests/staff/conftest.py: ``graded_stubs``, whose results.json goes into a world-writable sticky folder, and
    ``graded_reference``)."""
    release = _release_module()
    assert set(graded_stubs.zip_names) == set(release.TASK_FILES) | {"WRITEUP.md"}, graded_stubs.zip_names
    assert graded_stubs.results_dir_mode == 0o1777, \
        f"grading changed a shared --results folder's mode to {oct(graded_stubs.results_dir_mode)}"
    assert not graded_stubs.mode_changes, \
        f"grading changed the modes of shared folders (before, after): {graded_stubs.mode_changes}"
    data = graded_stubs.data
    # The required tests' maximum: bonus tests (tag "bonus") are reported apart from the score.
    max_score = sum(t["max_score"] for t in data["tests"] if "bonus" not in t.get("tags", []))
    assert data["tests"], f"stubs: no graded tests\n{data['output'][-3000:]}"
    assert data["score"] == 0, f"stubs: {data['score']:.2f}/{max_score:.2f}, expected 0\n{data['output'][-3000:]}"

    # The reference's task files dropped into a release and zipped by its make_submission.sh: graded once per
    # test run by tests/staff/conftest.py's graded_reference (through the bundle, on setup.sh's image).
    assert set(graded_reference.zip_names) == set(release.TASK_FILES) | {"WRITEUP.md"}, graded_reference.zip_names
    assert not graded_reference.mode_changes, \
        f"grading changed the modes of shared folders (before, after): {graded_reference.mode_changes}"
    data, log = graded_reference.data, graded_reference.stdout[-3000:]
    max_score = sum(t["max_score"] for t in data["tests"] if "bonus" not in t.get("tags", []))
    assert data["tests"], f"reference: no graded tests\n{log}"
    failed = [t["name"] for t in data["tests"] if t["score"] < t["max_score"] - 1e-6]
    # results.json's total is the sum of the tests' scores (each rounded to 4 places) rounded to 2 places,
    # so full marks equal the tests' maximum rounded the same way (not the raw sum: 69 rounded maxima).
    assert not failed and abs(data["score"] - round(max_score, 2)) < 1e-6, \
        f"reference: {data['score']:.2f}/{max_score:.2f}; not full marks: {failed[:10]}\n{log}"
