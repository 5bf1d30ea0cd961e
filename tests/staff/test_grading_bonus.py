"""The grading plugin's bonus: tests marked ``bonus(name)`` share BONUS_POINTS by weight and are reported apart
from the required total (results.json's score), on the same tiny fake tree as test_grading_plugin.py."""

from __future__ import annotations

import pytest

from tests.staff.test_grading_plugin import _by_name, _run, tree  # noqa: F401  (tree is a fixture)

pytestmark = pytest.mark.staff

BONUS = '''
import pytest

pytestmark = pytest.mark.bonus("hsdp")


@pytest.mark.weight(3)
def test_bonus_pass():
    pass


@pytest.mark.weight(2)
def test_bonus_fail():
    raise NotImplementedError("Bonus (HSDP): fully_shard(mesh=<2-D DeviceMesh>) is not implemented")


@pytest.mark.parametrize("backend", ["nccl"])
def test_bonus_gpu_only(backend):
    pass
'''


def test_bonus_points_are_reported_apart_from_the_total(tree):  # noqa: F811
    (tree / "tests" / "public" / "test_bonus.py").write_text(BONUS)
    (tree / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["task1: one", "task2: two", '
                                         '"bonus(name): b"]\n')
    data = _run(tree)
    tests = _by_name(data)
    assert "test_bonus_gpu_only[nccl]" not in tests, "an NCCL bonus variant must not be graded (no GPU)"
    # POINTS in test_grading_plugin.py: BONUS_POINTS = 5, split 3 : 2 by weight.
    assert tests["test_bonus_pass"]["max_score"] == pytest.approx(3.0)
    assert tests["test_bonus_fail"]["max_score"] == pytest.approx(2.0)
    assert tests["test_bonus_pass"]["status"] == "passed" and tests["test_bonus_fail"]["score"] == 0
    assert tests["test_bonus_pass"]["tags"] == ["bonus", "hsdp"]
    assert tests["test_bonus_pass"]["name"].startswith("Bonus (hsdp) public:")
    assert "Bonus (HSDP): fully_shard(mesh=" in tests["test_bonus_fail"]["output"]
    # The required score is what it is without the bonus tests (test_points_outcomes_and_visibility).
    assert data["score"] == pytest.approx(2 * 10 / 6 + 6, abs=0.01)
    assert data["extra_data"]["bonus"] == {"score": 3.0, "max_score": 5.0}
    assert "bonus (apart from the total)" in data["output"] and "1 of 2 bonus tests passed" in data["output"]
    numbers = [t["number"] for t in data["tests"]]
    assert all(n.startswith("3.") for n in (tests["test_bonus_pass"]["number"], tests["test_bonus_fail"]["number"]))
    assert numbers == sorted(numbers, key=lambda n: [int(x) for x in n.split(".")])
