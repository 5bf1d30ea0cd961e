"""What the grader removes after every test when rank bodies run as the unprivileged rank user (FSDP_RANK_USER,
as root): that user's processes first, then its System V IPC objects, its POSIX message queues, and its files in
every world-writable place (/tmp, /var/tmp, /dev/shm, ...). Each test starts without them.

The submission chose what there is to remove, so nothing here may fail a test or stop the grader
(issue 25: a 1,500-deep folder tree under /tmp made shutil.rmtree raise RecursionError, which ignore_errors does
not catch, in the teardown of every later test: 25 tests failed and 19 were not run). ``clean_up_after_test``
runs each step on its own, catches whatever it raises and logs it for the staff; it never raises. No step
recurses, follows a link or holds more than one folder open, and each has a bound on its work.

Processes go first: once none is left, nothing can add files, swap a folder for a link or hold memory while the
rest is removed.
"""

from __future__ import annotations

import os
import stat
import time


SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # where any user may write on every image (world_writable_places)
SKIP_WHEN_LISTING = ("/proc", "/sys", "/dev")  # kernel file systems: nothing there is a file a user leaves
# (/dev/shm and /dev/mqueue, which are, are looked at on their own)
WRITABLE_DEPTH = 4  # how deep world_writable_places looks (tests/staff/test_rank_user.py checks, without a
# depth limit, that no world-writable directory on the image lies deeper)
MQUEUE_DIR = "/dev/mqueue"  # POSIX message queues, where the image mounts their file system (Docker does)
MAX_ENTRIES_REMOVED = 1_000_000  # per test: a bound on the work, whatever the submission left


def clean_up_after_test(uid: int, places: tuple[str, ...], log) -> list[str]:
    """Remove everything of ``uid``'s (see the module docstring); return notes for the test's output. Each step
    runs on its own: one that raises is logged with ``log`` (the staff's log) and the others still run. Never
    raises."""
    notes = []
    steps = (
        ("processes", lambda: reap_user_processes(uid),
         "{} process(es) started by your code were still alive after this test and were killed; leave nothing "
         "running when a rank returns"),
        ("System V IPC", lambda: remove_user_ipc(uid),
         "{} System V shared-memory segment(s), semaphore set(s) or message queue(s) your code left were removed "
         "(each test starts without them)"),
        ("POSIX message queues", lambda: remove_user_mqueues(uid),
         "{} POSIX message queue(s) your code left were removed (each test starts without them)"),
        ("files", lambda: remove_user_files(uid, places),
         "{} file(s) or folder(s) your code left in shared folders (/tmp, /dev/shm, /run/lock, ...) were removed "
         "(each test starts without them)"),
    )
    for what, step, note in steps:
        try:
            count = step()
        except Exception as err:  # RecursionError, OSError, MemoryError, ...: the staff's problem, not the test's
            try:
                log(f"cleanup of uid {uid}'s {what} failed: {type(err).__name__}: {err}")
            except Exception:
                pass
            continue
        if count:
            notes.append("note: " + note.format(count))
    return notes


# ---- processes ---------------------------------------------------------------------------------------------
def kill_everything_of(uid: int) -> None:
    """tests/rank_isolation.py's kill_everything_of (the harness ends the rank user's processes with it after
    every run), imported when first needed: the plugin is loaded before pytest imports the tree's ``tests``
    package, and must not import one of its own (it would shadow the tree's)."""
    from tests.rank_isolation import kill_everything_of as kill  # grade.py runs from the tree's root: its tests
    kill(uid)


def rank_user_uid() -> int | None:
    user = os.environ.get("FSDP_RANK_USER", "").strip()
    if not user or os.geteuid() != 0:
        return None
    import pwd
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return None
    return uid if uid != 0 else None


def processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real user id is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        state = fields.get("State", "").split()
        uids = fields.get("Uid", "").split()
        if uids and int(uids[0]) == uid and state and state[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def reap_user_processes(uid: int) -> int:
    """SIGKILL every process of ``uid``; return how many there were.

    A process that forks and exits every few milliseconds outruns a list-then-kill loop (the pids are stale by
    the time they are killed). kill(-1, SIGKILL) sent *as that user* does not (tests/rank_isolation.py,
    kill_everything_of): the kernel signals every process the sender may signal (all of that user's, none of
    root's) while holding the task list, so no fork can slip between, and a fork that is under way fails on the
    pending SIGKILL. It works in any container where the grader is root (no cgroup or PID namespace needed:
    Gradescope grants neither)."""
    found = processes_of(uid)
    kill_everything_of(uid)  # always: a storm's processes can all be too young or too dead to be listed
    for _ in range(5):
        time.sleep(0.02)
        if not processes_of(uid):
            break
        kill_everything_of(uid)
    return len(found)


# ---- IPC -------------------------------------------------------------------------------------------------
def remove_user_ipc(uid: int) -> int:
    """Remove the SysV shared-memory segments, semaphore sets and message queues owned by ``uid`` (they outlive
    every process: 15 segments of 64 MiB were left after a grading run); return how many."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    IPC_RMID = 0
    removed = 0
    for kind, remove in (("shm", lambda i: libc.shmctl(i, IPC_RMID, None)),
                         ("sem", lambda i: libc.semctl(i, 0, IPC_RMID)),
                         ("msg", lambda i: libc.msgctl(i, IPC_RMID, None))):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except (OSError, ValueError):
            continue
        id_col, uid_col = 1, header.index("uid") if "uid" in header else None
        if uid_col is None:
            continue
        for row in rows:
            try:
                if int(row[uid_col]) == uid and remove(int(row[id_col])) == 0:
                    removed += 1
            except (IndexError, ValueError):
                continue
    return removed


def remove_user_mqueues(uid: int, where: str = MQUEUE_DIR) -> int:
    """Remove the POSIX message queues owned by ``uid`` (they outlive every process, like SysV IPC). They can be
    listed only where their file system is mounted (``/dev/mqueue`` in Docker); where it is not, the ranks
    cannot create any (RLIMIT_MSGQUEUE is 0 in the rank: tests/rank_isolation.py, apply_limits)."""
    removed = 0
    try:
        entries = list(os.scandir(where))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_uid == uid:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed


# ---- files -----------------------------------------------------------------------------------------------
def world_writable_places(roots: tuple[str, ...] = ("/",), skip: tuple[str, ...] = SKIP_WHEN_LISTING,
                          depth: int | None = WRITABLE_DEPTH) -> list[str]:
    """Every directory on this image where any user may create files (mode o+w), outermost only, found by a
    walk of the file system down to ``depth`` (a fraction of a second, once a session; symlinks are not
    followed). The rank user can leave files only there (it owns no directory), so these are what is cleaned
    after every test."""
    found: list[str] = []
    for extra in ("/dev/shm", MQUEUE_DIR):
        try:
            if os.stat(extra).st_mode & 0o002 and not os.path.islink(extra):
                found.append(extra)
        except OSError:
            pass
    stack = [(root, 1) for root in reversed(roots)]
    while stack:
        folder, level = stack.pop()
        try:
            st = os.stat(folder, follow_symlinks=False)
        except OSError:
            continue
        if st.st_mode & 0o002:
            found.append(folder)  # remove_user_files walks inside it
            continue
        if depth is not None and level > depth:
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) and entry.path not in skip:
                    stack.append((entry.path, level + 1))
            except OSError:
                continue
    return sorted(set(found))


def remove_user_files(uid: int, places: tuple[str, ...] = SHARED_TMP) -> int:
    """Remove everything ``uid`` owns in the world-writable ``places`` (and in world-writable folders under
    them, three levels down); return how many entries (a folder and all it holds count once). Never follows a
    link: a link the user made is removed, not its target."""
    removed = 0
    budget = [MAX_ENTRIES_REMOVED]
    stack = [(place, 0) for place in places]
    while stack:
        folder, depth = stack.pop()
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with os.scandir(fd) as it:
                entries = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        except OSError:
            entries = []
        try:
            for name, st in entries:
                if st.st_uid == uid:
                    try:
                        if stat.S_ISDIR(st.st_mode):
                            remove_tree(fd, name, budget)
                        else:
                            os.unlink(name, dir_fd=fd)
                        removed += 1
                    except OSError:
                        pass
                elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and depth < 3:
                    stack.append((os.path.join(folder, name), depth + 1))
        finally:
            os.close(fd)
    return removed


def remove_tree(parent_fd: int, name: str, budget: list[int]) -> None:
    """Remove the folder ``name`` (in the folder open as ``parent_fd``) and all it holds, however deep: a loop
    that holds one folder open at a time, goes down into a subfolder by name and back up through "..", and
    never follows a link (every process that could move things meanwhile is dead). What cannot be removed is
    left, and stops no other removal; ``budget[0]`` bounds the entries looked at."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    below: list[str] = []  # the names from `name` down to the folder open as fd
    stuck: set[tuple[int, int]] = set()  # folders that could not be emptied: not entered again
    try:
        while budget[0] > 0:
            down = None
            with os.scandir(fd) as it:
                for entry in it:
                    budget[0] -= 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            if (st.st_dev, st.st_ino) not in stuck:
                                down = entry.name
                                break
                        else:
                            os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        continue
            if down is not None:
                try:
                    child = os.open(down, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    st = os.stat(down, dir_fd=fd, follow_symlinks=False)
                    stuck.add((st.st_dev, st.st_ino))
                    continue
                os.close(fd)
                fd = child
                below.append(down)
                continue
            if not below:
                break  # `name` itself is as empty as it gets
            here = os.fstat(fd)
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            try:
                os.rmdir(below.pop(), dir_fd=fd)
            except OSError:
                stuck.add((here.st_dev, here.st_ino))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def remove_folder(path: str | os.PathLike) -> None:
    """Remove the folder ``path`` and all it holds, however deep, with ``remove_tree``'s loop (no recursion, no
    link followed); never raises: what cannot be removed is left. For the grader's own folders that ranks wrote
    into (grade.py: the run's TMPDIR with every run's fsdp-ranks-* folder; a --zip grading tree)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        remove_tree(fd, name, [MAX_ENTRIES_REMOVED])
    except OSError:
        pass
    finally:
        os.close(fd)
