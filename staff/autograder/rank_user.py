"""The rank user: whether the submission's ranks can run as the unprivileged user when grading as root
(``usable_rank_user``), and if not, the one path that user cannot reach and how to fix it (``cannot_read``);
whether the ranks' system-call filter works here (``syscall_filter_note``). The grading command (grade.py) asks
before it runs anything: ``--zip`` as root refuses to run a submission's ranks as root (``--allow-root-ranks``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def rank_user_paths(tree: Path) -> list[str]:
    """What a rank needs to read after it drops to the rank user: this Python, its standard library, torch and the
    grading tree's harness."""
    import importlib.util
    paths = [sys.executable, os.__file__, str(tree / "adapters.py"), str(tree / "tests" / "harness.py"),
             str(tree / "tests" / "rank_isolation.py")]
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.origin:
        paths.append(torch_spec.origin)
    return paths


def first_unreadable(paths: list[str]) -> tuple[str, str] | None:
    """(the first of ``paths`` this process cannot read, the folder on its way it cannot enter, or the path itself
    when it can enter them all), or None. Run as the rank user (a child of the probe)."""
    for path in paths:
        if os.access(path, os.R_OK):
            continue
        for where in (path, os.path.realpath(path)):  # a link: the folders on the way to what it names count too
            parts = Path(where).parts
            for i in range(1, len(parts)):
                folder = str(Path(*parts[:i]))
                if not os.access(folder, os.X_OK):
                    return path, folder
        return path, path
    return None


def usable_rank_user(user: str | None, tree: Path) -> tuple[str | None, str]:
    """``user`` if rank bodies can run as it here (we are root, it exists, and it can read Python, torch and
    the tree), else None; and why (with the one path that failed and how to fix it)."""
    if not user or user == "none":
        return None, "ranks run as the grading user (no --rank-user)"
    if os.geteuid() != 0:
        return None, "ranks run as the grading user (not root, so no other user to run them as)"
    import pwd
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None, (f"ranks run as root: user {user!r} does not exist (setup.sh creates it; here: `useradd --system "
                      f"--no-create-home --shell /usr/sbin/nologin {user}`, or name another unprivileged user with "
                      f"--rank-user, e.g. nobody)")
    if entry.pw_uid == 0:
        return None, f"ranks run as root: user {user!r} is root"
    def probe() -> str:  # in the child: can that user read all of these?
        try:
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            found = first_unreadable(rank_user_paths(tree))
            return "" if found is None else json.dumps(found)
        except BaseException as err:
            return json.dumps(["", f"{type(err).__name__}: {err}"])

    answer = in_child(probe, 4000)
    if answer:
        path, blocker = json.loads(answer) if answer != "?" else ("", "the probe did not answer")
        return None, f"ranks run as root: {cannot_read(user, path, blocker)}"
    return user, f"rank bodies run as user {user!r} (uid {entry.pw_uid})"


def in_child(probe, limit: int) -> str:
    """``probe()``'s answer (at most ``limit`` bytes), computed in a forked child, so that what it changes (its user,
    a seccomp filter) never touches the grader; "?" when the child died before answering."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        answer = "?"
        try:
            os.close(read)
            answer = probe()
        finally:
            os.write(write, answer.encode()[:limit])
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return answer


def cannot_read(user: str, path: str, blocker: str) -> str:
    """Why ``user`` cannot run the ranks, naming the one path that failed, and what to do about it."""
    if not path:
        return f"user {user!r} could not be tried ({blocker})"
    if blocker == path:
        try:
            mode = f" (mode {os.stat(path).st_mode & 0o777:o})"
        except OSError:
            mode = ""
        return (f"user {user!r} cannot read {path}{mode}: `chmod o+r {path}`, or grade with a Python outside any "
                f"private folder (a virtualenv in /opt)")
    try:
        st = os.stat(blocker)
        import pwd
        mode = f" (mode {st.st_mode & 0o777:o}, owner {pwd.getpwuid(st.st_uid).pw_name})"
    except (OSError, KeyError):
        mode = ""
    return (f"user {user!r} cannot read {path}: it cannot enter {blocker}{mode}. Fix it with `chmod o+x {blocker}` "
            f"(others may then pass through {blocker}, not list it), or grade with a Python outside it that other "
            f"users can read: a virtualenv made from the system's Python, e.g. `{python_outside(blocker)} -m venv "
            f"/opt/fsdp` with torch, numpy, pytest and pytest-timeout installed in it, then "
            f"`/opt/fsdp/bin/python -m staff.autograder.grade ...`")


def python_outside(blocker: str) -> str:
    """A Python to make the virtualenv from that does not live under ``blocker`` (a venv links to the Python it was
    made from: `python3 -m venv` run through a pyenv shim under /root would give a venv the rank user still cannot
    run). The system's, where there is one; /usr/bin/python3 (to install) otherwise."""
    import shutil
    candidates = ["/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    for candidate in candidates:
        real = os.path.realpath(candidate) if candidate else ""
        if real and os.access(real, os.X_OK) and not (real + "/").startswith(blocker.rstrip("/") + "/"):
            return candidate
    return "/usr/bin/python3"


def syscall_filter_note(tree: Path) -> str:
    """Whether the ranks will refuse memfd_create and unshare here (tests/rank_isolation.py installs a seccomp
    filter in each rank; where the kernel or the container does not allow one, only the memory count applies):
    tried once in a child process, for the staff's log."""
    def probe() -> str:  # in the child: the filter installed there, not in the grader
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
            return why
        except BaseException as err:
            return f"the filter could not be tried: {type(err).__name__}: {err}"

    why = in_child(probe, 1000)
    return why or ("ranks refuse memfd_create, memfd_secret, unshare, setns, namespace clones, and every socket but "
                   "TCP (seccomp)")


def private_places_note() -> str:
    """Whether ranks get private /tmp, /dev/shm and TMPDIR here (tests/rank_places.py: a mount namespace each where
    root may make one, else a folder per rank that a sibling of the same uid can still enter): tried once in a
    child process (forked: one thread, as a rank is when it tries), for the staff's log."""
    def probe() -> str:
        try:
            from tests import rank_places
            rank_places.enter_own_mount_namespace()
            return rank_places.private_places_note()
        except BaseException as err:
            return f"private places could not be tried: {type(err).__name__}: {err}"
    return in_child(probe, 1000)
