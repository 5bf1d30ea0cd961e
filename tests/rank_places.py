"""Ranks share no path (issue 40 item 4): each rank's temporary folders are its own when grading as root.

Before issue 40 the run's TMPDIR was one folder for all its ranks, and /tmp and /dev/shm were the machine's: a
file that both ranks map (``torch.from_file(shared=True)``) carried a whole all-reduce between them, counted at no
socket. Ranks also share one uid, so ``umask 077`` (or a file mode) hides nothing from the sibling.

Two ways, applied in the rank (tests/rank_isolation.py calls both):

- **A mount namespace of its own** (``enter_own_mount_namespace``, the rank's first step, while it still has one
  thread: every thread it starts later shares it), where the kernel lets root make one (a container without
  CAP_SYS_ADMIN does not). Right before the drop to the rank user (``make_places_private``), a fresh tmpfs that only
  the rank user may enter is mounted on every shared temporary place (``SHARED_PLACES``: /tmp, /var/tmp, /dev/shm,
  ...) and on the run's TMPDIR (the rank's folder ``rank_dir/tmp``). The only path the ranks still share is the
  FileStore's file (the process group's rendezvous), bound back into the new tree. A file rank 0 writes at any of
  these paths, whatever its mode, is not there for rank 1: rank 1 sees its own empty tmpfs. The tmpfs's pages are
  shared memory of the rank's memory cgroup, so the grader counts them; they go when the rank's last process does.
- **Otherwise, a folder per rank**: TMPDIR and HOME become ``rank_dir/tmp/rank<N>``, mode 700. That keeps honest
  ranks apart, and keeps ranks apart from everyone else; but ranks that share one uid can still enter each other's
  folder, and /tmp and /dev/shm stay shared (``private_places_note`` says so in the staff's log).
"""

from __future__ import annotations

import ctypes
import os
import sys

# World-writable places a rank could meet its sibling in, covered by a private tmpfs where they are folders.
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/run/lock", "/var/lock")
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_own_namespace = ""  # /proc/self/ns/mnt once the rank has a mount namespace of its own, else ""
_why_not = "not tried (ranks not graded as root)"


def enter_own_mount_namespace() -> None:
    """unshare(CLONE_NEWNS) as root, with one thread, and every mount made private (so nothing mounted here
    reaches the machine's namespace). Nothing is mounted yet: a rank that never drops to the rank user sees the
    same tree as before. Where the kernel refuses, the rank stays in the machine's namespace (folders per rank)."""
    global _own_namespace, _why_not
    if os.geteuid() != 0:
        return
    if os.environ.get("FSDP_RANK_MOUNT_NAMESPACE") != "1":
        # Off unless asked for: graded as the rank user (the staff's setup.sh image), the private tmpfs first hid
        # the Python and the tree laid out under /tmp (now bound back), and what torch writes to its temporary
        # folders there counts as the rank's memory, which no memory bound has been measured against on that
        # image yet. On once it has.
        _why_not = "off by default (FSDP_RANK_MOUNT_NAMESPACE=1 turns it on)"
        return
    if len(os.listdir("/proc/self/task")) != 1:  # a thread started before would keep the machine's tree
        _why_not = "the rank had started threads before its mount namespace"
        return
    libc = ctypes.CDLL(None, use_errno=True)
    before = os.readlink("/proc/self/ns/mnt")
    if libc.unshare(_CLONE_NEWNS) != 0:
        _why_not = f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}"
        return
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        _why_not = f"making mounts private failed: {os.strerror(ctypes.get_errno())}"
        return  # in a namespace of its own, but a mount could reach the machine's: mount nothing
    now = os.readlink("/proc/self/ns/mnt")
    if now != before:
        _own_namespace, _why_not = now, ""


def _mount_tmpfs(libc, where: str, uid: int, gid: int) -> None:
    options = f"mode=0700,uid={uid},gid={gid}".encode()
    if libc.mount(b"tmpfs", where.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        raise OSError(ctypes.get_errno(), f"mounting a private tmpfs on {where}: {os.strerror(ctypes.get_errno())}")


def _under(path: str, place: str) -> bool:
    return path == place or path.startswith(place.rstrip("/") + "/")


def _namespace_holds() -> bool:
    """This process still has the namespace it made, and every thread shares it (none kept the machine's)."""
    if not _own_namespace:
        return False
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.readlink(f"/proc/self/task/{tid}/ns/mnt") != _own_namespace:
                return False
        except OSError:
            continue  # a thread that just ended
    return True


def _code_paths(rank_dir: str) -> list[str]:
    """The folders the rank still imports from (its Python, its site-packages, the tree the tests run from: a
    TA's ``grade --zip`` and the staff's image test lay them out under /tmp), outermost only, the run's own folder
    apart. Torch imports some modules only when first used (``torch.save`` its serialization helpers), so these
    must stay readable under the cover."""
    found = set()
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path):
        if not path or not os.path.isabs(path):
            continue
        path = os.path.realpath(path)
        if os.path.isdir(path) and not _under(path, rank_dir) and not _under(rank_dir, path):
            found.add(path)
    outermost: list[str] = []
    for path in sorted(found, key=len):
        if not any(_under(path, kept) for kept in outermost):
            outermost.append(path)
    return outermost


def _make_owned_path(path: str, uid: int, gid: int) -> None:
    """Every missing folder of ``path`` made and given to the rank user: they lie in the rank's own tmpfs, and the
    run's folders above the rank's are where torch keeps its caches (the TMPDIR it saw when imported)."""
    missing = []
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for folder in reversed(missing):
        os.mkdir(folder, 0o711)
        os.chown(folder, uid, gid)


def make_places_private(rank_dir: str, rank: int, uid: int, gid: int) -> str:
    """Still root, right before the drop to (uid, gid): give the rank private temporary places, and point TMPDIR
    and HOME at its own folder. Returns "namespace" or "folders" (which way was taken)."""
    rank_dir = os.path.realpath(rank_dir)
    tmp, store = os.path.join(rank_dir, "tmp"), os.path.join(rank_dir, "store")
    if _namespace_holds():
        libc = ctypes.CDLL(None, use_errno=True)
        store_fd = os.open(store, os.O_PATH | os.O_CLOEXEC)  # the rendezvous file, to bind back after the cover
        code = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in _code_paths(rank_dir)]
        try:
            covered, mounted = False, []
            for place in SHARED_PLACES:
                if os.path.islink(place) or not os.path.isdir(place) or not os.stat(place).st_mode & 0o002:
                    continue  # a link (/var/lock -> /run/lock) is covered through what it names
                _mount_tmpfs(libc, place, uid, gid)
                mounted.append(place)
                covered = covered or _under(rank_dir, place)
            for path, fd in code:  # the Python and the tree under a covered place: bound back, where they were
                if any(_under(path, place) for place in mounted):
                    os.makedirs(path, 0o755, exist_ok=True)
                    if libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC,
                                  None) != 0:
                        raise OSError(ctypes.get_errno(),
                                      f"binding {path} back: {os.strerror(ctypes.get_errno())}")
            if covered:  # the run's folder was under a covered place: rebuild its path, the store bound back in
                _make_owned_path(rank_dir, uid, gid)
                open(store, "w").close()
                if libc.mount(f"/proc/self/fd/{store_fd}".encode(), store.encode(), None, _MS_BIND, None) != 0:
                    raise OSError(ctypes.get_errno(), f"binding the store back: {os.strerror(ctypes.get_errno())}")
                os.mkdir(tmp, 0o700)
                os.chown(tmp, uid, gid)
            else:  # the run's folder is elsewhere: its shared tmp gets a private tmpfs of its own
                _mount_tmpfs(libc, tmp, uid, gid)
        finally:
            os.close(store_fd)
            for _, fd in code:
                os.close(fd)
        folder, way = tmp, "namespace"
    else:
        folder, way = os.path.join(tmp, f"rank{rank}"), "folders"
        os.mkdir(folder, 0o700)
        os.chown(folder, uid, gid)
    os.environ["TMPDIR"] = os.environ["HOME"] = folder
    import tempfile
    tempfile.tempdir = None  # tempfile caches the folder it found first: look again
    return way


def private_places_note() -> str:
    """For the staff's log: which way ranks get private places here (the namespace, or folders and why)."""
    if _own_namespace:
        return "ranks get private /tmp, /var/tmp, /dev/shm and TMPDIR (a mount namespace each)"
    return (f"ranks get a TMPDIR folder each, but share /tmp and /dev/shm (no mount namespace: {_why_not}); ranks "
            f"that share one uid can enter each other's folder")
