"""The points table: how many points each task is worth, and how a task's points split over its tests.

This is the one place where points live. The autograder reads it, the handout prints it, and you can read it
here: every test carries a task (its marker, ``task1`` .. ``task7``), a weight (``@pytest.mark.weight(n)``,
1 when absent) and a visibility (public tests, under ``tests/public/``, are visible with their output right
away; hidden tests, run only by the autograder, show theirs once grades are published). A task's points are
split over its tests in proportion to their weights:

    points of a test = TASK_POINTS[task] * weight / (sum of the weights of that task's tests)

Tests run on gloo (CPU). Variants parametrized by ``backend="nccl"`` need GPUs; the autograder has none, so
they are not graded. The bonus is graded by the course staff from your writeup, not by the autograder.
"""

from __future__ import annotations

TASK_POINTS: dict[int, int] = {1: 10, 2: 15, 3: 15, 4: 20, 5: 15, 6: 15, 7: 10}
BONUS_POINTS: int = 10

TASK_TITLES: dict[int, str] = {1: "meta-device init", 2: "FlatParameter", 3: "forward", 4: "backward",
                               5: "sharded optimizer and checkpoints", 6: "prefetching", 7: "fully_shard"}

# The shape the handout's build reads (staff/build_handout.py, POINTS_SOURCES): string keys, as JSON has them.
TABLE: dict = {"tasks": {str(k): v for k, v in TASK_POINTS.items()}, "bonus": BONUS_POINTS}

DEFAULT_WEIGHT = 1.0


def total_points() -> int:
    """What the autograder's tests are worth together (the bonus apart)."""
    return sum(TASK_POINTS.values())
