"""The grading plugin's bonus: tests marked ``bonus(name)`` share BONUS_POINTS by weight and are reported apart
from the required total (results.json's score), on the same tiny fake tree as test_grading_plugin.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.staff.test_grading_plugin import _by_name, _run, tree  # noqa: F401  (tree is a fixture)

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]

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


# ---- HSDP: the byte check counts parameter traffic only (issue 36) --------------------------------------------
def _hsdp_calls(padded: dict, R: int, K: int, *, norm=None, gather_twice=False, all_reduce_grads=False):
    """What a correct HSDP implementation's counted collectives are in test_bonus_hsdp's three steps (forward and
    backward all-gather of each unit's shard, its reduce-scatter, the replicas' all-reduce), plus ``norm``: the
    clip_grad_norm_ collective of each step, ("all_gather", 1) or ("all_reduce", 1)."""
    from tests.public.test_bonus_hsdp import STEPS
    calls = []
    for _ in range(STEPS):
        for n in padded.values():
            for _ in range(2 if gather_twice else 1):  # forward
                calls.append(dict(kind="all_gather", numel=n // K, group_size=K))
            calls.append(dict(kind="all_gather", numel=n // K, group_size=K))  # backward
            if all_reduce_grads:  # the full gradient all-reduced, then sliced: no reduce-scatter
                calls.append(dict(kind="all_reduce", numel=n, group_size=K))
            else:
                calls.append(dict(kind="reduce_scatter", numel=n, group_size=K))
            if R > 1:
                calls.append(dict(kind="all_reduce", numel=n // K, group_size=R))
        if norm is not None:
            calls.append(dict(kind=norm[0], numel=norm[1], group_size=K))
    return calls


def test_the_hsdp_byte_check_counts_parameter_traffic_only():
    """A clip_grad_norm_ that all-gathers one number per rank (every rank then sums the same numbers in the same
    order) is as correct as one that all-reduces the sum of squares: neither is parameter traffic, and the check
    passes both (it failed the all-gather: "all-gather bytes per step 231348; the formula ... gives 231344"). It
    still fails the parameter-traffic bugs: parameters gathered twice, gradients all-reduced instead of
    reduce-scattered. (Cheap: the parent's check on the counted calls, no ranks.)"""
    from tests.public.test_bonus_hsdp import SMALL_COLLECTIVE_NUMEL, _check_communication
    handout = " ".join((ROOT / "handout" / "bonus.typ").read_text().split())
    assert (f"parameter traffic only: a collective to which each rank contributes at most {SMALL_COLLECTIVE_NUMEL} "
            f"elements") in handout, "handout/bonus.typ must state the rule with the test's number"
    padded = {"blocks.0.": 17824, "blocks.1.": 17824, "blocks.2.": 17824, "": 4372}
    for R, K in ((2, 2), (4, 1), (1, 4)):
        where = f"mesh ({R}, {K})"
        for norm in (None, ("all_reduce", 1), ("all_gather", 1), ("all_gather", SMALL_COLLECTIVE_NUMEL)):
            _check_communication(_hsdp_calls(padded, R, K, norm=norm), padded, R, K, where)
        if K > 1:  # (K = 1: an all-gather of one rank sends nothing)
            with pytest.raises(AssertionError, match="all-gather bytes per step .* not parameter traffic"):
                _check_communication(_hsdp_calls(padded, R, K, gather_twice=True), padded, R, K, where)
            with pytest.raises(AssertionError, match="reduce-scatters of .* elements"):
                _check_communication(_hsdp_calls(padded, R, K, all_reduce_grads=True), padded, R, K, where)
            # A norm's collective is small; one of more than SMALL_COLLECTIVE_NUMEL per rank is counted.
            with pytest.raises(AssertionError, match="all-gather bytes per step"):
                _check_communication(_hsdp_calls(padded, R, K, norm=("all_gather", SMALL_COLLECTIVE_NUMEL + 1)),
                                     padded, R, K, where)


# The reference's clip_grad_norm_ with its one all-reduce of the sum of squares replaced by an all-gather of one
# number per rank (a staff fixture: a correct design the HSDP tests failed), and a real parameter-traffic bug: every
# unit's shard all-gathered twice in unshard (Task 3), values unchanged.
NORM_ALL_REDUCE = "    dist.all_reduce(local_sq, group=groups[0] if groups else None)\n"
NORM_ONE_NUMBER_PER_RANK = """    group = groups[0] if groups else None
    # One number per rank, all-gathered: every rank then sums the same numbers in the same order.
    parts = [torch.empty(1, dtype=local_sq.dtype, device=local_sq.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_sq.reshape(1), group=group)
    local_sq = torch.cat(parts).sum()
"""
GATHER = "    work = _all_gather_single(flat_param.unsharded.data, shard, group, async_op)\n"
GATHER_TWICE = "    _all_gather_single(flat_param.unsharded.data, shard, group, False)\n" + GATHER
HSDP_TESTS = ["test_hsdp_2x2_trains_like_one_process_and_fsdp2", "test_hsdp_degenerate_meshes_4x1_and_1x4"]


def _edited(files: dict, task_file: str, old: str, new: str) -> dict:
    rel = f"fsdp_assignment/{task_file}"
    assert files[rel].count(old) == 1, f"the reference's {task_file} changed: update this fixture ({old.strip()!r})"
    return {**files, rel: files[rel].replace(old, new)}


@pytest.mark.slow  # two gradings of the HSDP tests through grade.py: about 40 s quiet
@pytest.mark.timeout(900)
def test_a_norm_that_all_gathers_one_number_per_rank_scores_the_hsdp_bonus(tmp_path):
    """Graded as a submission (the mutants' path, grade.py on a staged bundle): the reference with the one-number
    all-gather norm passes both HSDP tests (it failed both: "all-gather bytes per step 231348; the formula ...
    gives 231344"), and the reference gathering every shard twice fails the 2x2 test on its bytes (the kernel's
    witness at the sockets sees it first since issue 35)."""
    from staff.grader_selftest.mutant_grading import grade_mutant, reference_student_files, select_args
    files = reference_student_files()
    norm = _edited(files, "task5_optim_ckpt.py", NORM_ALL_REDUCE, NORM_ONE_NUMBER_PER_RANK)
    verdict = grade_mutant(norm, tmp_path, "norm-all-gather", select_args(HSDP_TESTS), timeout=600, timeout_cap=240)
    assert not verdict.killed and verdict.tests == 2, (verdict.killer, verdict.detail)
    twice = _edited(files, "task3_forward.py", GATHER, GATHER_TWICE)
    verdict = grade_mutant(twice, tmp_path, "gather-twice", select_args(HSDP_TESTS[:1]), timeout=600, timeout_cap=240)
    assert verdict.killed and HSDP_TESTS[0] in verdict.killer, (verdict.killer, verdict.detail)
    # on its bytes: the kernel's count at the sockets (the test's witness, which judges first) or the counted
    # all-gathers' bytes
    assert "bytes written to the rank's sockets" in verdict.detail or "all-gather bytes per step" in verdict.detail, \
        verdict.detail
