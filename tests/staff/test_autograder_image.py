"""The autograder on the image its own setup.sh builds: the reference must score full marks there.

Unlike tests/staff/test_autograder_bundle.py (which skips setup.sh's install step and reuses this Python), this
test runs setup.sh's real install path: a fresh virtualenv with exactly what setup.sh installs (torch from the
CPU wheel index, pytest, pytest-timeout, numpy), then grades the reference's task files through
``run_autograder``, which picks that virtualenv's Python. It caught a missing numpy: torch does not depend on
it, but ``dist.broadcast_object_list`` (the checkpoint tests) needs it, and the reference scored 93.33.

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

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "staff" / "autograder"))
import build_bundle  # noqa: E402
import mutations  # noqa: E402
import results_schema  # noqa: E402

pytestmark = [pytest.mark.staff, pytest.mark.slow, pytest.mark.timeout(2400)]


def _total_points() -> float:
    import importlib.util
    spec = importlib.util.spec_from_file_location("_points", ROOT / "tests" / "points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.total_points()


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh image: none of this machine's Python, pytest or grading settings, and the
    system's PATH (a fresh image has no pyenv or conda in front)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDP_", "PYTEST_", "PYTHON", "VIRTUAL_ENV", "CONDA", "PYENV"))}
    env.update(PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **extra)
    return env


def test_reference_scores_full_marks_on_the_setup_sh_image():
    work = Path(tempfile.mkdtemp(prefix="fsdp-image-"))
    try:
        os.chmod(work, 0o755)
        root = work / "autograder"
        (root / "source").mkdir(parents=True)
        bundle = work / "autograder.zip"
        build_bundle.build(bundle)
        with zipfile.ZipFile(bundle) as zf:
            zf.extractall(root / "source")
        for name in ("setup.sh", "run_autograder"):
            os.chmod(root / "source" / name, 0o755)
        shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")

        start = time.monotonic()
        setup = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root, capture_output=True,
                               text=True, timeout=1500,
                               env=_clean_env(AUTOGRADER_ROOT=str(root), FSDP_AUTOGRADER_NO_USERADD="1",
                                              PIP_RETRIES="0"))
        setup_s = time.monotonic() - start
        assert setup.returncode == 0, setup.stdout[-4000:] + setup.stderr[-4000:]
        venv_python = root / "venv" / "bin" / "python"
        assert venv_python.exists(), "setup.sh must build its virtualenv in $AUTOGRADER_ROOT/venv"
        # The venv holds what setup.sh installed, not this machine's packages (no system site-packages).
        probe = subprocess.run([str(venv_python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                               capture_output=True, text=True, env=_clean_env())
        assert probe.stdout.strip() == "True", probe.stdout + probe.stderr

        for d in ("submission", "results"):
            (root / d).mkdir()
        for rel, text in mutations.reference_student_files().items():
            path = root / "submission" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        start = time.monotonic()
        rank_user = ["--rank-user", "nobody"] if os.geteuid() == 0 else []
        grade = subprocess.run([str(root / "run_autograder"), *rank_user], cwd=root, capture_output=True, text=True,
                               timeout=1500, env=_clean_env(AUTOGRADER_ROOT=str(root)))
        grade_s = time.monotonic() - start
        results = root / "results" / "results.json"
        assert results.exists(), grade.stdout[-5000:] + grade.stderr[-3000:]
        data = json.loads(results.read_text())
        assert results_schema.validate(data) == [], results_schema.validate(data)
        failed = [t["name"] + "\n" + t["output"][:1500] for t in data["tests"] if t["status"] != "passed"]
        assert not failed, "\n\n".join(failed)
        assert f"{data['score']:.2f}" == f"{_total_points():.2f}", data["score"]
        print(f"\nsetup.sh (real install) {setup_s:.0f} s; grading the reference through run_autograder "
              f"{grade_s:.0f} s; score {data['score']:.2f}; "
              + next((line for line in grade.stdout.splitlines() if line.startswith("grade: rank")
                      or line.startswith("grade: ranks")), ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
