#!/usr/bin/env bash
# Build submission.zip for Gradescope: the seven task files, the writeup, and the benchmark results.
#
#   ./make_submission.sh                 run the public tests, check the writeup, write submission.zip
#   ./make_submission.sh --skip-tests    the same without running the tests (it says so)
#   ./make_submission.sh -o FILE.zip     write FILE.zip instead
#
# What goes in (an explicit list, paths relative to the repository's root; nothing else):
#   fsdp_assignment/task1_meta_init.py ... fsdp_assignment/task7_fully_shard.py   required
#   WRITEUP.md, or writeup.pdf when there is no WRITEUP.md                          required
#   benchmarks/results/*.json *.md *.png                                            if present
#   bonus/*.py *.md *.json *.png                                                    if present (see the handout)
#
# Failing public tests never stop the submission (partial credit is credit), but they are reported loudly.
# The script exits non-zero only when something required is missing or the zip cannot be written.
# Set PYTHON to choose the interpreter (default: python, else python3).

set -u
cd "$(dirname "$0")" || exit 2

OUT="submission.zip"
RUN_TESTS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --skip-tests) RUN_TESTS=0 ;;
        -o|--output) shift; OUT="${1:?-o needs a file name}" ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "make_submission.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "ERROR: no Python interpreter found (set PYTHON=/path/to/python)." >&2
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
missing=()

# ---- 1. Required files ----------------------------------------------------------------------------------
for f in "${TASK_FILES[@]}"; do
    [ -f "$f" ] || missing+=("$f")
done
WRITEUP=""
if [ -f WRITEUP.md ]; then
    WRITEUP=WRITEUP.md
elif [ -f writeup.pdf ]; then
    WRITEUP=writeup.pdf
else
    missing+=("WRITEUP.md or writeup.pdf (copy WRITEUP_TEMPLATE.md to WRITEUP.md and fill it in)")
fi
if [ "$WRITEUP" = WRITEUP.md ] && [ -f WRITEUP_TEMPLATE.md ] && cmp -s WRITEUP.md WRITEUP_TEMPLATE.md; then
    missing+=("a filled-in WRITEUP.md (it is still identical to WRITEUP_TEMPLATE.md)")
fi
if [ ${#missing[@]} -gt 0 ]; then
    {
        bar
        echo "ERROR: cannot build the submission; missing:"
        for m in "${missing[@]}"; do echo "  - $m"; done
        bar
    } >&2
    exit 1
fi

# ---- 2. Public tests (reported, never fatal) -------------------------------------------------------------
TEST_STATUS="not run (--skip-tests)"
if [ "$RUN_TESTS" = 1 ]; then
    echo "Running the public tests (python -m pytest tests/public); this takes a few minutes..."
    JUNIT="$(mktemp "${TMPDIR:-/tmp}/fsdp-public-XXXXXX.xml")"
    "$PYTHON" -m pytest tests/public -q --tb=line -rfE -p no:cacheprovider --junitxml="$JUNIT"
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
"$PYTHON" - "$OUT" "$WRITEUP" "$TEST_STATUS" "${TASK_FILES[@]}" <<'PY'
import sys, zipfile
from pathlib import Path

out, writeup, test_status, *task_files = sys.argv[1:]
optional = []
for folder, patterns in (("benchmarks/results", ("*.json", "*.md", "*.png")),
                         ("bonus", ("*.py", "*.md", "*.json", "*.png"))):
    for pattern in patterns:
        optional += sorted(p.as_posix() for p in Path(folder).glob(pattern) if p.is_file())
files = task_files + [writeup] + optional

big = [f for f in files if Path(f).stat().st_size > 5 * 2**20]
out_path = Path(out)
tmp = out_path.with_name(out_path.name + ".partial")
with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for f in files:
        zf.write(f, arcname=f)
tmp.replace(out_path)

print("Files in the submission:")
for f in files:
    print(f"  {Path(f).stat().st_size:>10,d} B  {f}")
if not any(f.startswith("benchmarks/results/") for f in files):
    print("WARNING: no benchmark results (benchmarks/results/*.json, *.md, *.png). Run the benchmarks: their tables")
    print("         belong in your writeup, and the results in the zip.")
for f in big:
    print(f"WARNING: {f} is larger than 5 MiB; is it meant to be there?")
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
