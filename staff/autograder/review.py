"""Code a person should look at: what in a submission reaches into the grader's machinery or around the process
group, found statically in the submitted task files, with file and line (issues 32 and 36); and the findings of
the runtime audit that ran in every rank (tests/rank_audit.py), read back from the grading run.

    python -m staff.autograder.review SUBMISSIONS          # one line per flag, for every submission in the folder
    python -m staff.autograder.review SUBMISSIONS --json review.json
    python -m staff.autograder.review fsdp_assignment/task3_forward.py ...   # some files

A SUBMISSIONS folder holds one entry per student: a zip (``make_submission.sh``'s) or a folder; its task files are
found exactly as the grading command finds them (``intake.find_submitted``, ``intake.find_in_zips``).

What it reads: each task file's bytes decoded as Python's import decodes them (the BOM or the coding cookie on
line 1 or 2, then universal newlines: review_decode.py), parsed from those bytes by Python's own parser, so every
flag carries Python's line number and the code Python runs there. A file in another encoding than UTF-8, or one
Python cannot decode, is flagged (``encoding``), as is each line such a decoding makes that the file does not show
(UTF-7's ``+AAo-`` is a newline inside what reads as a comment), and any character that displays differently from
what runs (``display``: bidirectional controls, zero-width and other invisible characters, U+2028/2029, a form feed,
vertical tab or lone carriage return inside a line, identifiers Python folds by NFKC such as ``ｓｙｓ``, string
literals holding terminal controls).

What is flagged (each a ``kind``): ``frame`` (frame or stack inspection, tracing hooks, tracebacks), ``audit``
(``sys.addaudithook``, ``sys.audit``; ``os.close``, ``os.dup2``, ``fcntl``: the rank audit's channel is a
descriptor), ``gc`` (walking the garbage collector's objects), ``ctypes`` (ctypes, cffi),
``native`` (extension loading: ``torch.utils.cpp_extension``, ``torch.ops.load_library``), ``mmap`` (shared or
file mappings: mmap, memfd, shared_memory, ``_posixshmem``, ``torch.from_file``, ``numpy.memmap``), ``path``
(``/proc``, ``/dev``, ``/sys``, ``/tmp``, cgroups in a string however it is built, and ``open``/``os.open``/
``Path`` of a path built at run time), ``patch`` (an assignment, ``del``, ``setattr``/``delattr`` or
``object.__setattr__`` on anything rooted in an import or on the class of an object, or on a class reached by a
walk of ``__mro__``/``__bases__``, through any alias, module-level or local; a module's ``__dict__``/``vars()``;
``builtins``), ``introspection`` (``__globals__``, ``__subclasses__``, ``__code__``, ``__closure__``, ``globals()``,
``vars()``, a dunder through getattr; not ``__dict__``/``vars(x)`` of the submission's own objects nor a read of
``__mro__``, which honest FSDP code uses), ``sys.modules``, ``signal`` (signals, ``os.kill``, pidfds, the parent's pid, sessions),
``process`` (``os.fork``, ``subprocess``, ``multiprocessing``, ``exec*``/``spawn*``, ``posix_spawn``),
``harness`` (``tests``, ``pytest``, ``staff``, ``adapters``, ``conftest``; a private attribute of the tests'
instrumentation, ``_log``, ``_pending``, ``_record``, ..., that no file of the submission defines as its own:
review_instrumentation.py), ``dynamic`` (``exec``, ``eval``,
``compile``, ``__import__``, ``importlib``, ``pkgutil``, ``marshal``, ``pickle.loads``, ``types.FunctionType``,
``copyreg``, ``sys.path``/``sys.meta_path`` edits, and ``getattr``/``setattr``/``hasattr`` with a name built
at run time, or held in a variable on a module or a class: code this review cannot read), ``socket``, ``environment`` (edits of ``os.environ``,
``os.environb``, ``putenv``), ``resource`` (rlimits), ``unreadable`` (Python cannot parse it), ``truncated``
(more than MAX_FLAGS_PER_FILE flags in a file: the rest are counted). A name is judged however it is spelt:
``os.fork``, ``posix.fork``, ``from os import fork as f``, ``getattr(os, 'fo' + 'rk')`` are one name (aliases are
followed, strings built by concatenation, f-strings, join, ``os.path.join``, ``chr``, slicing are folded). A
correct implementation written from the release needs none of it (a staff test checks that the reference, the
stubs, the staff alternatives and an honest corpus written in other styles, staff/grader_selftest/honest_corpus,
flag nothing); a flag is not a verdict: a person reads the line.

What it cannot see (what the runtime audit, tests/rank_audit.py, is for): what code does at run time with values
the file does not spell: a name assembled from data the review cannot fold (read from a file, from a tensor, or
held in a variable and used on an object of the file's own: ``getattr(obj, name)`` is not flagged there, as Task 1
does it honestly), a module or class reached through a container or an object's attribute
(``self.m = torch.distributed; self.m.x = f``), what ``exec`` or a loaded extension runs, and what honest-looking
calls into torch do. The grading command sets ``FSDP_AUDIT_LOG`` to ``audit.jsonl`` beside results.json; the ranks'
audit hooks report there what ran (frames, gc, native code, marshal/pickle/exec, imports, opens, sockets, fork,
signals) with the submission's file and line, and ``add_staff_review`` lists those findings next to the static flags
("runtime: TEST, rank R").

Where it shows, never to the student: the grading command prints it in its log (Gradescope shows the autograder's
output to instructors only: ``stdout_visibility`` is "hidden") and stores it in results.json under
``extra_data.staff_review`` = {"flags", "runtime", "files", "notes"} (Gradescope stores ``extra_data`` and displays
none of it); this command lists the static flags for a folder of submissions.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path

from .review_decode import Decoded, shown
from .review_instrumentation import defined_names, instrumentation_flags
from .review_rules import Review

def review_source(data: bytes | str, own: set[str] | None = None) -> list[dict]:
    """The flags of one file: ``{"line", "kind", "what", "code"}``, in line order, lines as Python numbers them.
    Bytes are read as the import reads them (their coding cookie or BOM: review_decode.py); text is taken as
    already decoded. A file that does not parse is one flag (``unreadable``): a person reads it (the tests grade
    it as it is). ``own``: the private names the whole submission defines (``own_names``); by default this
    file's."""
    decoded = Decoded(data)
    flags = list(decoded.flags)
    if decoded.runs:
        try:
            # The bytes themselves when we have them: compile() decodes them exactly as the import does.
            tree = ast.parse(data)
            visitor = Review(tree, decoded.lines)
            visitor.visit(tree)
            flags += visitor.flags
            flags += instrumentation_flags(tree, decoded.lines, own)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
            flags.append({"line": getattr(err, "lineno", 0) or 0, "kind": "unreadable",
                          "what": f"not reviewed: {type(err).__name__}: {str(err)[:200]}", "code": ""})
        except Exception as err:  # a bug of the review's own: this file is said unreviewed, the others still are
            flags.append({"line": 0, "kind": "unreadable", "code": "",
                          "what": f"the review failed on this file ({type(err).__name__}: {str(err)[:200]}): "
                                  f"read it whole"})
    # One flag per line and kind (the first found is the outermost, most telling, spelling).
    seen, out = set(), []
    for f in sorted(flags, key=lambda f: f["line"]):
        if (f["line"], f["kind"]) not in seen:
            seen.add((f["line"], f["kind"]))
            out.append(f)
    return out


MAX_FLAGS_PER_FILE = 200  # a person reads the first ones; a file with more is read whole anyway


def own_names(files: dict[str, bytes | str]) -> set[str]:
    """The private names any of a submission's files defines as its own (review_instrumentation.defined_names):
    a FlatParameter's ``_index`` set in Task 2 is the student's in Task 3 too."""
    names: set[str] = set()
    for data in files.values():
        decoded = Decoded(data)
        if decoded.runs:
            try:
                names |= defined_names(ast.parse(data))
            except Exception:  # (review_source says why a file was not reviewed)
                pass
    return names


def review_files(files: dict[str, bytes | str]) -> list[dict]:
    """Flags over several files (path -> content) of one submission, each with its ``file``; past
    MAX_FLAGS_PER_FILE in a file, one flag (``truncated``) says how many more there were, so that results.json
    stays small."""
    out = []
    own = own_names(files)
    for path, data in sorted(files.items()):
        flags = review_source(data, own)
        if len(flags) > MAX_FLAGS_PER_FILE:
            more = len(flags) - MAX_FLAGS_PER_FILE
            flags = flags[:MAX_FLAGS_PER_FILE] + [{"line": flags[MAX_FLAGS_PER_FILE]["line"], "kind": "truncated",
                                                   "what": f"{more} further flag(s) in this file are not listed: "
                                                           f"read the file", "code": ""}]
        out += [{"file": path, **f} for f in flags]
    return out


def format_flags(flags: list[dict]) -> str:
    if not flags:
        return "staff review: nothing flagged"
    return "\n".join([f"staff review: {len(flags)} line(s) for a person to read (never shown to the student):"] +
                     [f"  {f['file']}:{f['line']}: {f['kind']}: {f['what']}  |  {f['code']}" for f in flags])


def format_runtime(findings: list[dict]) -> list[str]:
    """The runtime audit's findings in the static flags' one-line form, with the test and rank that saw each."""
    out = []
    for f in findings:
        seen = f"{f['count']} times" if f.get("count", 1) > 1 else "once"
        out.append(f"  {f['file']}:{f['line']}: {f['kind']}: {f['what']}  |  {f['code']}  "
                   f"(runtime: {f['test'] or 'a test'}, rank {f['rank']}, {seen})")
    return out


# ---- the rank audit's findings (tests/rank_audit.py writes them; seams.md, seam 2) ---------------------------
MAX_RUNTIME_FINDINGS = 100  # distinct findings kept; a flood of events must not blow up results.json
MAX_AUDIT_BYTES = 8 << 20  # read no further into the audit log than this


def read_runtime(path: Path) -> tuple[list[dict], list[str]]:
    """The runtime findings in the JSON-lines file ``path`` (each ``file``, ``line``, ``kind``, ``what``, ``code``,
    ``test``, ``rank``), merged when they repeat (``count``), at most MAX_RUNTIME_FINDINGS of them; and notes on
    what was left out. A missing or unreadable file is no findings, said in one note."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_AUDIT_BYTES + 1)
    except FileNotFoundError:
        return [], [f"no runtime findings (no {path.name}: the ranks' audit found nothing to report, or was off)"]
    except OSError as err:
        return [], [f"no runtime findings (the audit log {path.name} could not be read: {err.strerror or err})"]
    notes = [f"the audit log is larger than {MAX_AUDIT_BYTES >> 20} MiB: only its start was read"] \
        if len(data) > MAX_AUDIT_BYTES else []
    merged: dict[tuple, dict] = {}
    unreadable = dropped = 0
    for raw in data[:MAX_AUDIT_BYTES].splitlines():
        try:
            item = json.loads(raw)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            unreadable += bool(raw.strip())
            continue
        line = item.get("line")
        rank = item.get("rank")
        f = {"file": shown(str(item.get("file") or ""), 200), "line": line if type(line) is int else 0,
             "kind": shown(str(item.get("kind") or "runtime"), 40), "what": shown(str(item.get("what") or ""), 300),
             "code": shown(str(item.get("code") or ""), 160), "test": shown(str(item.get("test") or ""), 200),
             "rank": rank if type(rank) is int else None, "source": "runtime"}
        key = (f["file"], f["line"], f["kind"], f["what"])
        if key in merged:
            merged[key]["count"] += 1
        elif len(merged) < MAX_RUNTIME_FINDINGS:
            merged[key] = {**f, "count": 1}
        else:
            dropped += 1
    if dropped:
        notes.append(f"{dropped} further runtime event(s) beyond the first {MAX_RUNTIME_FINDINGS} distinct "
                     f"findings were not kept")
    if unreadable:
        notes.append(f"{unreadable} line(s) of the audit log were not findings (not JSON objects)")
    return sorted(merged.values(), key=lambda f: (f["file"], f["line"], f["kind"])), notes


def add_staff_review(tree: Path, results: Path, say, audit_log: Path | None = None) -> None:
    """The staff review of the graded task files in ``tree`` and the rank audit's findings (``audit_log``, by
    default ``audit.jsonl`` beside ``results``: the file grade.py names in FSDP_AUDIT_LOG), printed through
    ``say`` (the grader's log: instructors only, stdout_visibility is "hidden") and stored in results.json's
    ``extra_data.staff_review`` = {"flags", "runtime", "files", "notes"}, which Gradescope stores and never
    displays. Never fails the run: the grades stand without it."""
    try:
        from .intake import MAX_SUBMITTED_FILE_BYTES, task_files
        files = {rel: (tree / rel).read_bytes()[:MAX_SUBMITTED_FILE_BYTES] for rel in task_files(tree)}
        flags = review_files(files)
        runtime, notes = read_runtime(audit_log or results.parent / "audit.jsonl")
        decoded = {rel: Decoded(data).lines for rel, data in files.items()}
        for f in runtime:  # the line as Python ran it, as the static flags show it (a coding cookie changes it)
            lines = decoded.get(f["file"])
            if lines and 0 < f["line"] <= len(lines):
                f["code"] = shown(lines[f["line"] - 1])
        lines = format_flags(flags).split("\n")
        if runtime:
            lines.append(f"staff review: the runtime audit reported {len(runtime)} finding(s) (never shown to "
                         f"the student):")
            lines += format_runtime(runtime)
        lines += [f"staff review: {note}" for note in notes]
        for line in lines:
            say("grade: " + line)
        data = json.loads(results.read_text())
        data.setdefault("extra_data", {})["staff_review"] = {"flags": flags, "runtime": runtime,
                                                             "files": sorted(files), "notes": notes}
        tmp = results.with_name(results.name + ".review")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, results)
    except Exception as err:  # the review is for a person; the grades stand without it
        say(f"grade: staff review failed: {type(err).__name__}: {err}")


def review_submission(entry: Path, wanted: list[str]) -> list[dict]:
    """The flags of one submission (a folder, or a zip as uploaded), its task files chosen as the grading command
    chooses them (a zip is read in memory through the same bounded reader, never extracted)."""
    import shutil
    import tempfile
    from .intake import MAX_ZIP_BYTES, find_in_zips, find_submitted
    if entry.is_dir():
        found, _ = find_submitted(entry, wanted)
        missing = [w for w in wanted if w not in found]
        if missing:
            found.update(find_in_zips(entry, missing)[0])
        return review_files(found)
    if entry.stat().st_size > MAX_ZIP_BYTES:
        return [{"file": entry.name, "line": 0, "kind": "unreadable", "what": "zip too large to open", "code": ""}]
    with tempfile.TemporaryDirectory() as alone:  # find_in_zips reads every zip of a folder: this one only
        shutil.copyfile(entry, Path(alone) / entry.name)
        return review_files(find_in_zips(Path(alone), wanted)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path,
                        help="a folder of submissions (a zip or a folder each), or task files")
    parser.add_argument("--json", type=Path, default=None, help="also write {submission: [flags]} here")
    args = parser.parse_args(argv)
    from .intake import task_files
    wanted = task_files(Path(__file__).resolve().parents[2])
    report: dict[str, list[dict]] = {}
    for path in args.paths:
        if path.is_file() and path.suffix == ".py":
            report[str(path)] = review_files({str(path): path.read_bytes()})
        elif path.is_dir():
            for entry in sorted(path.iterdir()):
                if entry.is_dir() or entry.suffix == ".zip":
                    report[entry.name] = review_submission(entry, wanted)
        else:
            parser.error(f"{path}: not a folder of submissions or a .py file")
    for name, flags in report.items():
        print(f"{shown(name)}: " + ("nothing flagged" if not flags else f"{len(flags)} flag(s)"))
        for f in flags:
            print(f"  {f['file']}:{f['line']}: {f['kind']}: {f['what']}  |  {f['code']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
