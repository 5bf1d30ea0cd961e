"""The writeup's answer key, generated: every number in it comes from a results folder (staff only).

    python staff/answer_key/regenerate.py              # run the reference's benchmarks at the default sizes into
                                                       # staff/answer_key/results/ (run_all.py: 167-297 s on 2 quiet
                                                       # cores, 563-1,693 s at load 8-21: the README's timings; the
                                                       # committed run took 271 s at load 3.8, results/run.json), then write
                                                       # NUMBERS.md and ANSWER_KEY.md from it
    python staff/answer_key/regenerate.py --rederive   # no run: rewrite NUMBERS.md and ANSWER_KEY.md from the
                                                       # committed results/ (after editing key_source.md or this file)
    python staff/answer_key/regenerate.py --from PATH  # the TA's calculator: print the expected answers of a
                                                       # student's results: their benchmarks/results/ folder, their
                                                       # submission's root, or submission.zip; writes nothing (no
                                                       # benchmark JSON there: an error, exit status 1)
    python staff/answer_key/regenerate.py --quick      # a smoke run into a temporary folder; writes nothing

ANSWER_KEY.md is rendered from key_source.md: the prose is written there, and every number it carries is a
``{{name}}`` placeholder that ``values()`` (values.py) computes from the results (or from the scenario constants of
Q15, which the template's question states). tests/staff/test_answer_key.py fails when key_source.md carries a
number outside a placeholder (a decimal, a number with a unit, a percentage, a fraction in words), when
ANSWER_KEY.md or NUMBERS.md differ from what this script renders from results/, and when results/ were made by
other benchmark code than today's (the fingerprint in results/run.json: the *code*, docstrings and comments
excluded, of the files benchmark_run.FINGERPRINTED names).

Timings depend on the machine and its load: the key grades students' timings by their own intervals and the
rules the questions state, never against ours. Memory and byte counts are exact.

This file is the command line; what it runs and renders is split by what each part computes, in this folder:
benchmark_run.py (the staff run, its record and fingerprint), rules.py (the Models box's rules on one fit or one
interval), values.py (every value the key quotes, by question, from values_memory.py, values_timing.py,
values_scaling.py and scenario.py) and documents.py (NUMBERS.md, ANSWER_KEY.md and the --from printout).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script: the package imports below need the repository root
    sys.path.insert(0, str(ROOT))

# What the tests and the TA's tools call as regenerate.X: each name lives in the module that computes it.
from staff.answer_key.benchmark_run import (FINGERPRINTED, KEPT, NOT_FINGERPRINTED, RESULTS,  # noqa: E402,F401
                                            WORLD_SIZES, _code_only, load, machine, run_benchmarks,
                                            sources_fingerprint)
from staff.answer_key.documents import (NO_THRESHOLD, PLACEHOLDER, bands, expected_answers,  # noqa: E402,F401
                                        numbers_md, render_key, tables)
from staff.answer_key.rules import (MIB, beta_range, crossover_w, dominant_term, fit_of,  # noqa: E402,F401
                                    fit_usable, latency_or_bandwidth, n_half_interval, resolved, students_row)
from staff.answer_key.scenario import SCENARIO  # noqa: E402,F401
from staff.answer_key.values import Values, values  # noqa: E402,F401
from staff.answer_key.values_timing import root_params  # noqa: E402,F401

NUMBERS = HERE / "NUMBERS.md"
KEY = HERE / "ANSWER_KEY.md"
SOURCE = HERE / "key_source.md"


def find_results(source: Path, unpack_into: Path) -> Path:
    """The folder of benchmark JSON in ``source``: a results folder itself, a submission's root (its
    ``benchmarks/results/``), a folder holding ``results/``, or a submission zip (its benchmarks' JSON unpacked into
    ``unpack_into``, a temporary folder the caller removes, then searched the same way). Raises SystemExit, with
    what to give instead, when none holds a benchmark's JSON."""
    import zipfile

    wanted = [f"{n}.json" for n in KEPT]

    def holds(folder: Path) -> bool:
        return folder.is_dir() and any((folder / n).is_file() for n in wanted)

    if source.is_file():
        if not zipfile.is_zipfile(source):
            raise SystemExit(f"regenerate.py --from {source}: not a folder and not a zip: give the student's "
                             "benchmarks/results/ folder, their submission's root, or their submission zip")
        with zipfile.ZipFile(source) as zf:
            for member in zf.namelist():  # only the benchmarks' JSON: nothing else is read, nothing runs
                if Path(member).name in wanted and ".." not in Path(member).parts and not member.startswith("/"):
                    zf.extract(member, unpack_into)
        found = sorted({p.parent for p in unpack_into.rglob("*.json")}, key=lambda d: (not d.as_posix().endswith(
            "benchmarks/results"), len(d.parts)))
        if not found:
            raise SystemExit(f"regenerate.py --from {source}: the zip holds no benchmark results "
                             f"({', '.join(wanted)} under benchmarks/results/): the student submitted none; grade "
                             "their measured parts from their pasted tables only, or ask for the results")
        return found[0]
    for folder in (source, source / "benchmarks" / "results", source / "results"):
        if holds(folder):
            return folder
    raise SystemExit(f"regenerate.py --from {source}: no benchmark results there (looked for {', '.join(wanted)} in "
                     f"it, in benchmarks/results/ and in results/): give the student's benchmarks/results/ folder, "
                     "their submission's root, or their submission zip")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\nANSWER_KEY.md")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--from", dest="source", type=Path,
                   help="print the expected answers of these results: a results folder, a submission's root or zip")
    g.add_argument("--rederive", action="store_true", help="rewrite NUMBERS.md and ANSWER_KEY.md from results/")
    g.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder; writes nothing")
    args = p.parse_args(argv)
    if args.source:
        # a zip is unpacked into a temporary folder that is removed on every way out (the answers printed, or a
        # SystemExit saying the zip holds no results)
        with tempfile.TemporaryDirectory(prefix="answer-key-from-") as unpacked:
            folder = find_results(args.source, Path(unpacked))
            missing = [f"{n}.json" for n in KEPT if not (folder / f"{n}.json").exists()]
            if missing:
                print(f"regenerate.py --from: {folder} has no {', '.join(missing)}: the questions that read them "
                      "show n/a", file=sys.stderr)
            print(expected_answers(folder))
        return 0
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="answer-key-quick-"))
        run_benchmarks(tmp, full=False)
        print(render_key(SOURCE.read_text(encoding="utf-8"), values(tmp), strict=False)[:2000])
        return 0
    if not args.rederive:
        run_benchmarks(RESULTS, full=True)
    record = json.loads((RESULTS / "run.json").read_text())
    v = values(RESULTS)
    NUMBERS.write_text(numbers_md(RESULTS, v, record))
    KEY.write_text(render_key(SOURCE.read_text(encoding="utf-8"), v))
    print(f"wrote {NUMBERS.relative_to(ROOT)} and {KEY.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
