"""regenerate.py --from, the TA's calculator, on results folders doctored to the cases the threshold rules cover.

Each case copies the staff run's results (staff/answer_key/results/) into a temporary folder and edits its JSON;
no benchmark runs. The rules are the handout's (Models box, item 4) and the key's: an interval that straddles a
threshold is "undecided at this precision"; alpha unresolved or <= 0: alpha = 0 and alpha_bound as an upper bound;
beta <= 0 (the fit's slope): no beta, no N_1/2, no W*.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.staff

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "staff" / "answer_key" / "results"


@pytest.fixture(scope="module")
def regenerate():
    spec = importlib.util.spec_from_file_location("_regenerate_rules", ROOT / "staff" / "answer_key" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doctored(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the staff results with ``edit(jsons)`` applied to its parsed JSON files."""
    folder = tmp_path / name
    folder.mkdir()
    data = {}
    for n in ("memory", "comm", "step", "scaling"):
        data[n] = json.loads((RESULTS / f"{n}.json").read_text())
    edit(data)
    for n, d in data.items():
        (folder / f"{n}.json").write_text(json.dumps(d))
    return folder


def sections(text: str) -> dict[str, str]:
    """--from's output, per question."""
    parts = re.split(r"^(Q\d+)$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def every_question_concludes(regenerate, text: str) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("_points_rules", ROOT / "tests" / "points.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    by_q = sections(text)
    assert set(by_q) == set(mod.WRITEUP_QUESTION_POINTS), sorted(by_q)
    for q, body in by_q.items():
        assert "EXPECTED CONCLUSION" in body, f"{q}: --from prints no expected conclusion"
        assert "n/a" not in body.split("EXPECTED CONCLUSION")[-1].splitlines()[0], (q, body)
    return by_q


def fits(d: dict, w: int | None = None):
    return [f for f in d["comm"]["alpha_beta"] if f["kind"] == "all_gather" and (w is None or f["world_size"] == w)]


def test_alpha_unresolved(regenerate, tmp_path):
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["alpha_resolved"] = False
            f["alpha_bound_s"] = f["alpha_s"] + 2 * f["alpha_se_s"]
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "unresolved", edit)))
    assert "alpha not resolved: N_1/2 < W alpha_bound beta / b" in q["Q10"]
    assert re.search(r"\(c\) at W = \d.*(bandwidth-bound: Psi_blk is above the bound|undecided at this precision: "
                     r"alpha is not resolved)", q["Q10"])
    assert "alpha = 0 for the value, alpha_bound for the range" in q["Q14"]
    assert "alpha not resolved (or <= 0): only the upper bound" in q["Q13"]


def test_alpha_not_positive(regenerate, tmp_path):
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["alpha_s"], f["alpha_resolved"] = -abs(f["alpha_se_s"]), False
            f["alpha_bound_s"] = 2 * f["alpha_se_s"]
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "negative", edit)))
    assert "alpha not resolved (<= 0)" in q["Q10"]
    assert "not resolved and <= 0" in q["Q14"] and "W* = " in q["Q14"]
    assert "EXPECTED CONCLUSION (c) W = 2 against W*" in q["Q14"]


def test_beta_not_positive(regenerate, tmp_path):
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["beta_bytes_per_s"], f["b_s_per_byte"], f["beta_rel_se"] = math.inf, -1e-12, math.nan
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "beta", edit)))
    assert "no N_1/2" in q["Q10"] and "undecided on this machine: no beta" in q["Q10"]
    assert "no beta to compare" in q["Q10"]
    assert "no W*: the fit has no beta" in q["Q14"] and "undecided on this machine: no W* to compare" in q["Q14"]


def test_a_ratio_interval_straddling_one(regenerate, tmp_path):
    def edit(d):
        r = next(r for r in d["step"]["ratios"] if r["comparison"] == "FSDP + prefetch / FSDP step time"
                 and r["interconnect"].startswith("gloo"))
        r["per_round"], r["median"] = [0.9, 0.95, 1.1, 0.93, 1.02], 0.95
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "ratio", edit)))
    line = next(x for x in q["Q11"].splitlines() if "EXPECTED CONCLUSION (a) gloo" in x)
    assert "undecided at this precision (the interval contains 1); the point estimate is on the faster side" in line


def test_an_n_half_interval_straddling_the_block(regenerate, tmp_path):
    def edit(d):
        f = fits(d, 2)[0]
        blk = 463_540
        f["alpha_s"] = blk * 4 / (2 * f["beta_bytes_per_s"])  # N_1/2 = Psi_blk exactly, at the point estimate
        f["alpha_se_s"], f["alpha_resolved"] = f["alpha_s"] / 4, True
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "nhalf", edit)))
    line = next(x for x in q["Q10"].splitlines() if "EXPECTED CONCLUSION (c) at W = 2" in x)
    assert "undecided at this precision: Psi_blk is inside N_1/2's range" in line, line


def test_the_staff_run_has_a_straddling_n_half_at_w4_and_says_so(regenerate):
    q = every_question_concludes(regenerate, regenerate.expected_answers(RESULTS))
    line = next(x for x in q["Q10"].splitlines() if "EXPECTED CONCLUSION (c) at W = 4" in x)
    lo, hi = regenerate.n_half_interval(fits({"comm": json.loads((RESULTS / "comm.json").read_text())}, 4)[0], 4)
    if lo <= 463_540 <= hi:
        assert "undecided at this precision" in line, line


def test_the_median_over_an_even_number_of_ranks_is_the_mean_of_the_middle_two(regenerate, tmp_path):
    """Q11(b): two ranks at 31% and 45% have the median 38% (statistics.median, as the table prints it), not the upper
    rank's; the profiled step lengths likewise."""
    def edit(d):
        r = next(r for r in d["step"]["results"] if r["strategy"] == "FSDP" and r["interconnect"].startswith("gloo"))
        r["exposed"] = [dict(r["exposed"][0], exposed_comm_fraction=0.31, profiled_step_ms=300.0),
                        dict(r["exposed"][0], exposed_comm_fraction=0.45, profiled_step_ms=400.0)]
    v = regenerate.values(doctored(tmp_path, "median", edit)).flat()
    assert v["q11_exposed_nopf_real_w2"].startswith("0.38 (0.31 to 0.45); profiled step 350 ms"), v["q11_exposed_nopf_real_w2"]


def test_the_dominant_term_comes_from_the_branch_that_sets_the_peak(regenerate):
    """Q9(b): the model is max(12 S + A + 4 (U_p + U_g), 16 S + 4 U_end); its dominant term is read in the branch
    that sets the peak. The staff run's W = 4 peak is the start of backward: 12 S, not 16 S (the other branch's)."""
    memory = json.loads((RESULTS / "memory.json").read_text())
    model = next(r for r in memory["results"] if r["strategy"] == "FSDP" and r["world_size"] == 4)["model"]
    top, branch, terms = regenerate.dominant_term(model)
    assert model["at_backward_start"] > model["at_backward_end"]
    assert (top, branch) == ("12 S (parameters + AdamW)", "start-of-backward"), (top, branch)
    end_sets_it = dict(model, at_backward_end=model["at_backward_start"] + 1)
    top, branch, terms = regenerate.dominant_term(end_sets_it)
    assert branch == "end-of-backward" and top == "16 S (model states)" and set(terms) == {"16 S (model states)", "4 U_end"}
    v = regenerate.values(RESULTS).flat()
    assert v["q9_dominant"].startswith("12 S") and "start-of-backward" in v["q9_dominant"]


def test_the_model_error_range_leaves_torchs_fsdp2_row_out(regenerate):
    memory = json.loads((RESULTS / "memory.json").read_text())
    own = [100 * r["model_error"] for r in memory["results"] if regenerate.students_row(r["strategy"])]
    assert not any(regenerate.students_row(s) for s in ("FSDP2 (torch)", "DDP (torch)", "one process"))
    assert regenerate.values(RESULTS).flat()["q9_err_range"] == f"{min(own):+.1f}% to {max(own):+.1f}%"
