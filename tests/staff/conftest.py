"""Set-ups the staff checks share, made once per test run.

``graded_reference``: the reference graded end to end, once, the way every check of "the reference scores full
marks" wants it, so that they all read one result instead of grading it three times (each whole grading run
costs about a minute and a half on the 2-core CI machine):

- the student release is built (``staff/release.py``), the reference's task files are dropped in, and the
  release's own ``make_submission.sh`` zips them (tests/staff/test_release.py: a release's zip is graded right);
- that zip's files, next to a hostile conftest.py, pytest.ini and pyproject.toml that must be ignored
  (tests/staff/test_autograder_bundle.py), are the submission of a Gradescope layout made from the bundle
  (``build_bundle.build``);
- the layout is set up by ``setup.sh``'s real install path, a fresh virtualenv (tests/staff/test_autograder_image.py:
  the image Gradescope builds), and ``run_autograder`` grades the submission, ranks as ``nobody`` when run as root.

Each of the three tests asserts its own part on the result. Only slow tests use it (``-m "not slow"`` never
builds it); the first that runs pays for it (about 4 minutes quiet: the install and one grading run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # grading must leave their modes alone

HOSTILE_CONFTEST = """
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"   # a submission must never get to run this
"""
IGNORED_FILES = {"conftest.py": HOSTILE_CONFTEST, "tests/conftest.py": HOSTILE_CONFTEST,
                 "pytest.ini": "[pytest]\naddopts = -p no:terminal\n",
                 "pyproject.toml": "[tool.pytest.ini_options]\naddopts = '--collect-only'\n",
                 "benchmarks/results/memory.json": "{}"}


def image_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh image: none of this machine's Python, pytest or grading settings, and the
    system's PATH (a fresh image has no pyenv or conda in front)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDP_", "PYTEST_", "PYTHON", "VIRTUAL_ENV", "CONDA", "PYENV"))}
    env.update(PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **extra)
    return env


def _release_module():
    spec = importlib.util.spec_from_file_location("release", ROOT / "staff" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class GradedReference:
    root: Path                      # the Gradescope layout: source/, submission/, results/, venv/
    submitted: list[str]            # the submission's files (the release's zip and the hostile files)
    zip_names: list[str]            # what the release's make_submission.sh put in its zip
    data: dict = field(default_factory=dict)   # results.json
    stdout: str = ""
    setup_s: float = 0.0
    grade_s: float = 0.0
    mode_changes: dict = field(default_factory=dict)  # shared folders whose mode grading changed


@pytest.fixture(scope="session")
def graded_reference():
    from staff.autograder import build_bundle
    from tests.staff.test_make_submission import filled_writeup

    work = Path(tempfile.mkdtemp(prefix="fsdp-graded-reference-"))
    try:
        os.chmod(work, 0o755)  # the rank user (nobody) reads the grading tree below
        # The release's zip of the reference's task files.
        release = _release_module()
        dest = work / "release"
        release.build_release(dest, allow_stale=True, quiet=True)
        (dest / "WRITEUP.md").write_text(filled_writeup())
        release.drop_in_reference(dest)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")
               and k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "VIRTUAL_ENV", "PYTHONHOME")}
        proc = subprocess.run(["bash", "make_submission.sh", "--skip-tests", "-o", "submission-reference.zip"],
                              cwd=dest, env=dict(env, PYTHON=sys.executable), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

        # The Gradescope layout from the bundle, set up by setup.sh's real install.
        root = work / "autograder"
        (root / "source").mkdir(parents=True)
        bundle = work / "autograder.zip"
        build_bundle.build(bundle)
        with zipfile.ZipFile(bundle) as zf:
            zf.extractall(root / "source")
        for name in ("setup.sh", "run_autograder"):
            os.chmod(root / "source" / name, 0o755)
        shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # as Gradescope does
        start = time.monotonic()
        setup = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root, capture_output=True,
                               text=True, timeout=1500,
                               env=image_env(AUTOGRADER_ROOT=str(root), FSDP_AUTOGRADER_NO_USERADD="1",
                                             PIP_RETRIES="0"))
        setup_s = time.monotonic() - start
        assert setup.returncode == 0, setup.stdout[-4000:] + setup.stderr[-4000:]

        # The submission: the zip's files and the hostile ones.
        for d in ("submission", "results"):
            (root / d).mkdir()
        with zipfile.ZipFile(dest / "submission-reference.zip") as zf:
            zip_names = zf.namelist()
            zf.extractall(root / "submission")
        for rel, text in IGNORED_FILES.items():
            path = root / "submission" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        submitted = sorted(p.relative_to(root / "submission").as_posix()
                           for p in (root / "submission").rglob("*") if p.is_file())

        shared_modes = {p: os.stat(p).st_mode for p in SHARED_PLACES if os.path.isdir(p)}
        rank_user = ["--rank-user", "nobody"] if os.geteuid() == 0 else []
        start = time.monotonic()
        grade = subprocess.run([str(root / "run_autograder"), *rank_user], cwd=root, capture_output=True, text=True,
                               timeout=1500, env=image_env(AUTOGRADER_ROOT=str(root)))
        grade_s = time.monotonic() - start
        changed = {p: (oct(m), oct(os.stat(p).st_mode)) for p, m in shared_modes.items() if os.stat(p).st_mode != m}
        results = root / "results" / "results.json"
        assert results.exists(), grade.stdout[-5000:] + grade.stderr[-3000:]
        yield GradedReference(root, submitted, zip_names, json.loads(results.read_text()), grade.stdout,
                              setup_s, grade_s, changed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class GradedStubs:
    data: dict                      # results.json
    zip_names: list[str]            # what the release's make_submission.sh put in the stubs' zip
    left_out: str                   # the task file taken out of the submission (a file the student forgot)
    grade_s: float = 0.0
    results_dir_mode: int = 0       # the mode of the world-writable sticky folder results.json went to, after
    mode_changes: dict = field(default_factory=dict)  # shared folders whose mode grading changed


@pytest.fixture(scope="session")
def graded_stubs():
    """The stubs graded once through the bundle, for the two checks that want it (each whole grading run costs
    about a minute on the 2-core CI machine; they used to grade the stubs once each):

    - tests/staff/test_release.py: the release's make_submission.sh zips the stubs and the bundle grades that zip
      to 0, writing results.json into a world-writable sticky folder (like /tmp) whose mode grading must keep;
    - tests/staff/test_autograder_bundle.py: every graded test fails saying which task and function to implement,
      and the output names the task file missing from the submission (task7_fully_shard.py is taken out).

    The Gradescope layout is the bundle's, set up by setup.sh with its install step skipped (this machine's torch),
    graded by run_autograder as Gradescope runs it."""
    from staff.autograder import build_bundle
    from tests.staff.test_make_submission import filled_writeup

    left_out = "fsdp_assignment/task7_fully_shard.py"
    work = Path(tempfile.mkdtemp(prefix="fsdp-graded-stubs-"))
    try:
        release = _release_module()
        dest = work / "release"
        release.build_release(dest, allow_stale=True, quiet=True)
        (dest / "WRITEUP.md").write_text(filled_writeup())
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_")
               and k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "VIRTUAL_ENV", "PYTHONHOME")}
        proc = subprocess.run(["bash", "make_submission.sh", "--skip-tests", "-o", "submission-stubs.zip"],
                              cwd=dest, env=dict(env, PYTHON=sys.executable), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

        root = work / "autograder"
        (root / "source").mkdir(parents=True)
        bundle = work / "autograder.zip"
        build_bundle.build(bundle)
        with zipfile.ZipFile(bundle) as zf:
            zf.extractall(root / "source")
        for name in ("setup.sh", "run_autograder"):
            os.chmod(root / "source" / name, 0o755)
        shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # as Gradescope does
        setup = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root, capture_output=True, text=True,
                               timeout=120, env=dict(os.environ, AUTOGRADER_ROOT=str(root),
                                                     FSDP_AUTOGRADER_SKIP_INSTALL="1", FSDP_AUTOGRADER_NO_USERADD="1"))
        assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]

        (root / "submission").mkdir()
        with zipfile.ZipFile(dest / "submission-stubs.zip") as zf:
            zip_names = zf.namelist()
            zf.extractall(root / "submission")
        (root / "submission" / left_out).unlink()
        shared = root / "shared"  # results.json goes into a world-writable sticky folder, like /tmp
        shared.mkdir()
        shared.chmod(0o1777)
        results = shared / "results.json"
        shared_modes = {p: os.stat(p).st_mode for p in SHARED_PLACES if os.path.isdir(p)}
        grade_env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "PYTEST_"))}
        grade_env.update(AUTOGRADER_ROOT=str(root), FSDP_AUTOGRADER_PYTHON=sys.executable)
        start = time.monotonic()
        grade = subprocess.run([str(root / "run_autograder"), "--results", str(results)], cwd=root, env=grade_env,
                               capture_output=True, text=True, timeout=900)
        grade_s = time.monotonic() - start
        changed = {p: (oct(m), oct(os.stat(p).st_mode)) for p, m in shared_modes.items() if os.stat(p).st_mode != m}
        assert results.exists(), grade.stdout[-5000:] + grade.stderr[-3000:]
        yield GradedStubs(json.loads(results.read_text()), zip_names, left_out, grade_s,
                          shared.stat().st_mode & 0o7777, changed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
