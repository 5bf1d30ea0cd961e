"""Check a submission's pasted benchmark tables against the results JSON it submitted (staff only).

    python staff/answer_key/check_tables.py submission.zip        # or an unpacked submission folder
    python staff/answer_key/check_tables.py WRITEUP.md --results benchmarks/results

``make_submission.sh`` puts ``benchmarks/results/*.json`` in the zip next to WRITEUP.md. Every row pasted under a
benchmark table header of WRITEUP_TEMPLATE.md is looked up in the JSON by its key columns (strategy, W,
interconnect, ...), and its measured columns (peak, model, step time, ratio, bytes, fit) are compared with the
JSON's values at the precision the scripts print (3 significant digits). It reports rows whose numbers differ
(a hand-edited table), pasted rows the JSON does not have, and JSON rows that were not pasted; exit status 1 when a
row differs or is unknown. A missing row is reported but is not a mismatch (the rubric grades it).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import zipfile
from pathlib import Path

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]


def _human(n: int) -> str:  # bench_comm.py's size cell
    return f"{n // 1024 ** 2} MiB" if n >= 1024 ** 2 else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


# kind -> (the header's first cells, the key columns, the JSON file, rows of that JSON as (key, {column: value}))
def _memory(d):
    return [((r["strategy"], str(r["world_size"])), {"peak MiB": r["peak_bytes"] / MIB,
                                                     "model MiB": r["model"]["peak_bytes"] / MIB})
            for r in d.get("results") or []]


def _coll(d):
    return [((r["kind"].replace("_", "-"), str(r["world_size"]), r.get("interconnect", ""), _human(r["size"])),
             {"time us": r["seconds"] * 1e6, "busbw GB/s": r["busbw_gbps"]}) for r in d.get("collectives") or []]


def _bytes(d):
    return [((r["strategy"], str(r["world_size"])), {"total MiB": r["total_bus_bytes"] / MIB})
            for r in d.get("bytes_per_step") or []]


def _fit(d):
    return [((f["kind"].replace("_", "-"), str(f["world_size"]), f.get("interconnect", "")),
             {"alpha us (± 2 SE)": f["alpha_s"] * 1e6}) for f in d.get("alpha_beta") or []]


def _step(d):
    return [((r["strategy"], str(r["world_size"]), r["interconnect"]), {"step ms": r["step_s"] * 1e3})
            for r in d.get("results") or []]


def _ratio(d):
    return [((r["comparison"], str(r["world_size"]), r.get("interconnect", "-")), {"ratio (median)": r["median"]})
            for r in d.get("ratios") or []]


def _scaling(d):
    return [((r["scaling"], r["strategy"], str(r["world_size"])), {"step ms": r["step_s"] * 1e3,
                                                                 "peak MiB per rank": r["peak_bytes"] / MIB})
            for r in d.get("results") or []]


KINDS = {
    "memory": (["strategy", "W", "peak MiB"], 2, "memory", _memory),
    "collectives": (["collective", "W", "interconnect", "size"], 4, "comm", _coll),
    "bytes per step": (["strategy", "W", "all-gather MiB"], 2, "comm", _bytes),
    "alpha-beta fit": (["collective", "W", "interconnect", "alpha us (± 2 SE)"], 3, "comm", _fit),
    "step": (["strategy", "W", "interconnect", "step ms"], 3, "step", _step),
    "step ratios": (["comparison", "W", "interconnect", "ratio (median)"], 3, "step", _ratio),
    "scaling": (["scaling", "strategy", "W"], 3, "scaling", _scaling),
}


def pasted_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table in ``text``: (header cells, rows of cells)."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                row = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                # The template's header stays above a paste that brought its own header and separator: a
                # repeated header or separator is layout, not a row to check.
                if row != header and not all(re.fullmatch(r":?-+:?", c) for c in row):
                    rows.append(row)
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def _number(cell: str) -> float | None:
    m = re.match(r"\s*([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)", cell)
    return float(m.group(1).replace(",", "")) if m else None


def _close(shown: float, value: float) -> bool:
    """Equal at the printed precision: 3 significant digits, or a whole number when >= 1000."""
    if abs(value) >= 1000:
        return abs(shown - value) <= 0.51 + 1e-9 * abs(value)
    return abs(shown - value) <= 0.0051 * abs(value) + 1e-12


def check(writeup: str, results: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(problems, notes): problems are mismatches and unknown rows; notes are JSON rows not pasted."""
    problems, notes, seen = [], [], {}
    for header, rows in pasted_tables(writeup):
        kind = next((k for k, (head, *_rest) in KINDS.items() if header[:len(head)] == head), None)
        if kind is None or not rows:
            continue
        head, nkey, name, extract = KINDS[kind]
        if name not in results:
            problems.append(f"{kind}: {len(rows)} pasted row(s), but the submission has no {name}.json")
            continue
        expected = dict(extract(results[name]))
        for row in rows:
            key = tuple(row[:nkey])
            seen.setdefault(kind, set()).add(key)
            if key not in expected:
                problems.append(f"{kind}: row {' | '.join(key)} is not in {name}.json")
                continue
            for column, value in expected[key].items():
                if column not in header or header.index(column) >= len(row):
                    continue
                shown = _number(row[header.index(column)])
                if shown is None or not _close(shown, value):
                    problems.append(f"{kind}: row {' | '.join(key)}, column '{column}': pasted "
                                    f"{row[header.index(column)]!r}, {name}.json has {value:.4g}")
    for kind, (head, nkey, name, extract) in KINDS.items():
        if name in results:
            for key, _ in extract(results[name]):
                if key not in seen.get(kind, set()):
                    notes.append(f"{kind}: {name}.json row {' | '.join(key)} was not pasted")
    return problems, notes


def load_submission(path: Path, results_dir: Path | None) -> tuple[str, dict[str, dict]]:
    """WRITEUP.md's text and the results JSON, from a zip, a folder, or a WRITEUP.md plus --results."""
    names = ("memory", "comm", "step", "scaling")
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            files = {n: n for n in z.namelist()}
            text = z.read("WRITEUP.md").decode("utf-8") if "WRITEUP.md" in files else ""
            res = {n: json.load(io.BytesIO(z.read(f"benchmarks/results/{n}.json"))) for n in names
                   if f"benchmarks/results/{n}.json" in files}
        return text, res
    folder = path if path.is_dir() else path.parent
    text = (folder / "WRITEUP.md" if path.is_dir() else path).read_text(encoding="utf-8")
    rdir = results_dir or folder / "benchmarks" / "results"
    return text, {n: json.loads((rdir / f"{n}.json").read_text()) for n in names if (rdir / f"{n}.json").exists()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("submission", type=Path, help="submission.zip, an unpacked submission folder, or a WRITEUP.md")
    p.add_argument("--results", type=Path, help="the results folder (default: benchmarks/results/ beside WRITEUP.md)")
    args = p.parse_args(argv)
    text, results = load_submission(args.submission, args.results)
    if not text:
        print("no WRITEUP.md in the submission (a writeup.pdf is checked by hand)")
        return 0
    problems, notes = check(text, results)
    for line in problems:
        print("MISMATCH  " + line)
    for line in notes:
        print("missing   " + line)
    print(f"{len(problems)} mismatch(es), {len(notes)} row(s) not pasted; JSON read: {', '.join(sorted(results)) or 'none'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
