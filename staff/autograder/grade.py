"""The grading command: grade a tree's task files with the public and hidden tests, write results.json.

    python -m staff.autograder.grade --results results.json           # grade this tree's fsdp_assignment/task*.py
    python -m staff.autograder.grade --autograder-root /autograder    # Gradescope (run_autograder calls this)
    python -m staff.autograder.grade --zip submission.zip --results results.json   # one student's zip (TAs)

Run it as above, ``python -m staff.autograder.grade``, from the root of the tree it belongs to: that is the only
way (it is a module of the package ``staff.autograder`` and imports its parts as package modules, so running the
file itself, ``python staff/autograder/grade.py``, fails).

Options: ``--budget S`` (a test is started only while what is left of S seconds is at least what it needs on a busy
machine, else it is "not run", and said so; with less left than its time limit it runs with what is left, and if it
runs out of that it is "cut for time", never a hang; default: --timeout minus 60 s, or none), ``--timeout S`` (the
whole pytest run is killed after S seconds). Their defaults: Gradescope mode (``--autograder-root``, run_autograder) keeps the
platform's clock, 540 s and a budget of 480 s; a TA's run (``--zip``, or this tree) grades everything, with no
budget and, as a net for a wedged grader only, a timeout of every graded test's limit and backstop added up (hours).
``--rank-user USER`` (run rank bodies as this
unprivileged user when grading as root; ``none`` to never; default ``fsdp_student``), ``--allow-root-ranks`` (with
``--zip`` as root: run the ranks as root when the rank user cannot run them), ``--rank-memory-mb N`` (each
rank's memory limit above its start-up usage; default 256), ``--timeout-cap S`` (cap every harness timeout, for
the staff's own tests of broken submissions). Anything after ``--`` goes to pytest (``-k``, ``-m``, ``-x``, ...).

It runs pytest in a child process with the grading plugin (``staff/autograder/grading_plugin.py``) named
explicitly and every other plugin off, so nothing a submission brings (a conftest, a plugin, a pyproject) is
loaded, and writes results.json as the run goes. When the run ends, however it ends, results.json exists and
holds every graded test.

``--zip Z`` grades one student's zip (as ``make_submission.sh`` makes it) the way Gradescope would: it lays out a
fresh ``R`` in a temporary folder (``R/source``: this tree's bundle, ``build_bundle.stage``; ``R/submission``: the
zip), grades it as Gradescope mode does (but on a TA's clock: no budget unless given), writes results.json (``--results``, default ./results.json) and removes ``R``
(``--keep`` keeps it). Run it as root to have rank bodies run as the rank user (``sudo``; else as you). As root,
it never runs the submission's ranks as root: when the rank user cannot run this Python (a pyenv under a 0700
/root), it names the path it cannot reach and how to fix it, and stops, unless ``--allow-root-ranks``. It prints
its progress as it goes ("graded 12 of 76 tests, 95 s, about 4 min left", the estimate from test_times.json's
reference times scaled by how slow the tests so far ran): with no budget, a busy machine takes longer and costs
no points (raise ``--timeout`` if you give one).

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
from .rank_user import (cannot_read, first_unreadable, rank_user_paths, syscall_filter_note,  # noqa: F401
                        usable_rank_user)
from .sanitize import LineSanitizer, sanitize

HERE = Path(__file__).resolve().parent
TREE = HERE.parents[1]  # the tree this module belongs to: <tree>/staff/autograder/grade.py
DEFAULT_RANK_USER = "fsdp_student"
DEFAULT_TIMEOUT_S = 540  # Gradescope mode: a minute under the smallest Gradescope limit (10 min); raise it with it
BUDGET_MARGIN_S = 60.0  # the default budget is --timeout less this: the last test's teardown, results.json, cleanup
DEFAULT_RANK_MEMORY_MB = 256  # the reference passes everything with 128 (measured): 2x headroom
# Each file a rank writes (its output included) stays under this (RLIMIT_FSIZE; the tests write none of their own),
# and the rank user's files in /tmp, /var/tmp and /dev/shm are removed after every test: no quota is needed.
RANK_FILE_LIMIT_BYTES = 256 << 20
# All of the rank user's processes, its tmpfs files and shared memory together (student_limits.py): room for 4
# ranks at their limit and their start-up memory; 8 children of 350 MB, or 1.5 GB in /dev/shm, do not fit.
STUDENT_MEMORY_EXTRA_BYTES = 1 << 30
RANK_MAX_PROCESSES = 2048  # RLIMIT_NPROC of the rank user: 4 ranks of 64 gloo groups use ~800 threads; two gradings
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


# ---- running ---------------------------------------------------------------------------------------------
def pytest_command(tree: Path, results: Path, budget: float | None, extra: list[str],
                   notes: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest",
           "-p", "staff.autograder.grading_plugin", "-p", "pytest_timeout", "-p", "no:cacheprovider",
           "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree), "--confcutdir", str(tree),
           "--continue-on-collection-errors", "-q", "-rN", "--tb=short", "--timeout", "300",
           "--grade-results", str(results)]
    if budget is not None:
        cmd += ["--grade-budget", f"{budget:g}"]
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


PROGRESS_EVERY_S = 10.0  # a progress line when a test has finished since the last one, at most this often ...
PROGRESS_QUIET_S = 60.0  # ... and at least this often while a test runs (pytest -q prints no line of its own)
PROGRESS_CHECK_S = 2.0  # how often results.json is looked at
NOT_STARTED = "not run: the grading run was stopped before this test ran"  # grading_results.test_output's bodies
RUNNING = "did not finish:"


def _read(results: Path) -> dict:
    try:
        data = json.loads(results.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def time_summary(results: Path) -> dict | None:
    """results.json's ``extra_data["time"]`` (grading_results.time_summary: the plugin's count of the tests
    finished, running, not run or cut for time, from the records the tests' outputs come from), or None."""
    summary = (_read(results).get("extra_data") or {}).get("time")
    return summary if isinstance(summary, dict) and "tests" in summary else None


def _bodies(results: Path) -> list[tuple[str, str]]:
    """(name, what happened) of every graded test in results.json, as the plugin last wrote it; [] before."""
    try:
        return [(t["name"], t["output"].split("\n\n", 1)[-1]) for t in _read(results)["tests"]]
    except (KeyError, TypeError, AttributeError):
        return []


def progress(results: Path) -> tuple[int, int, str]:
    """(tests finished, tests graded, the one running or "") from results.json, which the plugin rewrites as
    each test starts and ends."""
    summary = time_summary(results)
    if summary is not None:
        return summary["finished"], summary["tests"], summary["running"]
    bodies = _bodies(results)  # a results.json without the summary (an older plugin's)
    running = next((name for name, body in bodies if body.startswith(RUNNING)), "")
    done = sum(not body.startswith((NOT_STARTED, RUNNING)) for _, body in bodies)
    return done, len(bodies), running


def time_left(summary: dict | None, elapsed: float) -> float | None:
    """About how many seconds the tests not finished will take: their reference times (test_times.json, each
    plus a second of start-up) scaled by how much slower than the reference the finished ones ran here (the run's
    start-up counted in: an overestimate early on). None before a test has finished."""
    ref = (summary or {}).get("reference_s") or {}
    done, left = ref.get("finished") or 0.0, ref.get("left") or 0.0
    return None if done <= 0 else elapsed * left / done


def left_words(seconds: float | None) -> str:
    if seconds is None or seconds < 1:  # (none finished yet; or nothing left to run)
        return ""
    return f", about {seconds:.0f} s left" if seconds < 120 else f", about {seconds / 60:.0f} min left"


def closing_line(summary: dict | None, killed: bool, total: int) -> str:
    """The run's last word on time: how many tests were not run or cut for time, and why, from the plugin's
    records (``extra_data["time"]``) and whether the run was killed at --timeout (its last write then shows the
    test it killed as running and the rest as pending)."""
    if summary is None:
        return f"the grading run left no record of its {total} tests (see its output above)"
    not_run = {k: len(v) for k, v in (summary.get("not_run") or {}).items()}
    cut = len(summary.get("cut") or [])
    if killed:
        cut += bool(summary.get("running"))
        not_run["stopped"] = not_run.get("stopped", 0) + int(summary.get("pending") or 0)
    short = sum(not_run.values()) + cut
    n = summary.get("tests", total)
    if not short:
        return (f"no test was left out or cut for time: each of the {n} that ran had its whole time limit "
                f"(a timeout is a test's own)")
    budget = summary.get("budget_s")
    parts = []
    if not_run.get("budget"):
        parts.append(f"{not_run['budget']} not started because the grading time budget ({budget:.0f} s) had less "
                     f"left than they need or had run out" if budget else
                     f"{not_run['budget']} not started: the grading time budget ran out")
    if not_run.get("share"):
        parts.append(f"{not_run['share']} not run because their task's share of the budget went to its failing "
                     f"tests")
    if not_run.get("stopped"):
        parts.append(f"{not_run['stopped']} not run because the run stopped before them")
    if cut:
        parts.append(f"{cut} cut for time (their limit cut to what was left of the budget and run out of, or "
                     f"running when the run was killed at --timeout: not a hang)")
    return (f"{short} of {n} tests were not run or cut for time, so not graded on their merits: "
            + "; ".join(parts) + f". {load_note()}")


def load_note() -> str:
    """How busy the machine is, and how to grade everything."""
    try:
        load = f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs now"
    except OSError:
        load = f"{os.cpu_count()} CPUs"
    return (f"{load}; to grade every test, run it with no --budget and no --timeout (the default of --zip and of "
            f"a tree: every test gets its whole limit, 30 times its quiet time, and a busy machine only takes "
            f"longer)")


class Progress:
    """One line now and then while pytest runs: "graded 12 of 76 tests, 95 s, about 4 min left; running: <test>"."""

    def __init__(self, results: Path | None):
        self.results, self.start = results, time.monotonic()
        self.shown, self.said_at, self.checked_at = None, self.start, self.start

    def tick(self) -> None:
        now = time.monotonic()
        if self.results is None or now - self.checked_at < PROGRESS_CHECK_S:
            return
        self.checked_at = now
        try:
            mtime = self.results.stat().st_mtime
        except OSError:
            return
        if mtime < time.time() - (now - self.start):  # a results.json from before this run
            return
        done, total, running = progress(self.results)
        if ((done, running) != self.shown and now - self.said_at >= PROGRESS_EVERY_S) \
                or now - self.said_at >= PROGRESS_QUIET_S:
            left = left_words(time_left(time_summary(self.results), now - self.start))
            say(f"grade: graded {done} of {total} tests, {now - self.start:.0f} s{left}"
                + (f"; running: {running}" if running else ""))
            self.shown, self.said_at = (done, running), now


def run_pytest(cmd: list[str], tree: Path, env: dict[str, str], timeout: float,
               results: Path | None = None) -> tuple[int | None, str]:
    """Run pytest in its own session; kill the whole session at ``timeout``. Returns (exit code or None when
    killed, the tail of its output), and echoes its output as it goes, with a progress line now and then (read
    from ``results``)."""
    shown = Progress(results)
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
        shown.tick()
        if not sel.select(timeout=min(left, 1.0, PROGRESS_CHECK_S)):
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
        say(f"\ngrade: the grading run exceeded {timeout:g} s (--timeout) and was killed; {load_note()}")
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
               memory_mb: int, timeout_cap: float | None, extra: list[str], notes: list[str],
               refuse_root_ranks: bool = False) -> int:
    """Grade ``tree``; 0, or 2 when ``refuse_root_ranks`` (``--zip`` without ``--allow-root-ranks``) and the
    submission's ranks would run as root: then nothing is run and no results.json is written."""
    user, why = usable_rank_user(rank_user, tree)
    if refuse_root_ranks and user is None and os.geteuid() == 0:
        say(f"grade: refusing to run the submission's ranks as root (they run its code): "
            f"{why.removeprefix('ranks run as root: ')}")
        say("grade: nothing was run. Fix that and grade again, or add --allow-root-ranks to run the ranks as root "
            "anyway (only for code you trust)")
        return 2
    say(f"grade: {why}")
    if user:
        say(f"grade: {syscall_filter_note(tree)}")
    if budget is None:
        say(f"grade: no time budget: every test runs with its whole time limit (30 times its quiet time), however "
            f"long the run takes; the run is killed only after {timeout:.0f} s (--timeout)")
    else:
        say(f"grade: the whole run is killed after {timeout:.0f} s (--timeout), and a test is started only while at "
            f"least its time limit is left of {budget:.0f} s (--budget); {load_note()}")
    cmd = pytest_command(tree, results, budget, extra, notes)
    env = grading_env(tree, user, memory_mb, timeout_cap)
    audit_log = results.parent / "audit.jsonl"  # the ranks' runtime audit, this run's alone (tests/rank_audit.py)
    audit_log.unlink(missing_ok=True)
    env["FSDP_AUDIT_LOG"] = str(audit_log)  # written by the pytest process (root), never by a rank
    # The run's own TMPDIR: every run_ranks folder (fsdp-ranks-*, with each rank's TMPDIR in it) and pytest's
    # temporary folders are made in it, so whatever a rank leaves there (a run killed before its own clean-up, a
    # tree too deep for a recursive remover) is removed below with the run, not left in the machine's /tmp.
    import tempfile
    run_tmp = tempfile.mkdtemp(prefix="fsdp-grading-")
    os.chmod(run_tmp, 0o711)  # the rank user passes through to its own folders, and lists nothing
    env["TMPDIR"] = run_tmp
    start = time.monotonic()
    code, tail = run_pytest(cmd, tree, env, timeout, results=results)
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
    _, total, _ = progress(results)
    say(f"grade: {closing_line(time_summary(results), code is None, total)}")
    say(f"grade: pytest exit code {code}, {time.monotonic() - start:.1f} s; results in {results}")
    return 0


def clocks(budget: float | None, timeout: float | None, gradescope: bool) -> tuple[float | None, float]:
    """(budget, timeout) from the options given. Gradescope mode keeps the platform's clock: --timeout 540 s (what
    run_autograder passes) and a budget a minute under it. A TA's run (--zip, or a tree) grades everything: with
    neither option, no budget, and a timeout that only a wedged grader reaches (every_limit_s). Given one of them,
    the other follows it, as before: budget = timeout - 60 s, timeout = budget + 60 s."""
    if timeout is None and budget is None:
        if gradescope:
            timeout = float(DEFAULT_TIMEOUT_S)
        else:
            return None, every_limit_s()
    if timeout is None:
        timeout = budget + BUDGET_MARGIN_S
    if budget is None:
        budget = max(30.0, timeout - BUDGET_MARGIN_S)
    return budget, timeout


def every_limit_s() -> float:
    """Every graded test's time limit and pytest-timeout's backstop after it, added up, and ten minutes for
    collection and start-up: what a run with no budget may take at the worst (each test hanging to its limit, then
    to its backstop). About 3 hours for 86 tests; a correct submission takes minutes."""
    from .grading_limits import BACKSTOP_MARGIN_S, STARTUP_S, TEST_TIMEOUT_FACTOR, TIMES_FILE
    try:
        tests = json.loads(TIMES_FILE.read_text())["tests"]
        seconds = [float(t["seconds"]) for t in tests.values()]
    except (OSError, ValueError, KeyError, TypeError):
        seconds = [5.0] * 100
    return 600.0 + sum(TEST_TIMEOUT_FACTOR * (t + STARTUP_S) + BACKSTOP_MARGIN_S for t in seconds)


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
    parser = argparse.ArgumentParser(prog="python -m staff.autograder.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=None,
                        help="results.json to write (default: R/results/results.json with --autograder-root, "
                             "./results.json with --zip, else <tree>/results.json)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--autograder-root", type=Path, default=None,
                       help="Gradescope mode: R/source, R/submission, R/results (see above)")
    where.add_argument("--zip", type=Path, default=None,
                       help="grade one student's zip (make_submission.sh's) in a fresh tree made from this one")
    parser.add_argument("--keep", action="store_true", help="with --zip: keep the fresh tree (its path is printed)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: a test is started only while at least its time limit is left of them "
                             "(default: --timeout minus 60; none with --zip or a tree and no --timeout)")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds: the whole run is killed (default: {DEFAULT_TIMEOUT_S} with "
                             f"--autograder-root; with --zip or a tree, every test's limit added up)")
    parser.add_argument("--rank-user", default=DEFAULT_RANK_USER,
                        help="run rank bodies as this user when grading as root ('none': never)")
    parser.add_argument("--allow-root-ranks", action="store_true",
                        help="with --zip as root: run the submission's ranks as root when the rank user cannot run "
                             "them (by default grading refuses, naming the path that user cannot read)")
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
        budget, timeout = clocks(args.budget, args.timeout, gradescope=args.autograder_root is not None)
        timeout = max(1.0, timeout - (time.monotonic() - started))
        return grade_tree(tree, results.resolve(), budget=budget, timeout=timeout,
                          rank_user=args.rank_user, memory_mb=args.rank_memory_mb, timeout_cap=args.timeout_cap,
                          extra=extra, notes=notes, refuse_root_ranks=layout is not None and not args.allow_root_ranks)
    finally:
        if layout is not None and not args.keep:
            from .cleanup import remove_folder
            remove_folder(layout)
        elif layout is not None:
            say(f"grade: the grading tree is kept in {layout / 'grading'}")


if __name__ == "__main__":
    sys.exit(main())
