"""Shared pytest set-up: the repo root on sys.path, the `backend` fixture, and a guard that keeps
implementation code out of the pytest process.

Test modules import the harness and the seam like this, and call `adapters` only inside rank bodies:

    from tests.harness import run_ranks, RankFailure
    import adapters                                   # cheap: it imports an implementation only when called

    def _body(rank, world_size):
        ...adapters.fully_shard(...)...              # student code runs here, in a rank process

    @pytest.mark.task7
    @pytest.mark.parametrize("world_size", [1, 2, 3, 4])
    def test_something(backend, world_size):         # runs on gloo, and on nccl where there are >= W GPUs
        run_ranks(_body, world_size, backend=backend)

The markers task1..task7 and staff are declared in pyproject.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The repo root: `adapters`, `fsdp_assignment.support` and `tests.harness` import from here, in the pytest
# process and (sys.path travels with every rank) in the ranks.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.harness import require_backend  # noqa: E402

BACKENDS = ["gloo", "nccl"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each test that takes `backend` runs once per backend; nccl is skipped, with the reason, unless there
    are enough GPUs: as many as the test's `world_size` parameter when it has one (run_ranks checks again)."""
    if request.param == "nccl":
        world_size = request.getfixturevalue("world_size") if "world_size" in request.fixturenames else 1
        require_backend("nccl", world_size)
    return request.param


# ---- The pytest process never imports implementation code --------------------------------------------------
# The process that decides pass or fail must not run student code (a submission could patch what decides).
# Any test that imports implementation code (a task module) into this process fails, naming the module.
# Staff tooling checks (marker `staff`, not in the student release) may import them.
IMPLEMENTATION_PREFIXES = ("fsdp_assignment.task", "fsdp_assignment.reference")


def _implementation_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith(IMPLEMENTATION_PREFIXES)}


@pytest.fixture(autouse=True)
def _no_implementation_in_pytest_process(request):
    before = _implementation_modules()
    yield
    imported = sorted(_implementation_modules() - before)
    if imported and request.node.get_closest_marker("staff") is None:
        pytest.fail(f"this test imported implementation code into the pytest process: {', '.join(imported)}. "
                    f"Call adapters only inside a rank body (tests.harness.run_ranks).", pytrace=False)


# ---- Every failure names its task -----------------------------------------------------------------------------
from tests.points import TASK_TITLES  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for marker in item.iter_markers():
        if marker.name.startswith("task") and marker.name[4:].isdigit():
            n = int(marker.name[4:])
            report.sections.append((f"Task {n}", (
                f"This is a Task {n} ({TASK_TITLES.get(n, '?')}) test: run them alone with `python -m pytest -m task{n}`. "
                f"Tests of a task use only that task and the tasks before it (Task 2's also check Task 1's "
                f"meta-device init of sharded units), so a NotImplementedError naming an earlier task means: "
                f"finish that one first.")))
            break
