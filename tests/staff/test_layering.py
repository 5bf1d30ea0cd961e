"""The tasks are layered: Task N uses only Tasks 1..N-1 and the provided support code, so the handout's order
works and the tests of Task N need only Tasks 1..N.

- fast: no task module imports a later one (checked in a fresh interpreter, through ``sys.modules``, for the
  reference and for the stubs), and no task file imports inside a function (which would hide a circle);
- slow: in a fresh student release with the hidden tests added, the reference's Tasks 1..N dropped in and Tasks
  N+1..7 left as stubs, every public and hidden test of Task N passes, for each N.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from adapters import TASK_MODULES  # noqa: E402  (the one list of task modules)

PACKAGES = ["fsdp_assignment.reference", "fsdp_assignment"]


CHECK_IMPORTS = """
import importlib, json, sys
import torch  # imported once; the task modules are forgotten between checks
package, modules = sys.argv[1], json.loads(sys.argv[2])
out = {}
for n, name in sorted(modules.items(), key=lambda kv: int(kv[0])):
    for m in [m for m in sys.modules if m.startswith("fsdp_assignment")]:
        del sys.modules[m]
    importlib.import_module(f"{package}.{name}")
    later = [f"{package}.{modules[k]}" for k in modules if int(k) > int(n)]
    out[n] = [m for m in later if m in sys.modules]
print(json.dumps(out))
"""


@pytest.mark.parametrize("package", PACKAGES)
def test_no_task_imports_a_later_task(package):
    import json
    proc = subprocess.run([sys.executable, "-c", CHECK_IMPORTS, package, json.dumps(TASK_MODULES)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"importing the task modules of {package} failed:\n{proc.stderr[-2000:]}"
    later = {n: mods for n, mods in json.loads(proc.stdout).items() if mods}
    assert not later, f"{package}: task modules import later tasks: {later}"


@pytest.mark.parametrize("package", ["fsdp_assignment/reference", "fsdp_assignment"])
def test_no_import_inside_a_function(package):
    found = []
    for name in TASK_MODULES.values():
        path = ROOT / package / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(ROOT)}:{sub.lineno} in {node.name}()" for sub in ast.walk(node)
                          if isinstance(sub, (ast.Import, ast.ImportFrom))]
    assert not found, "imports inside functions (they hide import circles between tasks): " + ", ".join(found)


def _release_module():
    spec = importlib.util.spec_from_file_location("release", ROOT / "staff" / "release.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory):
    dest = tmp_path_factory.mktemp("layering") / "release"
    _release_module().build_release(dest, allow_stale=True, quiet=True)
    shutil.copytree(ROOT / "tests" / "hidden", dest / "tests" / "hidden")
    return dest


# Task 7's tests with Tasks 1..7 is every task implemented: the graded reference (tests/staff/conftest.py,
# graded_reference: the release's zip of the reference's task files, graded through the bundle) runs exactly that,
# so it is not run a second time here (a minute of CI).
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("n", sorted(TASK_MODULES)[:-1])
def test_task_tests_pass_with_only_the_tasks_up_to_theirs(n, release_tree, tmp_path):
    dest = tmp_path / "tree"
    shutil.copytree(release_tree, dest)
    for rel, text in _release_module().reference_task_files().items():
        if int(Path(rel).name[len("task")]) <= n:
            (dest / rel).write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(FSDP_IMPL="student", PYTHONPATH=str(dest))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", f"task{n}", "-p", "no:cacheprovider",
                           "tests/public", "tests/hidden"], cwd=dest, env=env, capture_output=True, text=True,
                          timeout=1100)
    assert proc.returncode == 0, (f"Task {n}'s tests with only Tasks 1..{n} implemented (the rest stubs): exit code "
                                  f"{proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-1000:]}")
    assert " passed" in proc.stdout, f"Task {n}: no test ran:\n{proc.stdout[-2000:]}"
