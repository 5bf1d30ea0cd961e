"""Build the Gradescope autograder bundle.

    python -m staff.autograder.build_bundle --out dist/autograder.zip
    python -m staff.autograder.build_bundle --stage DIR      # only lay out the staff tree in DIR (CI uses this)

The zip holds, at its root, ``setup.sh`` (Gradescope runs it once, as root, to build the image: a Python >= 3.11
virtualenv in /autograder/venv with torch 2.13.0 from PyTorch's CPU wheel index, pytest and pytest-timeout, and
the unprivileged user ``fsdp_student`` that rank bodies run as) and ``run_autograder`` (run for each submission:
``python -m staff.autograder.grade --autograder-root /autograder`` from /autograder/source), and the staff tree
the grader needs: ``adapters.py``, ``pyproject.toml``, the package with the **stubs** and the provided support
code, the tests (public, hidden, the harness, conftest, the points table) and the package ``staff.autograder``'s
grading files (the plugin and its parts, the command). Never the reference solution: the build
checks that (``check_no_reference``) and refuses to write a bundle that fails it.

Environment knobs of the two scripts (for the staff's CI; Gradescope needs none):
``AUTOGRADER_ROOT`` (default /autograder), ``FSDP_AUTOGRADER_SKIP_INSTALL=1`` (setup.sh installs nothing: use
the Python already there), ``FSDP_AUTOGRADER_NO_USERADD=1`` (setup.sh creates no user),
``FSDP_AUTOGRADER_PYTHON`` (the interpreter run_autograder uses), ``FSDP_AUTOGRADER_TIMEOUT`` (seconds for the
whole grading run, default 540: keep it a minute under the assignment's Gradescope time limit).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import stat
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK_USER = "fsdp_student"
TORCH_VERSION = "2.13.0"
PYTEST_VERSION = "9.0.3"
PYTEST_TIMEOUT_VERSION = "2.4.0"
# torch.distributed's object collectives (broadcast_object_list, used by the checkpoint tests) need numpy at
# run time, although torch does not depend on it: without it two tests fail with "Numpy is not available".
NUMPY_VERSION = "2.4.6"

# What the grader needs, as globs relative to the repository root.
BUNDLE_GLOBS = (
    "adapters.py",
    "pyproject.toml",
    "fsdp_assignment/__init__.py",
    "fsdp_assignment/task[0-9]_*.py",
    "fsdp_assignment/support/*.py",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/harness.py",
    "tests/harness_*.py",  # the harness's rooms (starting ranks, the witness, ...)
    "tests/rank_*.py",     # what runs inside and around a rank (isolation, cgroup, audit)
    "tests/points.py",
    "tests/public/*.py",
    "tests/hidden/*.py",
    "tests/hidden/scenarios/*.py",
    "staff/autograder/__init__.py",
    "staff/autograder/grading_plugin.py",
    "staff/autograder/grading_selection.py",  # the plugin's parts (grading_plugin.py imports them)
    "staff/autograder/grading_limits.py",
    "staff/autograder/grading_results.py",
    "staff/autograder/grade.py",
    "staff/autograder/intake.py",  # which files of a submission provide the task files (grade.py, review.py)
    "staff/autograder/rank_user.py",  # whether the rank user can run the ranks here (grade.py)
    "staff/autograder/student_limits.py",  # the per-student memory watch the grading plugin runs
    "staff/autograder/cleanup.py",  # what is removed after every test (grading_plugin.py, grade.py)
    "staff/autograder/sanitize.py",  # every line the grader prints and every output in results.json
    "staff/autograder/review.py",  # the staff review grade.py adds to results.json (extra_data) and its log
    "staff/autograder/review_*.py",  # its parts: decoding as Python does, names and scopes, the rules
    "staff/autograder/test_times.json",  # per-test time limits and the calls that decide hang probes (grading_plugin.py)
)

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, while it builds the autograder image (see build_bundle.py).
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
RANK_USER="__RANK_USER__"

if [ "${FSDP_AUTOGRADER_SKIP_INSTALL:-0}" != 1 ]; then
    PY=""
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            PY="$candidate"; break
        fi
    done
    if [ -z "$PY" ]; then  # Ubuntu 22.04 ships 3.10; 3.11 is in its archive
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3.11 python3.11-venv
        PY=python3.11
    fi
    "$PY" -m venv "$ROOT/venv"
    "$ROOT/venv/bin/python" -m pip install --no-cache-dir --upgrade pip
    # The CPU build of torch, from PyTorch's CPU wheel index (no CUDA libraries: the grader has no GPU).
    "$ROOT/venv/bin/python" -m pip install --no-cache-dir "torch==__TORCH__" \
        --index-url https://download.pytorch.org/whl/cpu
    "$ROOT/venv/bin/python" -m pip install --no-cache-dir "pytest==__PYTEST__" "pytest-timeout==__PYTEST_TIMEOUT__" \
        "numpy==__NUMPY__"
    chmod -R a+rX "$ROOT/venv"
fi

# Rank bodies (the student's code) run as this unprivileged user: it can read the grader, write nothing of it.
if [ "$(id -u)" = 0 ] && [ "${FSDP_AUTOGRADER_NO_USERADD:-0}" != 1 ] && ! id "$RANK_USER" >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin "$RANK_USER" 2>/dev/null ||
        adduser --system --no-create-home --disabled-login "$RANK_USER" ||
        echo "setup.sh: could not create user $RANK_USER; rank bodies will run as root" >&2
fi
chmod a+rx "$ROOT" 2>/dev/null || true
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission, as root (see build_bundle.py). It always leaves results.json.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${FSDP_AUTOGRADER_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/venv/bin/python" ]; then PY="$ROOT/venv/bin/python"; else PY=python3; fi
fi
cd "$ROOT/source" || exit 1  # the grading command is a module of the staff tree's package staff.autograder
exec "$PY" -m staff.autograder.grade --autograder-root "$ROOT" \
    --timeout "${FSDP_AUTOGRADER_TIMEOUT:-540}" --rank-user "__RANK_USER__" "$@"
"""


def bundle_files(root: Path = ROOT) -> list[str]:
    """The repository files the bundle ships (POSIX paths relative to ``root``), sorted."""
    out = set()
    for pattern in BUNDLE_GLOBS:
        matches = [p for p in root.glob(pattern) if p.is_file()]
        if not matches and "*" not in pattern:
            raise FileNotFoundError(f"bundle: {pattern} is missing")
        out.update(p.relative_to(root).as_posix() for p in matches)
    return sorted(out)


def scripts() -> dict[str, str]:
    fill = {"__RANK_USER__": RANK_USER, "__TORCH__": TORCH_VERSION, "__PYTEST__": PYTEST_VERSION,
            "__PYTEST_TIMEOUT__": PYTEST_TIMEOUT_VERSION, "__NUMPY__": NUMPY_VERSION}
    out = {}
    for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
        for key, value in fill.items():
            text = text.replace(key, value)
        out[name] = text
    return out


def stage(dest: Path, root: Path = ROOT) -> list[str]:
    """Lay the bundle's staff tree out in ``dest`` (no scripts); return its files."""
    files = bundle_files(root)
    for rel in files:
        target = Path(dest) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, target)
    return files


# ---- no reference inside ---------------------------------------------------------------------------------
def _reference_lines(root: Path) -> dict[str, set[str]]:
    """Per reference task file: its code lines (normalized, 20+ characters, no docstrings or comments) that
    its stub does not have, i.e. the solution's own code."""
    from staff import make_stubs
    out: dict[str, set[str]] = {}
    for path in sorted((root / "fsdp_assignment" / "reference").glob("task[0-9]_*.py")):
        text = path.read_text(encoding="utf-8")
        stub = make_stubs.make_stub(path, int(re.search(r"task(\d)", path.name).group(1)))
        stub_lines = {_norm(line) for line in stub.splitlines()}
        docstring_lines = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                docstring_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        lines = set()
        for n, line in enumerate(text.splitlines(), 1):
            norm = _norm(line)
            if n in docstring_lines or norm.startswith("#") or len(norm) < 20 or norm in stub_lines:
                continue
            lines.add(norm)
        out[path.name] = lines
    return out


def _norm(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("  #")[0]).strip()


# A file "holds" a reference task file when it has this many of that file's own code lines: a copy, even an
# edited one, has most of them; the public tests share a handful of plain lines (hand-wiring units, say).
LEAK_MIN_LINES = 10
LEAK_MIN_FRACTION = 0.3


def check_no_reference(files: dict[str, bytes], root: Path = ROOT) -> list[str]:
    """Problems if the bundle's ``files`` (name -> content) contain any of the reference: a path that names
    it, a task file that is not exactly its generated stub, or (any file) a large share of a reference task
    file's own code lines."""
    problems = []
    from staff import make_stubs
    stubs = {p.relative_to(root).as_posix(): text for p, text in make_stubs.stub_files().items()}
    for name in files:
        if "reference" in name.lower():
            problems.append(f"{name}: the path names the reference")
    for rel, text in stubs.items():
        data = files.get(rel)
        if data is None:
            problems.append(f"{rel}: missing (the stub must be there)")
        elif data.decode("utf-8", errors="replace") != text:
            problems.append(f"{rel}: not the generated stub (python staff/make_stubs.py)")
    reference = _reference_lines(root)
    for name, data in files.items():
        lines = {_norm(x) for x in data.decode("utf-8", errors="replace").splitlines()}
        for ref_name, ref_lines in reference.items():
            hits = lines & ref_lines
            if ref_lines and len(hits) >= min(len(ref_lines), max(LEAK_MIN_LINES,
                                                                 LEAK_MIN_FRACTION * len(ref_lines))):
                problems.append(f"{name}: holds {len(hits)} of the {len(ref_lines)} code lines of the "
                                f"reference's {ref_name}")
    return problems


def build(out: Path, root: Path = ROOT) -> list[str]:
    """Write the bundle to ``out``; return its entries. Raises SystemExit if it would contain the reference."""
    files = {rel: (root / rel).read_bytes() for rel in bundle_files(root)}
    entries = {**{k: v.encode() for k, v in scripts().items()}, **files}
    problems = check_no_reference(entries, root)
    if problems:
        raise SystemExit("build_bundle: refusing to build:\n  " + "\n  ".join(problems))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            executable = name in ("setup.sh", "run_autograder")
            info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, entries[name])
    os.replace(tmp, out)
    return sorted(entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "autograder.zip")
    parser.add_argument("--stage", type=Path, default=None, help="only lay out the staff tree in this directory")
    args = parser.parse_args(argv)
    if args.stage is not None:
        files = stage(args.stage)
        print(f"staged {len(files)} files in {args.stage}")
        return 0
    entries = build(args.out)
    print(f"wrote {args.out} ({len(entries)} entries, {args.out.stat().st_size} bytes); no reference inside")
    return 0


if __name__ == "__main__":
    sys.exit(main())
