#!/usr/bin/env bash
# Build submission.zip for Gradescope: the seven task files, the writeup, and the benchmark results.
#
#   ./make_submission.sh                 check, run the public tests, write submission.zip
#   ./make_submission.sh --skip-tests    the same without running the tests (it says so)
#   ./make_submission.sh -o FILE.zip     write FILE.zip instead
#
# What goes in (an explicit list, paths relative to the repository's root; nothing else):
#   fsdp_assignment/task1_meta_init.py ... fsdp_assignment/task7_fully_shard.py   required, must compile
#   WRITEUP.md and/or writeup.pdf (both when both are there; it says which)       required
#   benchmarks/results/*.json *.md *.png                                            if present
#   bonus/*.py *.md *.json *.png                                                    if present (see the handout)
#
# It refuses (exit 1, saying what to fix) when: a task file is missing or does not compile; there is no writeup;
# writeup.pdf is not a real PDF; WRITEUP.md leaves a question or a benchmark table of WRITEUP_TEMPLATE.md empty
# (write "not answered" under it to skip it on purpose). Failing public tests never stop it (partial credit is
# credit) but are reported loudly; so are benchmark results of a --quick run. Set PYTHON to choose the
# interpreter (default: python, else python3; use the one of the virtualenv you installed the project into).

set -u
cd "$(dirname "$0")" || exit 2

OUT="submission.zip"
RUN_TESTS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --skip-tests) RUN_TESTS=0 ;;
        -o|--output) shift; OUT="${1:?-o needs a file name}" ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "make_submission.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "ERROR: no Python interpreter found. Activate the project's virtualenv (source .venv/bin/activate)" >&2
    echo "       or set PYTHON=/path/to/python." >&2
    exit 2
fi

TASK_FILES=(
    fsdp_assignment/task1_meta_init.py
    fsdp_assignment/task2_flat_param.py
    fsdp_assignment/task3_forward.py
    fsdp_assignment/task4_backward.py
    fsdp_assignment/task5_optim_ckpt.py
    fsdp_assignment/task6_prefetch.py
    fsdp_assignment/task7_fully_shard.py
)

bar() { printf '%s\n' "=================================================================================="; }

# ---- 1. Task files and writeup (plain Python: needs no torch) ---------------------------------------------
# Prints the writeup files to zip, one per line, on stdout; problems on stderr; exit 1 when one is fatal.
WRITEUP_LIST="$(mktemp "${TMPDIR:-/tmp}/fsdp-writeup-XXXXXX")"
"$PYTHON" - "${TASK_FILES[@]}" >"$WRITEUP_LIST" <<'PY'
import re, sys
from pathlib import Path

task_files = sys.argv[1:]
errors, notes = [], []

# Task files: present, and they compile (a syntax error costs that task and every task that imports it).
for f in task_files:
    p = Path(f)
    if not p.is_file():
        errors.append(f"{f} is missing (restore the stub with: git checkout -- {f})")
        continue
    try:
        compile(p.read_bytes(), f, "exec", dont_inherit=True)
    except SyntaxError as err:
        where = f"{f}:{err.lineno}" + (f":{err.offset}" if err.offset else "")
        line = (err.text or "").rstrip()
        errors.append(f"{f} does not compile: {where}: {err.msg}" + (f"\n      {line}" if line else "")
                      + f"\n    (check it with: python -m py_compile {f})")
    except ValueError as err:  # e.g. a NUL byte
        errors.append(f"{f} does not compile: {err}")

# writeup.pdf: a real PDF (a renamed text file or an empty export is not one).
PDF_MIN_BYTES = 1000
pdf = Path("writeup.pdf")
pdf_ok = False
if pdf.is_file():
    data = pdf.read_bytes()
    why = None
    if not data.startswith(b"%PDF-"):
        why = "it does not start with %PDF- (is it really a PDF, not a renamed file?)"
    elif len(data) < PDF_MIN_BYTES:
        why = f"it is only {len(data)} bytes: too small to hold a writeup (export it again)"
    elif b"%%EOF" not in data[-1024:]:
        why = "it has no %%EOF at its end: the file is truncated (export it again)"
    if why:
        errors.append(f"writeup.pdf is not a valid PDF: {why}")
    else:
        pdf_ok = True

# WRITEUP.md: every question (**Q7.**) and every benchmark table of WRITEUP_TEMPLATE.md needs an answer of its
# own: a line that is not in the template (comments and the template's own lines do not count).
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
QUESTION = re.compile(r"^\*\*(Q\d+)\.?\*\*")
SEPARATOR = re.compile(r"\|[\s|:-]*\|")


def deliverables(text):
    """Deliverable -> the lines of its block: a question's block runs to the next question or heading; a table
    section's block (a '## ' heading whose block starts with a table) runs from its heading to its first question."""
    out, current, section = {}, None, None
    for line in COMMENT.sub("", text).splitlines():
        s = line.strip()
        m = QUESTION.match(s)
        if s.startswith("## "):
            section, current = s[3:].strip(), f"table:{s[3:].strip()}"
            out[current] = []
            continue
        if s.startswith("# "):
            current = None
            continue
        if m:
            current = m.group(1)
            out[current] = [s]
            continue
        if current is not None:
            out[current].append(s)
    return out


def empty_tables(blocks):
    """The '## ' sections whose block holds tables with headers only (the benchmark sections, where rows are to
    be pasted); a table with rows of its own (the summary) is not asked for."""
    keep = {}
    for key, lines in blocks.items():
        if not key.startswith("table:"):
            keep[key] = lines
            continue
        rows = [i for i, x in enumerate(lines) if x.startswith("|")]
        separators = [i for i in rows if SEPARATOR.fullmatch(lines[i])]
        headers = [i - 1 for i in separators]
        if separators and all(i in separators or i in headers for i in rows):
            keep[key] = lines
    return keep


md = Path("WRITEUP.md")
template_path = Path("WRITEUP_TEMPLATE.md")
md_state = None  # None (absent), "complete", "partial", "empty"
empty = []
if md.is_file():
    text = md.read_text(encoding="utf-8", errors="replace")
    template = template_path.read_text(encoding="utf-8") if template_path.is_file() else ""
    template_lines = {s.strip() for s in COMMENT.sub("", template).splitlines() if s.strip()}
    wanted = empty_tables(deliverables(template)) if template else {}
    got = deliverables(text)
    if not wanted:  # no template to compare with: judge the questions WRITEUP.md itself has
        wanted = {k: v for k, v in got.items() if not k.startswith("table:")}
    for key in wanted:
        lines = got.get(key)
        name = f"the {key[6:]} table" if key.startswith("table:") else key
        if lines is None:
            empty.append(f"{name} (not found: keep the template's headings and question numbers)")
            continue
        answer = [s for s in lines if s and s not in template_lines and not SEPARATOR.fullmatch(s)]
        if not answer:
            empty.append(name)
    if not wanted:
        md_state = "empty" if not text.strip() else "complete"
    elif not empty:
        md_state = "complete"
    else:
        md_state = "empty" if len(empty) == len(wanted) else "partial"

take = []
if md_state is None and not pdf.is_file():
    errors.append("no writeup (WRITEUP.md or writeup.pdf): copy WRITEUP_TEMPLATE.md to WRITEUP.md and fill it in"
                  " (or export writeup.pdf)")
elif md_state in ("complete",):
    take.append("WRITEUP.md")
elif md_state in ("partial", "empty") and not pdf_ok:
    hint = ("it is still the empty template" if md_state == "empty" else f"{len(empty)} of its deliverables are empty")
    errors.append(f"WRITEUP.md: {hint}. No answer yet for:\n      " + "\n      ".join(empty)
                  + "\n    Write your answer under each (for a table: paste the rows the benchmark printed), or"
                    " 'not answered'\n    to leave one out on purpose.")
elif md_state == "partial":
    take.append("WRITEUP.md")
    notes.append("WARNING: WRITEUP.md leaves these empty (taken anyway, next to writeup.pdf): " + ", ".join(empty))
elif md_state == "empty":
    notes.append("note: WRITEUP.md has no answers (still the template): only writeup.pdf is taken.")
if pdf_ok:
    take.append("writeup.pdf")

if errors:
    print("=" * 82, file=sys.stderr)
    print("ERROR: cannot build the submission:", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)
    print("=" * 82, file=sys.stderr)
    sys.exit(1)
for n in notes:
    print(n, file=sys.stderr)
print(f"Writeup: taking {' and '.join(take)}"
      + (" (both are there: the graders read both)" if len(take) == 2 else ""), file=sys.stderr)
print("\n".join(take))
PY
rc=$?
WRITEUPS=()
while IFS= read -r line; do [ -n "$line" ] && WRITEUPS+=("$line"); done <"$WRITEUP_LIST"   # bash 3.2 (macOS): no mapfile
rm -f "$WRITEUP_LIST"
if [ $rc -ne 0 ]; then
    exit 1
fi

# ---- 2. Public tests (reported, never fatal) -------------------------------------------------------------
TEST_STATUS="not run (--skip-tests)"
if [ "$RUN_TESTS" = 1 ] && ! "$PYTHON" -c "import torch, pytest" >/dev/null 2>&1; then
    TEST_STATUS="NOT RUN: $PYTHON cannot import torch and pytest"
    bar
    echo "!!! '$PYTHON' cannot import torch and pytest, so the public tests cannot run. Did you forget to activate"
    echo "!!! the virtualenv you installed the project into?   source .venv/bin/activate   (then run this again),"
    echo "!!! or PYTHON=.venv/bin/python ./make_submission.sh.  The submission is built anyway, untested."
    bar
    RUN_TESTS=0
fi
if [ "$RUN_TESTS" = 1 ]; then
    echo "Running the public tests (python -m pytest tests/public -m \"not bonus\"; the bonus tests: python -m pytest -m bonus); this takes a few minutes..."
    JUNIT="$(mktemp "${TMPDIR:-/tmp}/fsdp-public-XXXXXX.xml")"
    "$PYTHON" -m pytest tests/public -m "not bonus" -q --tb=line -rfE -p no:cacheprovider --junitxml="$JUNIT"
    rc=$?
    bar
    if [ $rc -eq 0 ]; then
        TEST_STATUS="all public tests pass"
        echo "Public tests: ALL PASSED"
    elif [ $rc -eq 1 ]; then
        TEST_STATUS="SOME PUBLIC TESTS FAIL"
        echo "!!! SOME PUBLIC TESTS FAIL. The submission is built anyway, but failing public tests lose points"
        echo "!!! (and hidden tests check the same behaviour). Details: python -m pytest -m taskN"
    else
        TEST_STATUS="THE PUBLIC TESTS DID NOT RUN CLEANLY (pytest exit code $rc)"
        echo "!!! The public tests did not run cleanly (pytest exit code $rc: collection error, interrupt or"
        echo "!!! internal error). The submission is built anyway; look at the output above."
    fi
    # Per-task summary from the JUnit report (test files are tests/public/test_taskN_*.py).
    "$PYTHON" - "$JUNIT" <<'PY' || true
import re, sys, xml.etree.ElementTree as ET
from collections import defaultdict
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    sys.exit(0)
counts = defaultdict(lambda: [0, 0])
for case in root.iter("testcase"):
    m = re.search(r"test_task(\d)", case.get("classname", "") + " " + case.get("file", ""))
    key = f"Task {m.group(1)}" if m else "other"
    if any(child.tag == "skipped" for child in case):
        continue
    counts[key][1] += 1
    if not any(child.tag in ("failure", "error") for child in case):
        counts[key][0] += 1
for key in sorted(counts):
    passed, total = counts[key]
    flag = "" if passed == total else "   <-- FAILING"
    print(f"  {key:7s} {passed:3d}/{total:<3d} passed{flag}")
PY
    rm -f "$JUNIT"
    bar
fi

# ---- 3. The zip -----------------------------------------------------------------------------------------
"$PYTHON" - "$OUT" "$TEST_STATUS" "${#WRITEUPS[@]}" "${WRITEUPS[@]}" "${TASK_FILES[@]}" <<'PY'
from __future__ import annotations  # an older python (no torch, say) still writes the zip
import json, sys, zipfile
from pathlib import Path

out, test_status, n_writeups, *rest = sys.argv[1:]
writeups, task_files = rest[:int(n_writeups)], rest[int(n_writeups):]
optional = []
for folder, patterns in (("benchmarks/results", ("*.json", "*.md", "*.png")),
                         ("bonus", ("*.py", "*.md", "*.json", "*.png"))):
    for pattern in patterns:
        optional += sorted(p.as_posix() for p in Path(folder).glob(pattern) if p.is_file())
files = task_files + writeups + optional

big = [f for f in files if Path(f).stat().st_size > 5 * 2**20]
out_path = Path(out)
tmp = out_path.with_name(out_path.name + ".partial")
with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for f in files:
        zf.write(f, arcname=f)
tmp.replace(out_path)


def quick_run(path: Path) -> str | None:
    """Why a benchmark result is a --quick smoke run (tiny sizes: its numbers measure nothing), or None: the
    benchmarks label them (a top-level "quick": true in the JSON, "--quick" in the markdown)."""
    if path.suffix == ".md":
        return "it says --quick" if "--quick" in path.read_text(errors="replace") else None
    try:
        raw = json.loads(path.read_text())
        config = raw.get("config", {})
    except (ValueError, AttributeError):
        return None
    if raw.get("quick"):
        return "it says quick"
    if not isinstance(config, dict):
        return None
    if config.get("quick"):
        return "its config says quick"
    return None


print("Files in the submission:")
for f in files:
    print(f"  {Path(f).stat().st_size:>10,d} B  {f}")
results = [f for f in files if f.startswith("benchmarks/results/")]
if not results:
    print("WARNING: no benchmark results (benchmarks/results/*.json, *.md, *.png). Run the benchmarks: their tables")
    print("         belong in your writeup, and the results in the zip.")
    if any(Path("benchmarks/results/quick").glob("*.json")):
        print("         (benchmarks/results/quick/ holds a --quick smoke run only: its numbers mean nothing and it is")
        print("         not zipped. Run python benchmarks/run_all.py without --quick.)")
quick = [(f, why) for f in results if f.endswith((".json", ".md")) for why in [quick_run(Path(f))] if why]
if quick:
    print("WARNING: these benchmark results come from a --quick smoke run (tiny sizes; the numbers mean nothing):")
    for f, why in quick:
        print(f"           {f} ({why})")
    print("         Run python benchmarks/run_all.py without --quick and paste its tables into your writeup.")
for f in big:
    print(f"WARNING: {f} is larger than 5 MiB; is it meant to be there?")

# Images WRITEUP.md shows (Markdown ![..](path) or <img src="path">): a local one the zip does not hold is missing
# for the graders (Q12 without its picture earns half of each part). benchmarks/results/step_timeline.png itself is
# zipped above, and counts as the picture.
import re
if "WRITEUP.md" in writeups:
    md_text = Path("WRITEUP.md").read_text(encoding="utf-8", errors="replace")
    links = re.findall(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)", md_text)
    links += re.findall(r"<img\b[^>]*\bsrc\s*=\s*[\"']([^\"']+)[\"']", md_text, flags=re.IGNORECASE)
    zipped_set = set(files)
    for link in dict.fromkeys(links):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, flags=re.IGNORECASE) or link.startswith("#"):
            continue  # a URL (http:, data:): not a file of the repository
        rel = Path(link.split("#")[0].split("?")[0])
        where = rel.as_posix()
        try:
            where = (Path.cwd() / rel).resolve().relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            pass  # outside the repository: certainly not zipped
        if where in zipped_set:
            continue
        exists = (Path.cwd() / rel).is_file()
        print(f"WARNING: WRITEUP.md shows the image {link}, which "
              + ("is not in the zip (only benchmarks/results/*.png and bonus/*.png are taken)" if exists
                 else "does not exist") + ": the graders will not see it.")
        print("         Put the image in benchmarks/results/ and link it from there (e.g. "
              "![timeline](benchmarks/results/step_timeline.png)), or export writeup.pdf with the image in it.")
for f in task_files:
    left = Path(f).read_text(encoding="utf-8", errors="replace").count('raise NotImplementedError("Task ')
    if left:
        print(f"WARNING: {f} still has {left} unimplemented function(s) (raise NotImplementedError).")
size = out_path.stat().st_size
print(f"Wrote {out_path} ({size:,d} bytes, {size / 2**20:.2f} MiB). Public tests: {test_status}.")
print("Upload it to Gradescope.")
PY
rc=$?
if [ $rc -ne 0 ]; then
    echo "ERROR: could not write $OUT." >&2
    exit 1
fi
