"""Build the student repository from this (staff) repository.

    python staff/release.py DEST            # write the release into DEST (must not exist, or be empty)
    python staff/release.py DEST --force    # replace an existing DEST (deleted first)
    python staff/release.py DEST --git      # also `git init` DEST and commit everything ("Initial release")
    python staff/release.py --check DEST    # only run the static checks on an existing release
    python staff/release.py DEST --with-reference   # staff only: the release with the reference's task files
                                                    # over the stubs (to run it end to end); never ship it

What goes in: every file git tracks here (working-tree content; untracked and ignored files never go in, so no
caches, results, virtualenvs or checkpoints), minus the staff-only paths in ``EXCLUDED``: the reference solution
(``fsdp_assignment/reference/``), the hidden tests (``tests/hidden/``), staff checks (``tests/staff/``), staff
tooling (``staff/``), CI (``.ci/``) and the handout's source (``handout/``; the built ``handout.pdf`` goes in).

Transformations, applied to every released text file:

- Staff-only lines are dropped. Mark a line with a trailing ``# staff-only``, or a block with
  ``# staff-only-begin`` ... ``# staff-only-end`` (``<!-- staff-only-begin -->`` ... ``<!-- staff-only-end -->``
  in Markdown). A block may carry a release-only alternative: ``# staff-only-begin`` / staff lines /
  ``# staff-only-else`` / lines commented out with ``# `` / ``# staff-only-end``; the release keeps the
  alternative, uncommented.
- ``adapters.py``: ``implementation()`` and ``_task()`` are replaced by versions that know only the student's task
  files, and the module docstring's lines about the reference are replaced by one line about ``FSDP_IMPL``.
- The stubs' generated-file header (it names the staff tool that generates them) becomes a plain instruction.
- ``"fsdp_assignment.reference"`` items are removed from tuples and lists (e.g. import guards).
- Markdown (the README): sections whose heading says "staff" are dropped, table rows that describe only
  staff-only paths are dropped, and code-block lines and parenthetical remarks that mention the reference go
  (``transform_markdown``). Markers are clearer: prefer them.

Then ``check_release`` (also run by ``--check`` and by ``tests/staff/test_release.py``) fails when: a staff-only
path is present; the writeup's answer key (``staff/answer_key/``, marked ``STAFF ANSWER KEY``) is anywhere in it;
a released file mentions or imports the reference (``MENTION`` below, with a short allowlist for
the plain-English use of the word, e.g. "a reference to"); ``handout.pdf``, a task stub, ``make_submission.sh``
or ``WRITEUP_TEMPLATE.md`` is missing; the hints (``hints/``) are incomplete (``hint_problems``); a Python file
does not compile; or ``adapters.implementation()`` does not default to ``student`` in the release.

Before building, the handout's staleness check (``staff/build_handout.py --check``) must pass (``--allow-stale``
skips it, with a warning).

``reference_task_files()`` gives the reference's seven task files rewritten for the student layout
(``from ..support`` -> ``from .support``): ``tests/staff/test_release.py`` drops them into a release to check that
its public tests pass, and ``--with-reference`` does the same here (staff use only: never ship that).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths (relative, POSIX) that never go into the release: a directory ends with "/".
EXCLUDED = (
    "fsdp_assignment/reference/",
    "tests/hidden/",
    "tests/staff/",
    "staff/",
    "autograder/",
    ".ci/",
    "handout/",
    ".github/",
)
REQUIRED = (
    "README.md",
    "CHANGELOG.md",
    "docs/collectives_demo.py",
    "pyproject.toml",
    "adapters.py",
    "handout.pdf",
    "WRITEUP_TEMPLATE.md",
    "make_submission.sh",
    "hints/README.md",
    "fsdp_assignment/__init__.py",
    "fsdp_assignment/task1_meta_init.py",
    "fsdp_assignment/task2_flat_param.py",
    "fsdp_assignment/task3_forward.py",
    "fsdp_assignment/task4_backward.py",
    "fsdp_assignment/task5_optim_ckpt.py",
    "fsdp_assignment/task6_prefetch.py",
    "fsdp_assignment/task7_fully_shard.py",
)
TASK_FILES = [p for p in REQUIRED if re.fullmatch(r"fsdp_assignment/task\d_\w+\.py", p)]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".yaml", ".yml", ".json", ".typ", ""}

# A released file must not mention or import the reference solution. The word "reference" alone is ordinary
# English ("keeps a reference to"): the allowlist names those uses; any other occurrence is a finding.
MENTION = re.compile(r"\breference\b", re.IGNORECASE)
ALLOWED_MENTIONS = re.compile(
    r"\b(a|any|no|one|strong|weak|extra|the last|its|their|circular|dangling|stale)\s+references?\s+(to|cycles?|count)\b"
    r"|\breferences?\s+(to|count|counting|cycles?)\b"
    r"|\b(not|never|to|must|may|can|could|would|will|should|still|also)\s+reference\b"
    r"|\bby\s+reference\b|\bweak\s*ref|\breferenced\b|\bdereference",
    re.IGNORECASE,
)


# ---- Which files --------------------------------------------------------------------------------------
def _excluded(rel: str) -> bool:
    return any(rel == e.rstrip("/") or rel.startswith(e) for e in EXCLUDED)


def tracked_files(root: Path = ROOT) -> list[str]:
    """Files git tracks in ``root`` that exist in the working tree (POSIX paths relative to ``root``)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"release: {root} is not a git checkout ({err}); the release is built from tracked files")
    files = [f for f in out.decode().split("\0") if f]
    return sorted(f for f in files if (root / f).is_file())


def released_files(root: Path = ROOT) -> list[str]:
    return [f for f in tracked_files(root) if not _excluded(f)]


# ---- Transformations ----------------------------------------------------------------------------------
_BLOCK = re.compile(r"^\s*(#|<!--)\s*staff-only-(begin|else|end)\b")
_LINE = re.compile(r"\s*#\s*staff-only\s*$")


def strip_staff_only(text: str, rel: str = "?") -> str:
    out: list[str] = []
    state = None  # None, "staff" (dropping), "else" (keeping, uncommented)
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        m = _BLOCK.match(line)
        if m:
            kind = m.group(2)
            if kind == "begin" and state is None:
                state = "staff"
            elif kind == "else" and state == "staff":
                state = "else"
            elif kind == "end" and state in ("staff", "else"):
                state = None
            else:
                raise ValueError(f"{rel}:{n}: unbalanced staff-only-{kind}")
            continue
        if state == "staff":
            continue
        if state == "else":
            out.append(re.sub(r"^(\s*)# ?", r"\1", line, count=1))
            continue
        if _LINE.search(line.rstrip("\n")):
            continue
        out.append(line)
    if state is not None:
        raise ValueError(f"{rel}: staff-only-begin without staff-only-end")
    return "".join(out)


_STUDENT_IMPLEMENTATION = '''def implementation() -> str:
    """The implementation the adapters forward to: ``"student"``, your task files."""
    impl = os.environ.get("FSDP_IMPL", "").strip().lower()
    if impl not in ("", "student"):
        raise ValueError(f"FSDP_IMPL={impl!r}: this repository has one implementation, FSDP_IMPL=student")
    return "student"
'''
_STUDENT_TASK = '''def _task(n: int):
    return importlib.import_module(f"fsdp_assignment.{TASK_MODULES[n]}")
'''


def _replace_function(text: str, name: str, new_source: str, rel: str) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            lines = text.splitlines(keepends=True)
            start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            return "".join(lines[:start]) + new_source + "".join(lines[node.end_lineno:])
    raise ValueError(f"{rel}: no top-level function {name}() to replace for the release")


def transform_adapters(text: str) -> str:
    text = _replace_function(text, "implementation", _STUDENT_IMPLEMENTATION, "adapters.py")
    text = _replace_function(text, "_task", _STUDENT_TASK, "adapters.py")
    # The module docstring: drop the lines that talk about the reference (FSDP_IMPL=student stays).
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        lines = text.splitlines(keepends=True)
        doc = lines[first.lineno - 1:first.end_lineno]
        doc = [line for line in doc if not (MENTION.search(line) and not ALLOWED_MENTIONS.search(line))]
        doc = re.sub(r"\n(\s*\n){2,}", "\n\n", "".join(doc))
        text = "".join(lines[:first.lineno - 1]) + doc + "".join(lines[first.end_lineno:])
    return text


_STUB_HEADER = re.compile(r"^# This file is generated from the staff reference.*?\n(?:#(?!\s*$).*\n)*", re.MULTILINE)
_STUB_HEADER_RELEASE = ("# The signatures and docstrings are the specification. Replace each `raise NotImplementedError`\n"
                        "# with your code; you may add private helpers (names starting with `_`).\n")


def _code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def transform_markdown(text: str) -> str:
    """Generic rules for Markdown files written for the staff repo (markers are preferred; these catch the
    rest): drop sections whose heading says "staff"; drop table rows whose first cell names only staff-only
    paths, and staff-only paths from a first cell that also names released ones; drop lines in code blocks and
    parenthetical remarks that mention the reference."""
    out: list[str] = []
    skip_level = None
    in_code = False
    for line in text.splitlines(keepends=True):
        heading = re.match(r"^(#{1,6})\s+(.*)", line)
        if heading and not in_code:
            level = len(heading.group(1))
            if skip_level is not None and level <= skip_level:
                skip_level = None
            if skip_level is None and re.search(r"\bstaff\b", heading.group(2), re.IGNORECASE):
                skip_level = level
        if skip_level is not None:
            continue
        if line.lstrip().startswith("```"):
            in_code = not in_code
            out.append(line)
            continue
        mentions_reference = MENTION.search(line) and not ALLOWED_MENTIONS.search(line)
        if in_code:
            if not mentions_reference:
                out.append(line)
            continue
        row = re.match(r"^\|([^|]*)\|(.*)$", line.rstrip("\n"))
        if row and not re.match(r"^\|\s*-", line):
            paths = _code_spans(row.group(1))
            staff = [p for p in paths if _excluded(p) or _excluded(p.rstrip("/") + "/")]
            if paths and len(staff) == len(paths):
                continue
            if staff:
                cell = row.group(1)
                for p in staff:
                    cell = re.sub(r"`" + re.escape(p) + r"`\s*,?\s*", "", cell)
                line = f"|{cell}|{row.group(2)}\n"
        if mentions_reference:
            line = re.sub(r"\s*\([^()]*reference[^()]*\)", "", line, flags=re.IGNORECASE)
        out.append(line)
    return "".join(out)


def transform(rel: str, text: str) -> str:
    text = strip_staff_only(text, rel)
    if rel == "adapters.py":
        text = transform_adapters(text)
    if rel.endswith(".md"):
        text = transform_markdown(text)
    if rel in TASK_FILES:
        text = _STUB_HEADER.sub(_STUB_HEADER_RELEASE, text, count=1)
    if rel.endswith(".py"):
        # Remove "fsdp_assignment.reference" items from tuples and lists; a tuple stays a tuple:
        # ("a", REF) -> ("a",)   (REF, "a") -> ("a",)   (REF, "a", "b") -> ("a", "b")   [REF] -> []
        ref = r"""["']fsdp_assignment\.reference["']"""
        text = re.sub(r"\(\s*" + ref + r"\s*,\s*([^,()]+?)\s*,?\s*\)", r"(\1,)", text)
        text = re.sub(r"\s*" + ref + r"\s*(?=[)\]])", "", text)
        text = re.sub(ref + r"\s*,\s*", "", text)
    return text


# ---- Build --------------------------------------------------------------------------------------------
def build_release(dest: Path, root: Path = ROOT, force: bool = False, git: bool = False,
                  allow_stale: bool = False, quiet: bool = False) -> list[str]:
    """Write the release into ``dest``; return the released paths."""
    dest = Path(dest).resolve()
    if dest == root.resolve() or dest in root.resolve().parents:
        raise SystemExit(f"release: {dest} is (or contains) the staff repository")
    if dest.exists() and any(dest.iterdir()):
        if not force:
            raise SystemExit(f"release: {dest} exists and is not empty (use --force to replace it)")
        shutil.rmtree(dest)
    if not allow_stale:
        stale = _handout_problems(root)
        if stale:
            raise SystemExit("release: handout.pdf is stale: " + "; ".join(stale) +
                             "\n  rebuild it: python staff/build_handout.py   (or pass --allow-stale)")
    files = released_files(root)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in files:
        src, out = root / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes()
        if Path(rel).suffix in TEXT_SUFFIXES and b"\0" not in data:
            out.write_text(transform(rel, data.decode("utf-8")), encoding="utf-8")
        else:
            out.write_bytes(data)
        shutil.copymode(src, out)
    if git:
        env = dict(os.environ, GIT_AUTHOR_NAME="Course staff", GIT_AUTHOR_EMAIL="staff@example.invalid",
                   GIT_COMMITTER_NAME="Course staff", GIT_COMMITTER_EMAIL="staff@example.invalid")
        for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "Initial release"]):
            subprocess.run(cmd, cwd=dest, check=True, env=env)
    if not quiet:
        print(f"release: wrote {len(files)} files to {dest}")
    return files


def _handout_problems(root: Path) -> list[str]:
    script = root / "staff" / "build_handout.py"
    if not script.exists():
        return ["staff/build_handout.py is missing"]
    proc = subprocess.run([sys.executable, str(script), "--check"], cwd=root, capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    return [line.removeprefix("stale: ") for line in proc.stderr.splitlines() if line.startswith("stale:")] or \
        [proc.stderr.strip() or "build_handout --check failed"]


# ---- Check --------------------------------------------------------------------------------------------
# The writeup's answer key (staff/answer_key/) carries this marker in every file: a released file that carries it,
# or a path that names the key, is a leak (staff/ is excluded above; this catches a copy anywhere else).
ANSWER_KEY_MARKER = "STAFF ANSWER KEY"
ANSWER_KEY_PATH = re.compile(r"answer[_-]?key", re.IGNORECASE)


def answer_key_leaks(dest: Path) -> list[str]:
    """``path`` (and why) for every file in ``dest`` that is, or contains, the staff answer key."""
    found = []
    for path in sorted(p for p in Path(dest).rglob("*") if p.is_file() and ".git" not in p.relative_to(dest).parts):
        rel = path.relative_to(dest).as_posix()
        if ANSWER_KEY_PATH.search(rel):
            found.append(f"{rel}: the path names the answer key")
        elif ANSWER_KEY_MARKER.encode() in path.read_bytes():
            found.append(f"{rel}: contains the answer key's marker ({ANSWER_KEY_MARKER!r})")
    return found


def mentions(dest: Path) -> list[str]:
    """``path:line: text`` for every line of a released text file that mentions the reference."""
    found = []
    for path in sorted(p for p in Path(dest).rglob("*") if p.is_file() and ".git" not in p.relative_to(dest).parts):
        rel = path.relative_to(dest).as_posix()
        if "reference" in rel.lower():
            found.append(f"{rel}: the path names the reference")
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary (handout.pdf's text is compressed; its source is checked in the staff repo)
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            for m in MENTION.finditer(line):
                window = line[max(0, m.start() - 30):m.end() + 30]
                if not ALLOWED_MENTIONS.search(window):
                    found.append(f"{rel}:{n}: {line.strip()[:140]}")
                    break
    return found


# The graduated hints (hints/README.md): one folder per task and hard case, one file per rung, so that opening
# one rung does not show the next. The handout and the stubs send a stuck student there.
HINT_LEVELS = ("1-question.md", "2-mechanism.md", "3-recipe.md")


def hint_problems(dest: Path) -> list[str]:
    """Problems with the hints in ``dest``: each task 1-7 has a topic folder under ``hints/taskN/``, and every
    topic folder holds exactly the three rungs."""
    problems = []
    for task in range(1, len(TASK_FILES) + 1):
        root = Path(dest) / "hints" / f"task{task}"
        topics = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if not topics:
            problems.append(f"hints/task{task}/: no hint folder")
        for topic in topics:
            files = sorted(p.name for p in topic.iterdir())
            if files != list(HINT_LEVELS):
                problems.append(f"{topic.relative_to(dest).as_posix()}: holds {files}, not {list(HINT_LEVELS)}")
    return problems


def check_release(dest: Path) -> list[str]:
    """Problems with the release in ``dest`` (empty when it is fine)."""
    dest = Path(dest)
    problems = []
    for rel in REQUIRED:
        if not (dest / rel).is_file():
            problems.append(f"missing: {rel}")
    for path in dest.rglob("*"):
        rel = path.relative_to(dest).as_posix()
        if ".git" in rel.split("/"):
            continue
        if _excluded(rel + ("/" if path.is_dir() else "")) or _excluded(rel):
            problems.append(f"staff-only path present: {rel}")
    problems += [f"mentions the reference: {m}" for m in mentions(dest)]
    problems += [f"answer key in the release: {m}" for m in answer_key_leaks(dest)]
    problems += [f"hints: {m}" for m in hint_problems(dest)]
    for path in sorted(dest.rglob("*.py")):
        if ".git" in path.relative_to(dest).parts:
            continue
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as err:
            problems.append(f"does not compile: {path.relative_to(dest)}:{err.lineno}: {err.msg}")
    for rel in TASK_FILES:
        path = dest / rel
        if path.is_file():
            n = re.search(r"task(\d)", rel).group(1)
            if f'NotImplementedError("Task {n}:' not in path.read_text(encoding="utf-8"):
                problems.append(f"{rel}: no NotImplementedError(\"Task {n}: ...\") (is it a stub?)")
    if (dest / "adapters.py").is_file():
        env = {k: v for k, v in os.environ.items() if k not in ("FSDP_IMPL", "PYTHONPATH")}
        proc = subprocess.run([sys.executable, "-c", "import adapters; print(adapters.implementation())"],
                              cwd=dest, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or proc.stdout.strip() != "student":
            problems.append(f"adapters.implementation() in the release gives {proc.stdout.strip()!r} "
                            f"(expected 'student'){': ' + proc.stderr.strip()[-300:] if proc.returncode else ''}")
    return problems


# ---- The README's set-up commands --------------------------------------------------------------------
def readme_commands(readme: str) -> tuple[str, str]:
    """(install command, test command): the first line of a fenced code block in the README that runs
    ``pip install``, and the first that runs ``pytest``. Comments (``# ...``) and prompts (``$ ``) are stripped."""
    install = test = None
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", readme, re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            line = re.sub(r"^\s*\$\s*", "", line)
            line = re.sub(r"\s+#.*$", "", line).strip()
            if not line or line.startswith("#"):
                continue
            if install is None and re.search(r"\bpip\s+install\b", line):
                install = line
            elif test is None and re.search(r"\bpytest\b", line):
                test = line
    if install is None or test is None:
        raise ValueError("README.md: no fenced code block with the `pip install ...` and the `... pytest` command")
    return install, test


# ---- The reference, rewritten for the student layout (staff checks only) -------------------------------
def reference_task_files(root: Path = ROOT) -> dict[str, str]:
    """``fsdp_assignment/taskN_*.py`` -> the reference's source of that task, with its imports rewritten for
    the location of the stubs: ``from ..x`` (fsdp_assignment.x) becomes ``from .x``; ``from .y`` (a sibling
    task module) stays; absolute ``fsdp_assignment.reference.`` becomes ``fsdp_assignment.``."""
    out = {}
    for rel in TASK_FILES:
        src = root / "fsdp_assignment" / "reference" / Path(rel).name
        text = src.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                i = node.lineno - 1
                new, count = re.subn(r"\bfrom(\s+)\.\.", r"from\1.", lines[i], count=1)
                if count != 1:
                    raise ValueError(f"{src}:{node.lineno}: cannot rewrite the relative import")
                lines[i] = new
        text = "".join(lines).replace("fsdp_assignment.reference.", "fsdp_assignment.")
        if re.search(r"^\s*(from|import)\s+\S*reference", text, re.MULTILINE):
            raise ValueError(f"{src}: an import of the reference is left after rewriting")
        out[rel] = text
    return out


def drop_in_reference(dest: Path, root: Path = ROOT) -> list[str]:
    """Overwrite the seven stubs in ``dest`` with the reference's task files (see reference_task_files)."""
    files = reference_task_files(root)
    for rel, text in files.items():
        (Path(dest) / rel).write_text(text, encoding="utf-8")
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    # the usage block of the docstring (its first two paragraphs), not only its title
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="the directory to write the release into (or to --check)")
    parser.add_argument("--check", action="store_true", help="only check an existing release in DEST")
    parser.add_argument("--force", action="store_true", help="replace DEST if it exists")
    parser.add_argument("--git", action="store_true", help="git init DEST and commit the release")
    parser.add_argument("--allow-stale", action="store_true", help="build even when handout.pdf is stale")
    parser.add_argument("--with-reference", action="store_true",
                        help="staff only: drop the reference's task files over the stubs (never ship this)")
    args = parser.parse_args(argv)
    if not args.check:
        build_release(args.dest, force=args.force, git=args.git, allow_stale=args.allow_stale)
    problems = check_release(args.dest)
    if args.with_reference:
        drop_in_reference(args.dest)
        print(f"release: dropped the reference's task files into {args.dest} (staff use only)")
    for p in problems:
        print(f"release check: {p}", file=sys.stderr)
    if problems:
        print(f"release check: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("release check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
