"""The documents the key's numbers go into: NUMBERS.md (every value, the bands table, the benchmark tables
verbatim), ANSWER_KEY.md (key_source.md with its ``{{name}}`` placeholders filled) and the TA's printout of a
student's expected answers (``--from``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from staff.answer_key.benchmark_run import ROOT, load
from staff.answer_key.rules import students_row
from staff.answer_key.values import Values, values

PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def bands(results: Path) -> list[str]:
    """The handout's table of what good results look like (handout/benchmarks.typ, @tab-bands): ours, and the band.
    Exact quantities get tight bands; timings a direction, with the noise rule for the ratio."""
    mem, comm, step = (load(results, n) for n in ("memory", "comm", "step"))
    out = ["| quantity | ours (this run) | band in the handout |", "| --- | --- | --- |"]
    rows = {(r.get("strategy"), r.get("world_size")): r for r in mem.get("results") or []}
    one = rows.get(("one process", 1))
    for W in (2, 4):
        r = rows.get(("FSDP", W))
        if one and r:
            out.append(f"| FSDP peak / one process, W = {W} | {r['peak_bytes'] / one['peak_bytes']:.2f} | below "
                       f"{1 / W + 0.25:.2f} |")
    errs = [abs(r["model_error"]) for r in mem.get("results") or [] if r.get("model_error") is not None
            and students_row(str(r.get("strategy", "")))]
    if errs:  # the student's own FSDP rows: torch's FSDP2 row is not theirs to explain
        out.append(f"| FSDP rows' model error (yours, FSDP2 apart), largest | {100 * max(errs):.1f}% | within 20% |")
    ratios = [r["ratio"] for r in comm.get("bytes_per_step") or [] if r.get("strategy", "").startswith("FSDP")
              and "FSDP2" not in r.get("strategy", "") and r.get("ratio") is not None]
    if ratios:
        out.append(f"| FSDP counted / formula bytes | {min(ratios):.4f} to {max(ratios):.4f} | 1.000 |")
    for r in step.get("ratios") or []:
        if r.get("comparison", "").startswith("FSDP + prefetch / FSDP step") and r.get("per_round"):
            out.append(f"| prefetch / no prefetch step time, {r.get('interconnect')}, W = {r.get('world_size')} | "
                       f"{r['median']:.2f} ({min(r['per_round']):.2f} to {max(r['per_round']):.2f}) | "
                       f"below 1, or an interval containing 1 (undecided at this precision) |")
    return out


def tables(results: Path) -> list[str]:
    out = []
    for name in ("memory", "comm", "step", "scaling"):
        md = results / f"{name}.md"
        if md.exists():
            out += ["", f"### {name}", "", *md.read_text().strip().splitlines()]
    return out


def numbers_md(results: Path, v: Values, record: dict) -> str:
    m = record.get("machine_before") or {}
    after = record.get("machine_after") or {}
    lines = ["<!-- STAFF ANSWER KEY: never in the student release (staff/release.py refuses it). -->",
             "# Answer key numbers (generated: do not edit by hand)", "",
             "Regenerate: `python staff/answer_key/regenerate.py` (see its docstring); the results it derives from are "
             "in `staff/answer_key/results/`.", "",
             f"- Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, no GPU; load average (1 min) "
             f"{m.get('load_1min', '?')} before the run, {after.get('load_1min', '?')} after (the run's own ranks count "
             f"in that; a load above the cores before it means other jobs shared the machine)"
             + (f"; observed during the run: {', '.join(f'{x:g}' for x in record['load_observed_1min'])}."
                if record.get("load_observed_1min") else "."),
             f"- Command: `{record.get('command', '?')}`, {record.get('seconds', '?')} s.",
             f"- Results fingerprint: `{str(record.get('sources_sha256', '?'))[:16]}`.", ""]
    for q, items in v.by_q.items():
        lines += [f"## {q}", ""] + [f"- `{name}`: {what}: {value}" for name, what, value in items] + [""]
    lines += ["## Bands", ""] + bands(results) + ["", "## The benchmark tables (verbatim)"] + tables(results)
    return "\n".join(lines) + "\n"


def render_key(source: str, v: Values, strict: bool = True) -> str:
    """key_source.md with every {{name}} replaced by its value; strict: a placeholder without a value is an error
    (the staff run has every W; a --quick run has W = 2 only, and shows "n/a" there)."""
    flat = v.flat()
    missing = sorted(set(PLACEHOLDER.findall(source)) - set(flat))
    if missing and strict:
        raise KeyError(f"key_source.md uses placeholders values() does not compute from these results: {missing}")
    return PLACEHOLDER.sub(lambda m: flat.get(m.group(1), "n/a (not in this run)"), source)


# What decides the questions that compare no measured interval with a threshold (the key grades them from the
# student's code, picture or arithmetic).
NO_THRESHOLD = {"Q1": "no threshold: the student's own design, from their hook_trace.py --scenario meta --show-rng "
                      "output (the key's list)",
                "Q2": "no threshold: exact numbers (padding), the same for every student",
                "Q3": "no threshold: the student's own design, from their hook_trace.py output (the key's list)",
                "Q4": "no threshold: formulas",
                "Q5": "no threshold: the student's printout of one clip, and exact bytes (ring formula)",
                "Q6": "no threshold: exact bytes (optim = 8 S) and the student's state-dict peaks (hook_trace.py "
                      "--show-state-dict-peaks)",
                "Q7": "no threshold: the student's own design, from their hook_trace.py --prefetch output",
                "Q8": "no threshold: dtypes from the student's trace (hook_trace.py --mixed-precision --show-dtypes) "
                      "and code, bytes as formulas in Psi and W",
                "Q12": "no threshold: read from the student's picture (the key's list)",
                "Q15": "no threshold: the scenario's arithmetic (the key's numbers)"}


def expected_answers(folder: Path) -> str:
    """The TA's calculator (--from): per question, the quantities computed from this results folder, then the
    conclusion each threshold part's rule gives on them (Models box item 4: a straddling interval is "undecided at
    this precision"; alpha unresolved or <= 0: alpha = 0 and alpha_bound; beta <= 0: no beta, no N_1/2, no W*)."""
    sys.path.insert(0, str(ROOT))
    from tests.points import WRITEUP_QUESTION_POINTS

    v = values(folder)
    out = [f"Expected answers from {folder} (computed from this student's JSON; a conclusion is what the question's "
           "rule gives on these numbers):", ""]
    for q in WRITEUP_QUESTION_POINTS:
        out.append(q)
        out += [f"  {what}: {value}" for _, what, value in v.by_q.get(q, []) if not what.startswith("expected conclusion")]
        concl = v.conclusions.get(q)
        if concl:
            out += [f"  EXPECTED CONCLUSION {part}: {text}" for part, text in concl]
        else:
            out.append(f"  EXPECTED CONCLUSION: {NO_THRESHOLD.get(q, 'no threshold')}")
    return "\n".join(out)

