"""The points table: how many points each task is worth, and how a task's points split over its tests.

This is the one place where points live. The autograder reads it, the handout prints it, and you can read it
here: every test carries a task (its marker, ``task1`` .. ``task7``), a weight (``@pytest.mark.weight(n)``,
1 when absent) and a visibility (public tests, under ``tests/public/``, are visible with their output right
away; hidden tests, run only by the autograder, show theirs once grades are published). A task's points are
split over its tests in proportion to their weights:

    points of a test = TASK_POINTS[task] * weight / (sum of the weights of that task's tests)

Tests run on gloo (CPU). Variants parametrized by ``backend="nccl"`` need GPUs; the autograder has none, so
they are not graded. The writeup (``WRITEUP_QUESTION_POINTS``, ``WRITEUP_TABLE_POINTS``) is graded by the course
staff, not by the autograder.

The bonus is graded by the autograder, apart from the 100: ``BONUS_POINTS`` are split over the bonus tests
(marker ``@pytest.mark.bonus("hsdp")`` or ``("cpu_offload")``, no task marker) in proportion to their weights,
as a task's points are over its tests (HSDP: 6 points, CPU offload: 4, from the weights in
``tests/public/test_bonus_*.py``).
"""

from __future__ import annotations

TASK_POINTS: dict[int, int] = {1: 10, 2: 15, 3: 15, 4: 20, 5: 15, 6: 15, 7: 10}
BONUS_POINTS: int = 10

TASK_TITLES: dict[int, str] = {1: "meta-device init", 2: "FlatParameter", 3: "forward", 4: "backward",
                               5: "sharded optimizer and checkpoints", 6: "prefetching", 7: "fully_shard"}

# The writeup, graded by the course staff (not by the autograder): points per question of WRITEUP_TEMPLATE.md
# ("Q7", as make_submission.sh names them) and per benchmark table (by its section heading). The template prints
# each question's points and its "Deliverable:" line; tests/staff/test_handout.py checks that both agree with this
# table, and the staff answer key (staff/answer_key/) gives full, partial and no credit for each.
WRITEUP_QUESTION_POINTS: dict[str, int] = {
    "Q1": 2, "Q2": 3, "Q3": 3, "Q4": 2, "Q5": 2, "Q6": 2, "Q7": 2, "Q8": 3, "Q9": 5, "Q10": 4, "Q11": 4, "Q12": 4,
    "Q13": 5, "Q14": 4, "Q15": 7,
}
WRITEUP_TABLE_POINTS: dict[str, int] = {
    "Memory benchmark": 2, "Communication benchmark": 2, "Step time and prefetching": 2, "Scaling": 2,
}

# The shape the handout's build reads (staff/build_handout.py, POINTS_SOURCES): string keys, as JSON has them.
TABLE: dict = {"tasks": {str(k): v for k, v in TASK_POINTS.items()}, "bonus": BONUS_POINTS,
               "writeup": {"questions": WRITEUP_QUESTION_POINTS, "tables": WRITEUP_TABLE_POINTS}}

DEFAULT_WEIGHT = 1.0


def total_points() -> int:
    """What the autograder's tests are worth together (the writeup and the bonus apart)."""
    return sum(TASK_POINTS.values())


def writeup_points() -> int:
    """What the writeup is worth (questions and benchmark tables; graded by the staff)."""
    return sum(WRITEUP_QUESTION_POINTS.values()) + sum(WRITEUP_TABLE_POINTS.values())
