"""Check a submission's pasted benchmark tables against the results JSON it submitted (staff only).

    python staff/answer_key/check_tables.py submission.zip        # or an unpacked submission folder
    python staff/answer_key/check_tables.py WRITEUP.md --results benchmarks/results

``make_submission.sh`` puts ``benchmarks/results/*.json`` in the zip next to WRITEUP.md. Every row pasted under a
benchmark table header of WRITEUP_TEMPLATE.md is looked up in the JSON by its key columns (strategy, W,
interconnect, ...), and the script renders that row again from the JSON, cell by cell, as the benchmark printed it
(the benchmarks' own cell formats: ``benchmarks/report.py``'s, ``bench_step.exposed_cell``). Every number of every
pasted cell (the median and its min-max, the model, the error, the breakdown, the bytes, the fit, ...) must equal
the rendered one at the precision the table prints, and the words around them must be the benchmark's too (spacing
aside: "profiled" is not "timed", a dropped x or % is an edit); a cell without numbers must read the same. A column
the benchmark prints that the pasted header lacks is reported too. It
reports each difference with its table, row and column, pasted rows the JSON does not have, and JSON rows that
were not pasted; exit status 1 when a row differs or is unknown. A missing row is reported but is not a mismatch
(the rubric grades it).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402  (no torch: the tables' own cell formats)


def _cell(v) -> str:
    """A cell as report.markdown_table prints it."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _human(n: int) -> str:  # bench_comm.py's size cell
    return f"{n // 1024 ** 2} MiB" if n >= 1024 ** 2 else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def _pct(x: float, digits: int = 1, sign: bool = False) -> str:
    return f"{x:+.{digits}%}" if sign else f"{x:.{digits}%}"


# Each renderer: the JSON of one benchmark -> [(key cells, {column: the cell as the benchmark printed it})]. A cell
# the JSON cannot give whole (an old JSON without the one-process rounds) is PARTIAL: its first number only.
PARTIAL = "\0partial\0"


def _memory(d):
    from benchmarks.bench_memory import CATEGORIES

    out = []
    for r in d.get("results") or []:
        steps = r["peak_bytes_all_steps_per_rank"][r.get("worst_rank", r["peak_bytes_per_rank"].index(r["peak_bytes"]))]
        cells = {"peak MiB": report.spread(steps, 1 / MIB), "model MiB": _cell(r["model"]["peak_bytes"] / MIB),
                 "model error": _pct(r["model_error"], sign=True),
                 "vs one process": "n/a" if r.get("vs_one_process") is None else f"{r['vs_one_process']:.3f}x"}
        cells.update({f"{c} MiB": _cell(r["breakdown_at_peak"][c] / MIB) for c in CATEGORIES})
        out.append(((r["strategy"], str(r["world_size"])), cells))
    return out


def _coll(d):
    return [((r["kind"].replace("_", "-"), str(r["world_size"]), r.get("interconnect", ""), _human(r["size"])),
             {"time us": report.spread(r.get("seconds_repeats", [r["seconds"]]), 1e6),
              "algbw GB/s": _cell(r["algbw_gbps"]), "busbw GB/s": _cell(r["busbw_gbps"])})
            for r in d.get("collectives") or []]


def _bytes(d):
    out = []
    for r in d.get("bytes_per_step") or []:
        mib = {k: (r.get("counted") or {}).get(k, {}).get("bus_bytes", 0.0) / MIB
               for k in ("all_gather", "reduce_scatter", "all_reduce")}
        out.append(((r["strategy"], str(r["world_size"])),
                    {"all-gather MiB": _cell(mib["all_gather"]), "reduce-scatter MiB": _cell(mib["reduce_scatter"]),
                     "all-reduce MiB": _cell(mib["all_reduce"]), "total MiB": _cell(r["total_bus_bytes"] / MIB),
                     "formula": r["formula"], "formula MiB": _cell(r["formula_bytes"] / MIB),
                     "counted / formula": f"{r['ratio']:.4f}", "note": r.get("note", "")}))
    return out


def _fit(d):
    out = []
    for f in d.get("alpha_beta") or []:
        beta_gb = f["beta_bytes_per_s"] / 1e9
        out.append(((f["kind"].replace("_", "-"), str(f["world_size"]), f.get("interconnect", "")),
                    {"alpha us (± 2 SE)": f"{f['alpha_s'] * 1e6:.0f} ± {2 * f['alpha_se_s'] * 1e6:.0f}",
                     "alpha resolved": "yes" if f["alpha_resolved"] else f"no: alpha < {f['alpha_bound_s'] * 1e6:.0f} us",
                     "beta GB/s (± 2 SE)": f"{beta_gb:.3g} ± {2 * f['beta_rel_se'] * beta_gb:.2g}"
                     if 0 < beta_gb < float("inf") else "n/a (fitted slope <= 0: the sizes are too small or too noisy)",
                     "sizes": str(f["sizes"]), "max rel. error of the fit": _pct(f["max_rel_error"])}))
    return out


def _step(d):
    from benchmarks.bench_step import exposed_cell

    cfg = d.get("config") or {}
    tokens = cfg.get("batch", 0) * cfg.get("block_size", 0)
    out = []
    for r in d.get("results") or []:
        if r["strategy"] == "one process":
            rounds = r.get("per_round_s")
            cells = {"step ms": report.spread(rounds, 1e3) if rounds else PARTIAL + _cell(r["step_s"] * 1e3),
                     "vs one process": "1.00x", "exposed comm": "0%", "tokens/s": _cell(tokens / r["step_s"])}
        else:
            vs = r.get("vs_one_process")
            cells = {"step ms": report.spread(r["per_round_s"], 1e3),
                     "vs one process": "n/a" if vs is None else f"{vs:.2f}x", "exposed comm": exposed_cell(r["exposed"]),
                     "tokens/s": _cell(r["world_size"] * tokens / r["step_s"])}
        out.append(((r["strategy"], str(r["world_size"]), r["interconnect"]), cells))
    return out


def _ratio(d):
    return [((r["comparison"], str(r["world_size"]), r.get("interconnect", "-")),
             {"ratio (median)": _cell(r["median"]), "min": _cell(min(r["per_round"])),
              "max": _cell(max(r["per_round"])), "rounds": str(len(r["per_round"]))})
            for r in d.get("ratios") or []]


def _scaling(d):
    out = []
    for r in d.get("results") or []:
        slowest = max(r["per_rank"], key=lambda x: x["step_s"])
        out.append(((r["scaling"], r["strategy"], str(r["world_size"])),
                    {"global batch": str(r["global_batch"]), "batch per rank": str(r["batch_per_rank"]),
                     "step ms": report.spread(slowest["times_s"], 1e3), "efficiency": f"{r['efficiency']:.2f}",
                     "tokens/s": _cell(r["tokens_per_s"]), "peak MiB per rank": _cell(r["peak_bytes"] / MIB)}))
    return out


# kind -> (the header's first cells, how many leading columns are the row's key, the JSON file, the renderer)
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


NUMBER = re.compile(r"(?<![\d.])[-+]?\d(?:[\d,]*\d)?(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(cell: str) -> list[float]:
    """Every number a cell prints, in order: '61.3 (61.2-61.4, n=3)' -> [61.3, 61.2, 61.4, 3]."""
    return [float(m.group(0).replace(",", "")) for m in NUMBER.finditer(cell)]


def words(cell: str) -> str:
    """What a cell prints besides its numbers, spaces dropped: '31% of the profiled step' -> '#%ofthe profiled...'.
    A word-only edit of a numeric cell ("profiled" to "timed", "over ranks" to "over rounds", a dropped x or %)
    changes it; spacing does not."""
    return "".join(NUMBER.sub("#", cell).split()).casefold()


def _same(pasted: str, expected: str) -> bool:
    """Equal at the precision the table prints: the same numbers, in order, and the same words around them."""
    if expected.startswith(PARTIAL):
        got = numbers(pasted)
        return bool(got) and got[0] == numbers(expected[len(PARTIAL):])[0]
    return numbers(pasted) == numbers(expected) and words(pasted) == words(expected)


def check(writeup: str, results: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(problems, notes): problems are mismatches (table, row, column, pasted, expected) and unknown rows; notes are
    JSON rows not pasted."""
    problems, notes, seen = [], [], {}
    for header, rows in pasted_tables(writeup):
        kind = next((k for k, (head, *_rest) in KINDS.items() if header[:len(head)] == head), None)
        if kind is None or not rows:
            continue
        head, nkey, name, render = KINDS[kind]
        if name not in results:
            problems.append(f"{kind}: {len(rows)} pasted row(s), but the submission has no {name}.json")
            continue
        expected = dict(render(results[name]))
        printed = list(next(iter(expected.values()), {}))
        dropped = [c for c in printed if c not in header]
        if dropped:  # a deleted column is a changed table, not a column to skip
            problems.append(f"{kind}: the pasted header lacks the column(s) {', '.join(repr(c) for c in dropped)} that "
                            f"the benchmark prints (header pasted: {' | '.join(header)})")
        in_this_table = set()
        for row in rows:
            key = tuple(row[:nkey])
            if key in in_this_table:  # a key cell edited into another row's (two rows of a model can print alike)
                problems.append(f"{kind}: row {' | '.join(key)} is pasted twice in one table")
                continue
            in_this_table.add(key)
            seen.setdefault(kind, set()).add(key)
            if key not in expected:
                problems.append(f"{kind}: row {' | '.join(key)} is not in {name}.json")
                continue
            for column, want in expected[key].items():
                if column not in header:
                    continue
                i = header.index(column)
                got = row[i] if i < len(row) else ""
                if not _same(got, want):
                    shown = want[len(PARTIAL):] + " (its first number)" if want.startswith(PARTIAL) else want
                    problems.append(f"{kind}: row {' | '.join(key)}, column '{column}': pasted {got!r}, "
                                    f"{name}.json gives {shown!r}")
    for kind, (head, nkey, name, render) in KINDS.items():
        if name in results:
            for key, _ in render(results[name]):
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
