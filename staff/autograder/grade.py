"""The grading command: grade a tree's task files with the public and hidden tests, write results.json.

    python -m staff.autograder.grade --results results.json           # grade this tree's fsdp_assignment/task*.py
    python -m staff.autograder.grade --autograder-root /autograder    # Gradescope (run_autograder calls this)
    python -m staff.autograder.grade --zip submission.zip --results results.json   # one student's zip (TAs)

Run it from the root of the tree it belongs to (it is a module of the package ``staff.autograder``; its parts
are imported as package modules, so ``python -m staff.autograder.grade`` does not work).

Options: ``--budget S`` (tests not started by then are not run; default: --timeout minus 60 s), ``--timeout S``
(the whole pytest run is killed after S seconds; default 540), ``--rank-user USER`` (run rank bodies as this
unprivileged user when grading as root; ``none`` to never; default ``fsdp_student``), ``--rank-memory-mb N`` (each
rank's memory limit above its start-up usage; default 256), ``--timeout-cap S`` (cap every harness timeout, for
the staff's own tests of broken submissions). Anything after ``--`` goes to pytest (``-k``, ``-m``, ``-x``, ...).

It runs pytest in a child process with the grading plugin (``staff/autograder/grading_plugin.py``) named
explicitly and every other plugin off, so nothing a submission brings (a conftest, a plugin, a pyproject) is
loaded, and writes results.json as the run goes. When the run ends, however it ends, results.json exists and
holds every graded test.

``--zip Z`` grades one student's zip (as ``make_submission.sh`` makes it) the way Gradescope would: it lays out a
fresh ``R`` in a temporary folder (``R/source``: this tree's bundle, ``build_bundle.stage``; ``R/submission``: the
zip), grades it in Gradescope mode, writes results.json (``--results``, default ./results.json) and removes ``R``
(``--keep`` keeps it). Run it as root to have rank bodies run as the rank user (``sudo``; else as you).

In Gradescope mode (``--autograder-root R``) it first builds a clean grading tree in ``R/grading`` from the
staff tree ``R/source`` and copies in **only** the seven task files from ``R/submission`` (at their repository
paths, as ``make_submission.sh`` zips them, or anywhere by file name); any other file of the submission is
ignored. The tree is root-owned and read-only to everyone else, the results directory is root's, and rank
bodies run as the unprivileged user where the container allows it (``setup.sh`` creates the user).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .intake import (MAX_SUBMISSION_ENTRIES, MAX_SUBMITTED_FILE_BYTES, MAX_ZIP_BYTES, find_in_zips,  # noqa: F401
                     find_submitted, install_submission, read_submitted, take_submission, task_files)
from .sanitize import LineSanitizer, sanitize

HERE = Path(__file__).resolve().parent
TREE = HERE.parents[1]  # the tree this module belongs to: <tree>/staff/autograder/grade.py
DEFAULT_RANK_USER = "fsdp_student"
DEFAULT_TIMEOUT_S = 540  # a minute under the smallest Gradescope limit (10 min); raise it with the limit
DEFAULT_RANK_MEMORY_MB = 256  # the reference passes everything with 128 (measured): 2x headroom
# Each file a rank writes (its output included) stays under this (RLIMIT_FSIZE; the tests write none of their own),
# and the rank user's files in /tmp, /var/tmp and /dev/shm are removed after every test: no quota is needed.
RANK_FILE_LIMIT_BYTES = 256 << 20
# All of the rank user's processes, its tmpfs files and shared memory together (student_limits.py): room for 4
# ranks at their limit and their start-up memory; 8 children of 350 MB, or 1.5 GB in /dev/shm, do not fit.
STUDENT_MEMORY_EXTRA_BYTES = 1 << 30
RANK_MAX_PROCESSES = 512  # RLIMIT_NPROC of the rank user: processes and threads (4 ranks use about 60)
TEST_DIRS = ("tests/public", "tests/hidden")


def command(*args: str) -> list[str]:
    """The grading command with ``args``, to run with the grading tree's root as its working directory (the
    staff tools that grade a staged tree: zoo, mutants, time measurement)."""
    return [sys.executable, "-m", "staff.autograder.grade", *args]


def stage_tree(source: Path, dest: Path) -> None:
    """A fresh copy of the staff tree ``source`` (what the bundle ships) in ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "setup.sh",
                                                  "run_autograder"))


PRIVATE_IN_TREE = ("tests/hidden", "staff")  # root only while grading: hidden tests, the plugin, test_times.json


def lock_down(tree: Path) -> None:
    """Owned by us, readable by everyone, writable by no one else; the hidden tests and the staff tooling
    (the grading plugin, test_times.json with every hidden test's name) readable by us only. A rank imports
    its test's scenario module before it drops to the rank user, so student code can neither read the hidden
    tests nor copy them into a visible test's output; the parent-side checks are never imported in a rank."""
    for dirpath, dirnames, filenames in os.walk(tree):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    for rel in PRIVATE_IN_TREE:
        if (tree / rel).is_dir():
            os.chmod(tree / rel, 0o700)
    path = tree
    while path != path.parent:  # every directory above must let the rank user through
        try:
            mode = path.stat().st_mode
            if not mode & 0o001:
                os.chmod(path, mode | 0o001)
        except OSError:
            pass
        path = path.parent


# ---- the rank user ---------------------------------------------------------------------------------------
def usable_rank_user(user: str | None, tree: Path) -> tuple[str | None, str]:
    """``user`` if rank bodies can run as it here (we are root, it exists, and it can read Python, torch and
    the tree), else None; and why."""
    if not user or user == "none":
        return None, "ranks run as the grading user (no --rank-user)"
    if os.geteuid() != 0:
        return None, "ranks run as the grading user (not root, so no other user to run them as)"
    import pwd
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None, f"ranks run as root: user {user!r} does not exist (setup.sh creates it)"
    if entry.pw_uid == 0:
        return None, f"ranks run as root: user {user!r} is root"
    import importlib.util
    torch_spec = importlib.util.find_spec("torch")
    paths = [sys.executable, os.__file__, str(tree / "adapters.py"), str(tree / "tests" / "harness.py"),
             str(tree / "tests" / "rank_isolation.py")]
    if torch_spec is not None and torch_spec.origin:
        paths.append(torch_spec.origin)
    pid = os.fork()
    if pid == 0:  # the probe: can that user read all of these?
        try:
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            ok = all(os.access(p, os.R_OK) for p in paths)
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return None, (f"ranks run as root: user {user!r} cannot read Python, torch or the grading tree "
                      f"({', '.join(paths)})")
    return user, f"rank bodies run as user {user!r} (uid {entry.pw_uid})"


def syscall_filter_note(tree: Path) -> str:
    """Whether the ranks will refuse memfd_create and unshare here (tests/rank_isolation.py installs a seccomp
    filter in each rank; where the kernel or the container does not allow one, only the memory count applies):
    tried once in a child process, for the staff's log."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        why = "?"
        try:
            # This tree's tests package (run as ``python -m`` from the tree's root; the source and the grading
            # tree hold the same file).
            from tests.rank_isolation import refuse_hidden_memory
            why = refuse_hidden_memory()
            if not why:
                try:
                    os.close(os.memfd_create("probe"))
                    why = "memfd_create still works under the filter"
                except OSError:
                    pass
        except BaseException as err:
            why = f"the filter could not be tried: {type(err).__name__}: {err}"
        finally:
            os.write(write, why.encode()[:1000])
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return why or "ranks refuse memfd_create, memfd_secret, unshare, setns and namespace clones (seccomp)"


# ---- running ---------------------------------------------------------------------------------------------
def pytest_command(tree: Path, results: Path, budget: float, extra: list[str], notes: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest",
           "-p", "staff.autograder.grading_plugin", "-p", "pytest_timeout", "-p", "no:cacheprovider",
           "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree), "--confcutdir", str(tree),
           "--continue-on-collection-errors", "-q", "-rN", "--tb=short", "--timeout", "300",
           "--grade-results", str(results), "--grade-budget", f"{budget:g}"]
    for note in notes:
        cmd += ["--grade-note", note]
    return cmd + [d for d in TEST_DIRS if (tree / d).is_dir()] + extra


def grading_env(tree: Path, rank_user: str | None, memory_mb: int, timeout_cap: float | None) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "HOME", "SYSTEMROOT", "CUDA_VISIBLE_DEVICES", "TERM")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("FSDP_ZOO_")}
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", FSDP_IMPL="student", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(tree), PYTHONNOUSERSITE="1",
               FSDP_RANK_MEMORY_LIMIT_BYTES=str(int(memory_mb) << 20),
               FSDP_RANK_FILE_LIMIT_BYTES=str(RANK_FILE_LIMIT_BYTES), FSDP_RANK_MAX_PROCESSES=str(RANK_MAX_PROCESSES))
    if rank_user:
        env["FSDP_RANK_USER"] = rank_user
        env["FSDP_STUDENT_MEMORY_LIMIT_BYTES"] = str(4 * (int(memory_mb) << 20) + STUDENT_MEMORY_EXTRA_BYTES)
    if timeout_cap:
        env["FSDP_RANK_TIMEOUT_CAP"] = f"{timeout_cap:g}"
    return env


def run_pytest(cmd: list[str], tree: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run pytest in its own session; kill the whole session at ``timeout``. Returns (exit code or None when
    killed, the tail of its output), and echoes its output as it goes."""
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tail: list[str] = []
    deadline = time.monotonic() + timeout
    killed = False
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    log = LineSanitizer()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            killed = True
            break
        if not sel.select(timeout=min(left, 1.0)):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        sys.stdout.write(log.feed(chunk))
        sys.stdout.flush()
        buf = (buf + chunk)[-20000:]
    sys.stdout.write(log.close())
    if killed:
        say(f"\ngrade: the grading run exceeded {timeout:g} s and was killed")
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything left in its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    tail.append(sanitize(buf.decode("utf-8", errors="replace")))
    return (None if killed else proc.returncode), "".join(tail)


def say(line: str) -> None:
    """A line of the grader's own, through the sanitiser like everything else it prints: its notes name the
    submission's files and folders, which may hold escape codes that rewrite what the log shows (issue 25)."""
    print(sanitize(line), flush=True)


def ensure_results(results: Path, tail: str, code: int | None) -> None:
    """If pytest died before writing results.json (it never should), write one that says so."""
    try:
        data = json.loads(results.read_text())
        if isinstance(data, dict) and "tests" in data:
            return
    except (OSError, ValueError):
        pass
    write_failure(results, "The grading run failed before it could grade any test (exit code "
                           f"{code}); please tell the course staff. Its last output:\n\n{tail[-4000:]}")


def write_failure(results: Path, output: str) -> None:
    """A results.json with no test graded and ``output`` saying why."""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"score": 0.0, "execution_time": 0, "output": output,
                                   "stdout_visibility": "hidden", "tests": []}, indent=1))


def grade_tree(tree: Path, results: Path, *, budget: float | None, timeout: float, rank_user: str | None,
               memory_mb: int, timeout_cap: float | None, extra: list[str], notes: list[str]) -> int:
    user, why = usable_rank_user(rank_user, tree)
    say(f"grade: {why}")
    if user:
        say(f"grade: {syscall_filter_note(tree)}")
    budget = budget if budget is not None else max(30.0, timeout - 60.0)
    cmd = pytest_command(tree, results, budget, extra, notes)
    env = grading_env(tree, user, memory_mb, timeout_cap)
    # The run's own TMPDIR: every run_ranks folder (fsdp-ranks-*, with each rank's TMPDIR in it) and pytest's
    # temporary folders are made in it, so whatever a rank leaves there (a run killed before its own clean-up, a
    # tree too deep for a recursive remover) is removed below with the run, not left in the machine's /tmp.
    import tempfile
    run_tmp = tempfile.mkdtemp(prefix="fsdp-grading-")
    os.chmod(run_tmp, 0o711)  # the rank user passes through to its own folders, and lists nothing
    env["TMPDIR"] = run_tmp
    start = time.monotonic()
    code, tail = run_pytest(cmd, tree, env, timeout)
    if user:  # anything of the rank user's still alive (escaped its session?) or left in /tmp goes now
        import pwd
        from .cleanup import clean_up_after_test, world_writable_places
        try:
            places = tuple(world_writable_places())
        except Exception as err:  # (never: it catches its own errors) the shared folders it always knows
            say(f"grade: cleanup: world_writable_places failed: {type(err).__name__}: {err}")
            places = ("/tmp", "/var/tmp", "/dev/shm")
        for note in clean_up_after_test(pwd.getpwnam(user).pw_uid, places, lambda line: say(f"grade: {line}")):
            say(f"grade: after the run (user {user!r}): {note.removeprefix('note: ')}")
    else:
        say("grade: ranks run as the grading user, so a process that left its session or a file outside the "
            "rank's own folder cannot be told from the grader's: neither is cleaned up after the run")
    from .cleanup import remove_folder
    remove_folder(run_tmp)  # after the rank user's processes are gone: nothing adds to it any more
    ensure_results(results, tail, code)
    from .review import add_staff_review  # the static review and the rank audit's findings (seam 3)
    add_staff_review(tree, results, say)
    say(f"grade: pytest exit code {code}, {time.monotonic() - start:.1f} s; results in {results}")
    return 0


def gradescope_tree(root: Path, results: Path) -> tuple[Path | None, list[str]]:
    """Gradescope mode: the clean grading tree ``root/grading`` from ``root/source`` with the submission's task
    files in it, locked down; the notes for the student. (None, []) when the submission could not be read (then
    ``results`` already says so)."""
    source, tree = root / "source", root / "grading"
    # The bundle as unzipped (hidden tests, staff files) is root's alone for the whole run.
    os.chmod(source, 0o700)
    stage_tree(source, tree)
    try:
        notes = take_submission(root / "submission", tree)
    except Exception as err:  # never expected (take_submission refuses what it cannot read): say so anyway
        say(f"grade: the submission could not be read: {type(err).__name__}: {err}")
        write_failure(results, sanitize(f"Your submission could not be read ({type(err).__name__}: {err}); "
                                        f"please tell the course staff."))
        return None, []
    lock_down(tree)
    results.parent.mkdir(parents=True, exist_ok=True)
    if results.parent.resolve() == (root / "results").resolve():
        # results.json holds hidden tests' output: root's while grading runs. Only Gradescope's own folder:
        # a --results elsewhere (/tmp/x.json) must never change the mode of a shared directory like /tmp.
        os.chmod(results.parent, 0o700)
    for note in notes:
        say(f"grade: {note}")
    return tree, notes


def zip_layout(zip_path: Path) -> Path:
    """A fresh Gradescope layout for one student's zip (``--zip``): ``R/source`` is this tree's bundle (the stubs,
    the public and hidden tests, the grader; never the reference), ``R/submission`` holds the zip as uploaded.
    The task files are then taken from it as from any upload (find_in_zips: read in memory at their repository
    paths, bounded, never extracted), so the TA grades exactly what Gradescope would."""
    import tempfile
    from .build_bundle import stage
    root = Path(tempfile.mkdtemp(prefix="fsdp-grade-"))
    os.chmod(root, 0o755)  # the rank user passes through it to the grading tree (lock_down opens the rest)
    stage(root / "source", TREE)
    (root / "submission").mkdir()
    shutil.copyfile(zip_path, root / "submission" / zip_path.name)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=None,
                        help="results.json to write (default: R/results/results.json with --autograder-root, "
                             "./results.json with --zip, else <tree>/results.json)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--autograder-root", type=Path, default=None,
                       help="Gradescope mode: R/source, R/submission, R/results (see above)")
    where.add_argument("--zip", type=Path, default=None,
                       help="grade one student's zip (make_submission.sh's) in a fresh tree made from this one")
    parser.add_argument("--keep", action="store_true", help="with --zip: keep the fresh tree (its path is printed)")
    parser.add_argument("--budget", type=float, default=None, help="seconds: tests not started by then are not run")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds: the whole run is killed")
    parser.add_argument("--rank-user", default=DEFAULT_RANK_USER,
                        help="run rank bodies as this user when grading as root ('none': never)")
    parser.add_argument("--rank-memory-mb", type=int, default=DEFAULT_RANK_MEMORY_MB,
                        help="each rank's memory limit above its start-up usage")
    parser.add_argument("--timeout-cap", type=float, default=None, help="cap every harness timeout (staff tests)")
    args = parser.parse_args(argv)
    notes: list[str] = []
    started = time.monotonic()  # reading the submission counts against --timeout too
    layout = None
    if args.zip is not None:
        if not args.zip.is_file():
            parser.error(f"--zip {args.zip}: no such file")
        layout = zip_layout(args.zip)
        say(f"grade: grading {args.zip} in {layout}")
        root = layout
        results = (args.results or Path("results.json")).resolve()
    elif args.autograder_root is not None:
        root = args.autograder_root.resolve()
        results = args.results or root / "results" / "results.json"
    else:
        root = None
        tree = TREE
        results = args.results or tree / "results.json"
    try:
        if root is not None:
            tree, notes = gradescope_tree(root, results)
            if tree is None:
                return 0
        timeout = max(1.0, args.timeout - (time.monotonic() - started))
        return grade_tree(tree, results.resolve(), budget=args.budget, timeout=timeout,
                          rank_user=args.rank_user, memory_mb=args.rank_memory_mb, timeout_cap=args.timeout_cap,
                          extra=extra, notes=notes)
    finally:
        if layout is not None and not args.keep:
            from .cleanup import remove_folder
            remove_folder(layout)
        elif layout is not None:
            say(f"grade: the grading tree is kept in {layout / 'grading'}")


if __name__ == "__main__":
    sys.exit(main())
