"""The autograder on the image its own setup.sh builds: the reference must score full marks there.

Unlike tests/staff/test_autograder_bundle.py (which skips setup.sh's install step and reuses this Python), this
test runs setup.sh's real install path: a fresh virtualenv with exactly what setup.sh installs (torch from the
CPU wheel index, pytest, pytest-timeout, numpy), then grades the reference's task files through
``run_autograder``, which picks that virtualenv's Python. It caught a missing numpy: torch does not depend on
it, but ``dist.broadcast_object_list`` (the checkpoint tests) needs it, and the reference scored 93.33.

The grading run is the one tests/staff/conftest.py's ``graded_reference`` makes once per test run (the bundle's
and the release's full-marks checks read it too); this test checks the image part of it.

Slow (a pip install and a whole grading run: about 4 min quiet, 7 min at load 10 on 2 cores; measured
2026-11-22): marked ``slow``, CI runs it, ``-m "not slow"`` leaves it out. pip uses the machine's own
configuration (a local wheel mirror where there is one); PIP_RETRIES=0 so an unreachable index fails over at
once instead of retrying for minutes. setup.sh creates no user here (FSDP_AUTOGRADER_NO_USERADD=1: not on a
staff machine), so the ranks run as ``nobody`` in its place (``--rank-user nobody``): as on Gradescope, every
rank body runs unprivileged, and the grader reaps that user's processes and files after each test (so run it
where nothing else runs as ``nobody``). PATH is the system's, so that setup.sh builds its virtualenv from a Python
that user can read (a pyenv under /root cannot be); if it cannot, ranks run as root and the output says so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from staff.autograder import results_schema
from tests.staff.conftest import image_env  # noqa: E402

pytestmark = [pytest.mark.staff, pytest.mark.slow, pytest.mark.timeout(2400)]


def _total_points() -> float:
    import importlib.util
    spec = importlib.util.spec_from_file_location("_points", ROOT / "tests" / "points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.total_points()


def test_reference_scores_full_marks_on_the_setup_sh_image(graded_reference):
    root = graded_reference.root
    venv_python = root / "venv" / "bin" / "python"
    assert venv_python.exists(), "setup.sh must build its virtualenv in $AUTOGRADER_ROOT/venv"
    # The venv holds what setup.sh installed, not this machine's packages (no system site-packages).
    probe = subprocess.run([str(venv_python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                           capture_output=True, text=True, env=image_env())
    assert probe.stdout.strip() == "True", probe.stdout + probe.stderr
    data = graded_reference.data
    assert results_schema.validate(data) == [], results_schema.validate(data)
    failed = [t["name"] + "\n" + t["output"][:1500] for t in data["tests"] if t["status"] != "passed"]
    assert not failed, "\n\n".join(failed)
    assert f"{data['score']:.2f}" == f"{_total_points():.2f}", data["score"]
    print(f"\nsetup.sh (real install) {graded_reference.setup_s:.0f} s; grading the reference through "
          f"run_autograder {graded_reference.grade_s:.0f} s; score {data['score']:.2f}; "
          + next((line for line in graded_reference.stdout.splitlines() if line.startswith("grade: rank")
                  or line.startswith("grade: ranks")), ""))
