"""A memory cgroup per witnessed rank, where this machine lets the harness make one: what the kernel charges to
the rank, all of it, for the Witness's peak (tests/harness.py).

A rank's resident memory (VmHWM, /proc/<pid>/status) misses what it holds outside its page tables: pages of a
``/dev/shm`` file mapped ``MAP_SHARED`` and dropped with ``MADV_DONTNEED`` stay in the file (issue 32: Shmem rose
197 MiB while VmHWM stayed at a correct implementation's level) and socket buffers. A memory cgroup is charged for them
(measured here, cgroup v1: 200 MiB of an unlinked /dev/shm mapping written and dropped showed as ``shmem`` in
``memory.stat``, 92 MiB of unix socket buffers in ``memory.kmem``), and the kernel keeps kernel memory's peak
itself, between the parent's readings too; tmpfs pages stay until they are really freed, so readings see them.

The parent makes the cgroup and moves the rank into it before the body runs (the rank waits for the parent
before its body); everything the rank starts stays in it. A rank running as the unprivileged rank user cannot
leave it (cgroup files are root's, and the rank's seccomp filter refuses new namespaces). Where no cgroup can be
made (not root, a read-only cgroup file system as in a Gradescope container, or cgroup v2, whose memory.peak
resets only as seen through one open file), ``RankCgroup.create`` returns None and ``ProcShmem`` counts what
/proc shows instead: the tmpfs and shared memory files the rank holds open or mapped (not socket buffers).
"""

from __future__ import annotations

import os
import time

V1_ROOT = "/sys/fs/cgroup/memory"  # cgroup v1's memory hierarchy


class RankCgroup:
    """One rank's memory cgroup: ``add(pid)``, ``start()`` when its body starts, then ``hidden()``: what it holds
    that its resident memory does not show.

    Not the cgroup's whole charge: a forked rank's writes to pages it shares with the forkserver (the
    refcounts of the modules it imported) are charged as new pages while its resident memory stays (PyTorch's FSDP2
    step: +33 MiB charged over a 204 MiB rise), and the tests' bounds are resident memory's. What resident memory
    misses is counted on top of it: shared and tmpfs pages not mapped now, and kernel memory (``memory.kmem``:
    unix socket buffers among it). Not TCP socket buffers (``memory.kmem.tcp``): gloo's own connections to the
    peers hold 8-11 MiB of them in a correct step, as much as the bound's margin under PyTorch's FSDP2, and what
    they hold depends on the load; a rank hiding memory in loopback TCP connections is not counted (issue 32's
    case used unix sockets)."""

    def __init__(self, path: str):
        self.path = path
        self.started = False
        self.kmem_start = 0

    @classmethod
    def create(cls, name: str) -> "RankCgroup | None":
        """A new cgroup named ``name`` (unique per run and rank), or None where none can be made here."""
        if os.geteuid() != 0 or not os.path.isfile(os.path.join(V1_ROOT, "memory.max_usage_in_bytes")):
            return None
        path = os.path.join(V1_ROOT, name)
        try:
            os.mkdir(path, 0o755)
        except OSError:
            return None
        return cls(path)

    def add(self, pid: int) -> bool:
        return self._write("cgroup.procs", str(pid))

    def start(self) -> None:
        """The body starts: kernel memory's peaks count from here (writing 0 resets one to the usage now)."""
        self.started = self._write("memory.kmem.max_usage_in_bytes", "0")
        self.kmem_start = self._read("memory.kmem.usage_in_bytes") or 0

    def reset_peak(self) -> None:
        """At a reading the rank asked for (Witness marks): kernel memory's peak counts from here. The peak until
        now was read just before (the whole run's peak keeps it); kmem_start stays, so what the rank added since
        its body started still counts."""
        self._write("memory.kmem.max_usage_in_bytes", "0")

    def hidden(self, rss_shmem: int) -> int | None:
        """Bytes the rank holds beyond its resident memory now: shared and tmpfs pages charged to it less those it
        maps (``rss_shmem``, RssShmem: part of its resident memory already), and the peaks of its kernel memory
        since ``start``. None when they cannot be read."""
        if not self.started:
            return None
        stat, kmem = self._stat(), self._read("memory.kmem.max_usage_in_bytes")
        if stat is None or kmem is None:
            return None
        return max(0, stat.get("shmem", 0) - rss_shmem) + max(0, kmem - self.kmem_start)

    def _stat(self) -> dict[str, int] | None:
        try:
            with open(os.path.join(self.path, "memory.stat")) as f:
                return {k: int(v) for k, v in (line.split() for line in f)}
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (they take a moment to leave it after SIGKILL)."""
        deadline = time.monotonic() + 5.0
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left behind, empty of anything that runs: harmless, and named after its run
                time.sleep(0.02)

    def _read(self, name: str) -> int | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _write(self, name: str, value: str) -> bool:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(value)
            return True
        except OSError:
            return False


class ProcShmem:
    """Where no cgroup can be made (a Gradescope container): what /proc shows of the tmpfs and shared memory a rank
    holds beyond its page tables, read by the parent, for the rank and every process it started (``pids``):

    - the tmpfs and shared memory files they hold open or mapped (/dev/shm files, deleted or not, memfd files,
      shared anonymous mappings): their allocated blocks;
    - the SysV segments they created, attached or not (/proc/sysvipc/shm, by creator pid, or by owner where the
      rank has a user of its own): their resident pages;
    - files on a tmpfs anyone may write (/dev/shm), closed and unmapped, created since the body started, owned
      by the rank's user (any owner where ranks run as the grader's own user): their allocated blocks;

    less what the rank maps now (RssShmem, part of its resident memory already). Socket buffers are counted by
    the witness itself (harness_sockets). Reading a mapping whose descriptor was closed needs
    /proc/<pid>/map_files (root: the grader); without it only open descriptors and named paths are seen.

    Each reading lists descriptors and mappings, so it runs every ``EVERY``-th sample only (the tmpfs walk every
    ``WALK_EVERY``-th listing): pages in a tmpfs file or a segment stay until they are really freed (truncated,
    removed, or the last handle gone), so a later reading still sees them."""

    EVERY = 10  # the parent samples every 5 ms: a listing every 50 ms
    WALK_EVERY = 5  # and a walk of the shared tmpfs folders every 250 ms
    WALK_MAX_ENTRIES = 20_000  # a walk stops after this many entries (a rank cannot make the parent walk forever)

    def __init__(self, pid: int, uid: int | None = None):
        self.pid, self.uid = pid, uid  # uid: the rank's own user, where it has one (else files of any owner)
        self.started = True
        self.calls = 0
        self.last = 0
        self.tmpfs = tuple(m.rstrip("/") + "/" for m in _tmpfs_mounts())
        self.shared = [m for m in _tmpfs_mounts() if _writable_by_others(m)]
        self.creators: set[int] = {pid}  # every process of the rank ever seen: SysV segments by creator
        self.before: set[tuple[int, int]] = set()  # tmpfs files there when the body started
        self.walked: dict[tuple[int, int], int] = {}

    def start(self) -> None:
        self.before = set(_walk(self.shared, None, self.WALK_MAX_ENTRIES))

    def hidden(self, rss_shmem: int, pids: list[int] | None = None) -> int | None:
        self.calls += 1
        if self.calls % self.EVERY != 1:
            return self.last
        pids = pids or [self.pid]
        self.creators.update(pids)
        seen: dict[tuple[int, int], int] = {}
        for pid in pids:
            base = f"/proc/{pid}"
            for folder in ("fd", "map_files"):
                try:
                    names = os.listdir(f"{base}/{folder}")
                except OSError:
                    continue
                for name in names:
                    link = f"{base}/{folder}/{name}"
                    try:
                        target = os.readlink(link)
                        if not (target.startswith(("/memfd:", "/dev/zero")) or target.startswith(self.tmpfs)):
                            continue  # SysV segments (/SYSV...) are counted from /proc/sysvipc/shm below
                        st = os.stat(link)
                    except OSError:
                        continue
                    seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        if self.calls // self.EVERY % self.WALK_EVERY == 0:
            self.walked = {key: size for key, size in _walk(self.shared, self.uid, self.WALK_MAX_ENTRIES).items()
                           if key not in self.before}
        seen.update(self.walked)
        self.last = max(0, sum(seen.values()) + sysv_bytes(self.creators, self.uid) - rss_shmem)
        return self.last

    def remove(self) -> None:
        pass


def rank_processes(pid: int, whole_session: bool = False) -> list[int]:
    """The rank and every process it started: its descendants (/proc/<pid>/task/<tid>/children, a child that left
    the rank's session included) and, with ``whole_session`` (a walk of /proc: slower), the processes of its
    session (the rank calls setsid) whose parent is gone."""
    found, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if child not in found:
                    found.add(child)
                    todo.append(child)
    if whole_session:
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in found:
                try:
                    with open(f"/proc/{name}/stat", "rb") as f:
                        if int(f.read(1024).rsplit(b")", 1)[1].split()[3]) == pid:
                            found.add(int(name))
                except (OSError, IndexError, ValueError):
                    continue
    return [pid] + sorted(found - {pid})


def private_bytes(pid: int) -> int:
    """What a process holds that no other maps (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup): for a
    rank's forked child, what it added after the fork (the pages it shares with the rank are not counted)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


def sysv_bytes(creators: set[int], uid: int | None) -> int:
    """The resident bytes of the SysV shared memory segments these processes created (or, with ``uid``, that
    user owns), attached or not: a detached segment stays until it is removed."""
    total = 0
    try:
        with open("/proc/sysvipc/shm") as f:
            header = f.readline().split()
            rows = [dict(zip(header, line.split())) for line in f]
    except OSError:
        return 0
    for row in rows:
        try:
            if int(row["cpid"]) in creators or (uid is not None and int(row["cuid"]) == uid):
                total += int(row.get("rss", row["size"]))
        except (KeyError, ValueError):
            continue
    return total


def _walk(folders: list[str], uid: int | None, budget: int) -> dict[tuple[int, int], int]:
    """The regular files under ``folders`` (owned by ``uid``, or any owner when None): (dev, inode) -> the bytes
    allocated to them. Never follows a link; stops after ``budget`` entries."""
    out: dict[tuple[int, int], int] = {}
    todo = list(folders)
    while todo and budget > 0:
        folder = todo.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                budget -= 1
                if budget <= 0:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if uid is None or st.st_uid == uid:
                            out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
                except OSError:
                    continue
    return out


def _writable_by_others(path: str) -> bool:
    """A tmpfs mount a rank may write to although it is not its own (/dev/shm: mode 1777)."""
    try:
        return bool(os.stat(path).st_mode & 0o002)
    except OSError:
        return False


def _tmpfs_mounts() -> list[str]:
    try:
        with open("/proc/mounts") as f:
            return [line.split()[1] for line in f if len(line.split()) > 2 and line.split()[2] == "tmpfs"]
    except OSError:
        return []
