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
    assert "alpha not resolved: N_1/2 < W alpha_bound (beta + 2 SE) / b" in q["Q10"]
    # an upper bound needs beta's upper end: with the point beta it would not bound N_1/2 (issue 37)
    folder = tmp_path / "unresolved"
    f2 = fits(json.loads(json.dumps({"comm": json.loads((folder / "comm.json").read_text())})), 2)[0]
    lo, hi = regenerate.n_half_interval(f2, 2)
    assert lo == 0 and hi == pytest.approx(2 * f2["alpha_bound_s"] * regenerate.beta_range(f2, f2["beta_bytes_per_s"])[1] / 4)
    assert hi > 2 * f2["alpha_bound_s"] * f2["beta_bytes_per_s"] / 4
    assert re.search(r"\(b\) at W = 2.*(bandwidth-bound: Psi_blk is above the bound|undecided at this precision: "
                     r"alpha is not resolved)", q["Q10"])
    assert "alpha = 0 for the value, alpha_bound for the range" in q["Q14"]


def test_alpha_not_positive(regenerate, tmp_path):
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["alpha_s"], f["alpha_resolved"] = -abs(f["alpha_se_s"]), False
            f["alpha_bound_s"] = 2 * f["alpha_se_s"]
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "negative", edit)))
    assert "alpha not resolved (<= 0)" in q["Q10"]
    assert "not resolved and <= 0" in q["Q14"] and "W* = " in q["Q14"]
    assert "EXPECTED CONCLUSION (b) W = 2 against W*" in q["Q14"]


def test_beta_not_positive(regenerate, tmp_path):
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["beta_bytes_per_s"], f["b_s_per_byte"], f["beta_rel_se"] = math.inf, -1e-12, math.nan
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "beta", edit)))
    assert "no N_1/2" in q["Q10"] and "undecided on this machine: no beta" in q["Q10"]
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
    line = next(x for x in q["Q10"].splitlines() if "EXPECTED CONCLUSION (b) at W = 2" in x)
    assert "undecided at this precision: Psi_blk is inside N_1/2's range" in line, line


def test_the_staff_runs_q10b_follows_the_rule_at_w2_only(regenerate):
    """Writeup v5's Q10 (b) asks W = 2 only (v4's (c) asked W = 2 and 4): the printout concludes once, at W = 2, by
    the rule on the staff fit's N_1/2 range, and quotes nothing of W = 4 (no fit, no bus bandwidth: not asked)."""
    q = every_question_concludes(regenerate, regenerate.expected_answers(RESULTS))
    lines = [x for x in q["Q10"].splitlines() if "EXPECTED CONCLUSION" in x]
    assert len(lines) == 1 and "EXPECTED CONCLUSION (b) at W = 2" in lines[0], lines
    assert "W = 4" not in q["Q10"] and "bus bandwidth" not in q["Q10"] and "busbw" not in q["Q10"], q["Q10"]
    lo, hi = regenerate.n_half_interval(fits({"comm": json.loads((RESULTS / "comm.json").read_text())}, 2)[0], 2)
    blk = int(regenerate.values(RESULTS).flat()["q10_blk"].split()[0].replace(",", ""))
    expected = ("bandwidth-bound" if blk > hi else "latency-bound" if blk < lo else "undecided at this precision")
    assert lines[0].split(": ", 1)[1].startswith(expected), (lo, hi, blk, lines[0])


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
    """Q9 (a): the model is max(12 S + A + 4 (U_p + U_g), 16 S + 4 U_end); its dominant term is read in the branch
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


# ---- issue 37: the rules the template, the key and the tool state the same way --------------------------------
TEMPLATE = ROOT / "WRITEUP_TEMPLATE.md"
SOURCE = ROOT / "staff" / "answer_key" / "key_source.md"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_q14d_with_no_w_star_is_undecided_in_template_key_and_tool(regenerate, tmp_path):
    """M2: alpha unresolved and c <= T_comp: no W*, and the efficiency comparison (v5's Q14 (b), v4's (d)) is
    "undecided on this machine" in all three: the one name for what the fit cannot give (issue 41: the tool said
    agree or do not agree, then "undecided at this precision" for the same case)."""
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["alpha_resolved"] = False
            f["alpha_bound_s"] = f["alpha_s"] + 2 * f["alpha_se_s"]
            f["beta_bytes_per_s"] *= 1000  # c = 3 Psi b / beta falls far below T_comp
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "nowstar", edit)))
    assert "W* = none (c <= T_comp" in q["Q14"], q["Q14"]
    line = next(x for x in q["Q14"].splitlines() if "EXPECTED CONCLUSION (b) the efficiency" in x)
    assert line.split("EXPECTED CONCLUSION")[1].split(": ", 1)[1].startswith("undecided on this machine: there is no W*"), line
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    assert ("with no W*, or where β − 2 SE ≤ 0 (the model's range then runs down to 0 and cannot disagree), the "
            "comparison is undecided on this machine") in template
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    assert ("With no W* (no β, or α not resolved and c <= T_comp), or where β - 2 SE <= 0 (the model's range then runs "
            "down to 0 and cannot disagree), the comparison is undecided on this machine") in key
    for text in (template, key):  # one name: the case never goes by the interval rule's name
        assert "no W* (β n/a, or α not resolved and c ≤ T_comp), (d) is undecided at this precision" not in text
        assert "the part is undecided at this precision" not in text


def test_q9a_the_other_branchs_term_does_not_count_in_template_key_and_tool(regenerate):
    """M4: the template says the other branch's terms do not add to the peak; the key's prose and the tool's
    conclusion say such a term does not count, argued or not (last round's blocker)."""
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    assert "(the other branch's terms do not add to it)" in template
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    assert "A term of the other branch does not count, argued or not" in key
    conclusion = regenerate.values(RESULTS).flat()["q9_a_conclusion"]
    assert "a term of the other branch does not count" in conclusion, conclusion
    for text in (key, conclusion, _flat((ROOT / "staff" / "answer_key" / "ANSWER_KEY.md").read_text())):
        assert "or the other branch's, earns" not in text


def _results_zip(path: Path, prefix: str = "") -> Path:
    import zipfile
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(prefix + "fsdp_assignment/task1_meta_init.py", "# a task file\n")
        zf.writestr(prefix + "WRITEUP.md", "# writeup\n")
        for n in ("memory", "comm", "step", "scaling"):
            zf.write(RESULTS / f"{n}.json", prefix + f"benchmarks/results/{n}.json")
    return path


def test_from_a_submission_zip_or_root_finds_benchmarks_results(regenerate, tmp_path, capsys):
    """M5: --from given the submission zip, or the unpacked submission's root, reads its benchmarks/results/ (it
    used to print n/a for everything and exit 0)."""
    expected = regenerate.expected_answers(RESULTS).split("\n", 1)[1]
    root = tmp_path / "submission"
    (root / "benchmarks" / "results").mkdir(parents=True)
    for n in ("memory", "comm", "step", "scaling"):
        shutil.copy(RESULTS / f"{n}.json", root / "benchmarks" / "results" / f"{n}.json")
    for source in (_results_zip(tmp_path / "submission.zip"), root,
                   _results_zip(tmp_path / "nested.zip", prefix="alice/")):
        assert regenerate.main(["--from", str(source)]) == 0
        out = capsys.readouterr().out
        assert "n/a (memory.json: no FSDP row)" not in out, source
        assert out.split("\n", 1)[1].rstrip("\n") == expected, f"--from {source} differs from --from the results folder"


def test_from_a_folder_or_zip_without_results_refuses(regenerate, tmp_path):
    import zipfile
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as err:
        regenerate.main(["--from", str(empty)])
    assert "no benchmark results there" in str(err.value) and "submission zip" in str(err.value)
    bare = tmp_path / "bare.zip"
    with zipfile.ZipFile(bare, "w") as zf:
        zf.writestr("WRITEUP.md", "# writeup\n")
    with pytest.raises(SystemExit) as err:
        regenerate.main(["--from", str(bare)])
    assert "the zip holds no benchmark results" in str(err.value)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as err:
        regenerate.main(["--from", str(tmp_path / "notes.txt")])
    assert "not a folder and not a zip" in str(err.value)


def test_straddling_conclusions_name_the_side_in_one_readable_sentence(regenerate, tmp_path):
    """The garbled "the point estimate is on the W* above 2: compute limits ... side": the side has a short name."""
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["beta_rel_se"] = 0.45  # a wide beta range: W*'s range straddles 2
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "straddle", edit)))
    line = next(x for x in q["Q14"].splitlines() if "EXPECTED CONCLUSION (b) W = 2 against W*" in x)
    assert "side" not in line or re.search(r"on the (compute|communication)-limited side", line), line
    for text in q.values():
        assert not re.search(r"on the W\* (above|below) 2", text), text


def test_beta_minus_two_se_not_positive_is_said(regenerate, tmp_path):
    """beta - 2 SE <= 0: N_1/2's lowest is 0 and W*'s range starts at W = 1; the tool says so instead of using
    0 and 1 silently."""
    def edit(d):
        for f in d["comm"]["alpha_beta"]:
            f["beta_rel_se"] = 0.6
    q = every_question_concludes(regenerate, regenerate.expected_answers(doctored(tmp_path, "wide", edit)))
    assert "beta - 2 SE <= 0" in q["Q14"] and "low end is W = 1" in q["Q14"], q["Q14"]
    # the efficiency comparison cannot fail there (the model's range runs down to 0): undecided on this machine, as
    # the template's Q14 (b) says (the tool said "they agree" whatever was measured)
    line = next(x for x in q["Q14"].splitlines() if "EXPECTED CONCLUSION (b) the efficiency" in x)
    assert "undecided on this machine" in line and "they agree (the ranges overlap)" not in line, line
    resolved_alpha = [f for f in fits({"comm": json.loads((tmp_path / "wide" / "comm.json").read_text())})
                      if f["alpha_resolved"] and f["alpha_s"] > 0]
    if resolved_alpha:
        assert "beta - 2 SE <= 0: the range has no lower bound" in q["Q10"], q["Q10"]


def test_psi_blk_is_the_block_unit_not_psi_over_n_layer(regenerate):
    """Q10 (b): the key's Psi_blk is memory.json's n_block_unit; Psi / n_layer (the captions' arithmetic) counts
    the root's embeddings in and is printed beside it as what it is not."""
    memory = json.loads((RESULTS / "memory.json").read_text())
    n_blk = next(r for r in memory["results"] if r["strategy"] == "FSDP")["model"]["n_block_unit"]
    v = regenerate.values(RESULTS).flat()
    assert v["q10_blk"] == f"{n_blk:,} elements"
    assert v["q10_psi_per_layer"] != v["q10_blk"]
    assert "results[i].model.n_block_unit" in TEMPLATE.read_text(encoding="utf-8")


def test_q13a_carries_the_difference_interval_rule(regenerate):
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    q13 = template.split("**Q13.**")[1].split("; (b)")[0]
    assert "Q9 (b)'s rule" in q13 and "undecided at this precision" in q13
    assert "(subtract the latter)" in q13, "Q13 (a) must name the row subtracted from (FSDP + prefetch)"
    q9 = template.split("**Q9.**")[1].split("**Q10.**")[0]
    assert "min-max ranges do not overlap" in q9 and "undecided at this precision" in q9
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    assert "**Q13 (5).** (a) 2: ours: {{q13_mem}}; by Q9 (b)'s difference rule: {{q13_mem_conclusion}}" in key


def test_from_labels_the_design_questions_by_their_evidence(regenerate):
    """--from's line for the questions without a threshold names what they are graded from (Q7 and Q8 were
    mislabelled "exact bytes" and "exact counts")."""
    assert "hook_trace.py" in regenerate.NO_THRESHOLD["Q3"] and "hook_trace.py" in regenerate.NO_THRESHOLD["Q7"]
    assert "exact bytes" not in regenerate.NO_THRESHOLD["Q7"] and "trace" in regenerate.NO_THRESHOLD["Q8"]
    # v5's Q1, Q6 and Q8 are graded from one hook_trace.py option each, the option their Deliverable names
    template = TEMPLATE.read_text(encoding="utf-8")
    for q, option in (("Q1", "--show-rng"), ("Q6", "--show-state-dict-peaks"), ("Q8", "--show-dtypes")):
        assert "hook_trace.py" in regenerate.NO_THRESHOLD[q] and option in regenerate.NO_THRESHOLD[q], q
        assert option in template.split(f"**{q}.**")[1].split("\n**Q")[0], (q, option)


# ---- issue 37, M1: the design questions ask for the student's own runs; the key has one rule for hint designs ----
DESIGN_QUESTIONS = ("Q1", "Q3", "Q5", "Q6", "Q7", "Q8")
# What only the student's own code and runs give: the tracer's output, a printout or measurement they add, a test's
# output on their code. Each design question's Deliverable must ask for at least one of them.
OWN_EVIDENCE = re.compile(r"hook_trace\.py|your trace|a print you add|with a print|LiveStorageTracker|paste|"
                          r"the test's message|its message")


def test_each_design_question_asks_for_the_students_own_run():
    text = TEMPLATE.read_text(encoding="utf-8")
    for q in DESIGN_QUESTIONS:
        block = text.split(f"**{q}.**")[1].split("\n**Q")[0].split("\n## ")[0]
        deliverable = block.split("*Deliverable:*")[1]
        parts = re.split(r"\([a-e]\) ", deliverable)[1:]
        assert parts, f"{q}: no parts"
        asking = [p for p in parts if OWN_EVIDENCE.search(p)]
        assert asking, f"{q}: no part asks for the student's own trace, printout or test output: {deliverable[:300]}"
    q3 = text.split("**Q3.**")[1].split("**Q4.**")[0]
    for scenario in ("--scenario lora", "--freeze-embedding", "--scenario reentrant", "--scenario twice"):
        assert scenario in q3, f"Q3 no longer asks for the {scenario} trace"
    assert "--scenario meta" in text.split("**Q1.**")[1].split("**Q2.**")[0]
    assert "--prefetch" in text.split("**Q7.**")[1].split("**Q8.**")[0]
    assert "--mixed-precision" in text.split("**Q8.**")[1].split("## Memory")[0]


def test_the_key_states_one_rule_for_a_design_that_follows_a_hint():
    """key_source.md contradicted itself (the answer must agree with the code, yet text quotable from the hints
    earned nothing): a student who followed a recipe failed one rule by obeying the other. One rule now, and the
    template and the handout say the same."""
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    assert ("**One rule**: a design that follows a hint earns the points when it is described with the student's own "
            "names") in key
    assert "could be quoted from the hints" not in key and "quotable" not in key
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    assert "Following a hint is fine: describe what your code does with your names and your evidence" in template
    assert "quoting them is not an answer about your code" not in template
    handout = _flat((ROOT / "handout" / "writeup.typ").read_text(encoding="utf-8"))
    assert "Following a hint is fine: described with your own names" in handout


# ---- issue 41: writeup v5's rules, said the same way in the template, the handout and the key ---------------------
WRITEUP_TYP = ROOT / "handout" / "writeup.typ"


def test_q8_key_formula_is_the_lora_traces_bytes():
    """Q8 (b): on the LoRA model the frozen base is gathered but never reduce-scattered, so the bytes per rank per step
    are (W - 1)/W (2 x 2 Psi + 4 Psi_t), not 8 Psi (W - 1)/W (the v4 key's, which marked the right answer down). The
    staff's trace (hook_trace.py --scenario lora --mixed-precision --json, about 10 s) agrees with the formula the key
    states, and not with the old one."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hook_trace.py"), "--scenario", "lora",
                          "--mixed-precision", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**__import__("os").environ, "FSDP_IMPL": "reference"})
    assert out.returncode == 0, out.stderr[-2000:]
    rank0 = json.loads(out.stdout)["lora"][0]
    W = 2
    coll = [e for e in rank0["events"] if e.get("kind") == "collective"]
    sent = sum(e["numel"] * (W - 1) * 2 for e in coll if e["name"] == "ALL-GATHER" and e["dtype"] == "bfloat16") + \
        sum(e["numel"] * (W - 1) / W * 4 for e in coll if e["name"] == "REDUCE-SCATTER" and e["dtype"] == "float32")
    assert len(coll) == sum(1 for e in coll if e["dtype"] in ("bfloat16", "float32"))
    flats = [f for unit in rank0["flat_params"].values() for f in unit]
    psi = W * sum(f["shard_numel"] for f in flats)                       # padded, the frozen base included
    psi_t = W * sum(f["shard_numel"] for f in flats if f["requires_grad"])
    assert psi_t < psi, "the LoRA model's base is no longer frozen: Q8 (b) asks about a frozen base"
    assert sent == pytest.approx((W - 1) / W * (2 * 2 * psi + 4 * psi_t)), (sent, psi, psi_t)
    assert sent != pytest.approx(8 * psi * (W - 1) / W)
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    q8 = key.split("**Q8 (3).**")[1].split("**Tables")[0]
    assert "(W - 1)/W (2 x 2 Psi + 4 Psi_t) bytes per rank per step" in q8
    assert "the trace's numels agree" not in q8, "the v4 key's claim that 8 Psi (W - 1)/W matches the trace is back"


def test_one_half_credit_list_in_the_handout_and_the_key():
    """The key said half credit is given "only in these cases", then gave half for Psi / n_layer and for a
    point-beta bound: the list now names them, in the handout and the key alike; Q12's "without it each part earns
    half" (which never applied: the zip's timeline counts) is gone everywhere."""
    handout = _flat(WRITEUP_TYP.read_text(encoding="utf-8"))
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    for text in (handout, key):
        assert "in these cases only" in text or "only in these cases" in text
        assert "taken from the wrong row or term" in text
        assert "a bound computed from a point estimate" in text
    assert 'for $Psi_"blk"$' in handout and "(Psi / n_layer for Psi_blk)" in key
    for text in (handout, key, template):
        assert "each part earns half" not in text and "no picture: half" not in text


def _listed_design_parts(text: str, lead: str) -> str:
    m = re.search(re.escape(lead) + r" \((Q1(?:[^()]|\([a-e](?:, [a-e])*\))*)\) ask", text)
    assert m, f"no '{lead} (Q1, ...) ask' list"
    return m.group(1)


def test_the_design_parts_are_listed_alike_in_the_handout_and_the_key():
    """writeup.typ listed the design parts without Q9's buffers, which the key graded; v5 has no design part in Q9,
    and both list the same parts."""
    handout = _flat(WRITEUP_TYP.read_text(encoding="utf-8"))
    key = _flat(SOURCE.read_text(encoding="utf-8"))
    listed = _listed_design_parts(handout, "Questions on your code")
    assert listed == _listed_design_parts(key, "**Design parts**"), listed
    assert "Q9" not in listed


def test_no_part_asks_for_a_reason_the_handout_states():
    """Issue 41: Q11 (c)'s two reasons, Q12 (a)'s "why it must wait", Q15 (d)'s three things and Q9 (c)'s gap could
    be quoted from the handout; v5 asks for what the student's own picture or numbers show instead."""
    template = _flat(TEMPLATE.read_text(encoding="utf-8"))
    for quotable in ("two reasons why the exposed fraction", "three other things that must fit",
                     "one concrete explanation of the remaining gap", "and why it must wait there"):
        assert quotable not in template, quotable
    q12 = template.split("**Q12.**")[1].split("**Q13.**")[0]
    assert "how long the longer of those waits is in your picture" in q12
    q11 = template.split("**Q11.**")[1].split("**Q12.**")[0]
    assert "argued from your own numbers" in q11


def test_q3_needs_no_hint_and_no_failed_test():
    """Q3 (c) asked where the design departs from a hints/ recipe (a student who never opened a hint had to read one)
    and for a public test that failed (no rule when none did): v5 asks neither."""
    q3 = _flat(TEMPLATE.read_text(encoding="utf-8")).split("**Q3.**")[1].split("**Q4.**")[0]
    assert "hints/" not in q3 and "failed while you built it" not in q3 and "(c)" not in q3


def test_a_print_you_add_is_asked_only_where_it_shows():
    """A print a student adds shows in `pytest -s` (labelled [rank r]) and in hook_trace.py's output: a part that asks
    for one names where it runs, and the template says once where rank output goes."""
    text = TEMPLATE.read_text(encoding="utf-8")
    for block in re.split(r"^(?=\*\*Q\d+\.\*\*)", text, flags=re.MULTILINE)[1:]:
        deliverable = block.split("*Deliverable:*")[1].split("\n## ")[0]
        for part in re.split(r"; \([a-e]\) |\(a\) ", deliverable):
            if re.search(r"print you add|add a print", part):
                assert "pytest -s" in part or "hook_trace.py" in part, part[:200]
    assert text.count("[rank r]") == 1, "the template says where rank output goes exactly once"
    assert "--show-rng" in text and "--show-state-dict-peaks" in text and "--show-dtypes" in text


# ---- writeup v5's parts: the printout labels its conclusions with the template's letters ---------------------------
def test_the_printouts_part_letters_are_the_templates(regenerate):
    """--from labelled its conclusions with v4's letters (Q10 (c), Q14 (c) and (d)) after v5 renamed the parts: every
    letter it prints is a part of that question's Deliverable, and the parts concluded are v5's."""
    q = every_question_concludes(regenerate, regenerate.expected_answers(RESULTS))
    template = TEMPLATE.read_text(encoding="utf-8")
    letters = {}
    for name, body in q.items():
        printed = set(re.findall(r"EXPECTED CONCLUSION \(([a-e])\)", body))
        if not printed:
            continue
        deliverable = template.split(f"**{name}.**")[1].split("\n## ")[0].split("*Deliverable:*")[1]
        for letter in printed:
            assert re.search(rf"(^|; )\({letter}\) ", deliverable.strip()), (name, letter)
        letters[name] = printed
    assert letters == {"Q9": {"a", "b"}, "Q10": {"b"}, "Q11": {"a"}, "Q13": {"a", "b"}, "Q14": {"b"}}, letters
    assert "EXPECTED CONCLUSION (a) the dominant term" in q["Q9"]
    assert "EXPECTED CONCLUSION (b) FSDP no-reshard minus FSDP at W = 4" in q["Q9"]
    assert "EXPECTED CONCLUSION (a) FSDP + prefetch, 2 blocks/unit minus FSDP + prefetch at W = 4" in q["Q13"]


def test_what_v5_no_longer_asks_is_neither_printed_nor_quoted(regenerate):
    """Q9's prefetch difference, Q10's W = 4 fit and bus-bandwidth comparison, Q13's collective count and Q15's
    ZeRO-2 and CPU offload (with its PCIe link) are not v5's questions: --from and NUMBERS.md leave them out."""
    q = every_question_concludes(regenerate, regenerate.expected_answers(RESULTS))
    assert "FSDP + prefetch minus FSDP," not in q["Q9"], q["Q9"]
    assert "W = 4" not in q["Q10"] and "bus bandwidth" not in q["Q10"], q["Q10"]
    assert "collectives per step" not in q["Q13"] and "alpha" not in q["Q13"], q["Q13"]
    for gone in ("ZeRO-2", "offload", "PCIe", "H2D"):
        assert gone not in q["Q15"], gone
    assert "pcie_gbps" not in regenerate.SCENARIO
    flat = regenerate.values(RESULTS).flat()
    for name in ("q9_prefetch", "q10_fit_w4", "q10_c_w4", "q10_d_w2", "q10_best_w2", "q13_colls", "q13_c_conclusion",
                 "q15_offload"):
        assert name not in flat, name
    numbers = (ROOT / "staff" / "answer_key" / "NUMBERS.md").read_text(encoding="utf-8")
    for gone in ("ZeRO-2", "CPU offload", "collectives per step", "all-gather fit at W = 4"):
        assert gone not in numbers, gone
    # the kept quantities are still there
    assert "DDP 208.00 GB" in q["Q15"] and "FSDP 26.00 GB" in q["Q15"] and "HSDP 52.00 GB" in q["Q15"]


def test_q14b_efficiency_with_beta_low_end_not_positive_is_undecided_whatever_was_measured(regenerate):
    """The template: where beta - 2 SE <= 0 the efficiency comparison is undecided on this machine. The tool still
    said "they do not agree" when the measured low end was above the model's top; it says undecided now, and the
    same measurement with beta's low end above 0 still concludes (the rule is not undecided everywhere)."""
    from staff.answer_key.values_scaling import efficiency_verdict
    measured_high = {"efficiency": 0.9, "efficiency_range": [0.85, 0.95]}  # above the model's top, 0.5
    open_range = efficiency_verdict(measured_high, point=1.5, b_lo=-1.0, e_lo=0.0, e_hi=0.5)
    assert "undecided on this machine: beta - 2 SE <= 0" in open_range, open_range
    assert "(the ranges are apart)" not in open_range and "(the ranges overlap)" not in open_range, open_range
    inside = efficiency_verdict({"efficiency": 0.3, "efficiency_range": [0.25, 0.35]}, 1.5, -1.0, 0.0, 0.5)
    assert "undecided on this machine" in inside and "(the ranges overlap)" not in inside, inside
    closed = efficiency_verdict(measured_high, point=1.5, b_lo=1e8, e_lo=0.3, e_hi=0.5)
    assert "they do not agree (the ranges are apart)" in closed, closed
