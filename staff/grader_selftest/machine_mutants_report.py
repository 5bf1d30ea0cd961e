"""Combine machine_mutants.py's JSON outcomes into the committed report: machine_mutants.json (data, read by
tests/staff/test_machine_mutants.py) and MACHINE_MUTANTS.md (for people).

    python -m staff.grader_selftest.machine_mutants_report "Task 1, every mutant=task1.json" "Sample=sample.json"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def render(runs: list[tuple[str, dict]]) -> str:
    lines = ["# Machine-generated mutants (cosmic-ray) against the public + hidden tests", "",
             "Generated and graded by `python -m staff.grader_selftest.machine_mutants` (see its docstring):",
             "each mutant graded only by the tests that call the mutated function, cheapest first, `-x`. Re-run a row with",
             "`--only ID`. Counts below are exactly what was graded; nothing is extrapolated.", ""]
    from staff.grader_selftest import machine_mutants
    total = len(machine_mutants.enumerate_mutants())
    graded = sum(d["summary"]["generated"] for _, d in runs)
    lines += [f"cosmic-ray makes {total} mutants of the seven reference task files; {graded} of them are in this "
              f"report. The rest are not graded yet (at 20-90 s a mutant on a 2-core machine, all of them take "
              f"hours), so no kill rate over all of them is claimed. `equivalent` rows carry their reason: "
              f"automatic (a mutation inside a type annotation) or judged by hand (`EQUIVALENT` in "
              f"machine_mutants.py). A row killed by a test in `tests/hidden/test_task1_mutant_kills.py` is one "
              f"that survived the first run and got a new check; so is `task3_forward.py:ZeroIterationForLoop:3` "
              f"(killed since the handles-waited check: no collective handle left unwaited when backward "
              f"returns). A `survived` row says why: only a GPU kills it "
              f"(`GPU_ONLY`: the CPU-offload bonus's NCCL variant), or which missing check would.", ""]
    for title, data in runs:
        s = data["summary"]
        rate = s["kill_rate_of_non_equivalent"]
        lines += [f"## {title}", "",
                  f"generated {s['generated']}, equivalent {s['equivalent']}, killed {s['killed']}, survived "
                  f"{s['survived']}, in code no graded test calls {s['uncalled']}; killed / (killed + survived) = "
                  f"{'n/a' if rate is None else f'{rate:.1%}'}", "",
                  "| mutant | line | function | status | killer or reason |", "| --- | --- | --- | --- | --- |"]
        for o in sorted(data["outcomes"], key=lambda o: (o["status"] != "survived", o["id"])):
            why = o.get("killer") or o.get("reason") or ""
            lines.append(f"| `{o['id']}` | {o['line']} | `{o['function']}` | {o['status']} | {why} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="TITLE=PATH", help="a title and machine_mutants.py's --json output")
    here = Path(__file__).resolve().parent
    runs = []
    for arg in parser.parse_args(argv).runs:
        title, _, path = arg.partition("=")
        runs.append((title, json.loads(Path(path).read_text())))
    (here / "machine_mutants.json").write_text(json.dumps(
        {"runs": [{"title": t, **d} for t, d in runs]}, indent=1) + "\n")
    (here / "MACHINE_MUTANTS.md").write_text(render(runs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
