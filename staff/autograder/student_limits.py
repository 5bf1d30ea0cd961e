"""Memory for all of the rank user's processes together, counted by the grading process (root) from outside.

Per-rank rlimits (tests/harness.py) bound each process, not the student: 8 forked children of 350 MB each, or
1.5 GB of files in /dev/shm, passed beside a 256 MB rank limit. A cgroup would count all of it, but a Gradescope
container (Docker, cgroup file system read-only, no CAP_SYS_ADMIN) offers none, so the grading process counts
instead, while each test runs: the private memory of every process of the rank user (Pss less its shared part,
/proc/<pid>/smaps_rollup), plus the shared memory (tmpfs) the test added. Shared memory is counted as a whole,
because not all of it has an owner to find: issue 25's three ranks held 2.8 GiB in memfd files and in /dev/shm
files they had unlinked, against a 2 GiB limit, and nothing was killed. So it is the growth, since the test
started, of the kernel's own count of shared memory (``Shmem``: tmpfs and memfd files, deleted or not, SysV
segments, shared anonymous mappings, a private tmpfs mounted in a namespace): the grading container's cgroup's
where there is one (memory.stat), else the machine's (/proc/meminfo). What the rank user's files on tmpfs, its
System V segments and its processes' mapped shared memory add up to is a lower bound, used when it is larger.
Socket buffers (issue 32: three ranks held 1 GiB each in unix socket buffers and were not killed) are kernel
memory no process maps: counted as the growth of the cgroup's kernel memory (v1 ``memory.kmem.usage_in_bytes``,
v2 ``sock`` in memory.stat) since the test started, where the grading container's cgroup can be read.
At the limit it kills every process of the user at once (tests/rank_isolation.py, kill_everything_of) and says
so; the ranks then fail as killed by SIGKILL, and the test's output carries the note.
"""

from __future__ import annotations

import os
import threading

POLL_S = 0.25


def tmpfs_mounts() -> list[str]:
    try:
        with open("/proc/mounts") as f:
            return [line.split()[1] for line in f if len(line.split()) > 2 and line.split()[2] == "tmpfs"]
    except OSError:
        return []


def process_bytes(uid: int) -> tuple[int, int]:
    """(private, shared) memory of every live process of ``uid``: Pss less Pss_Shmem, and Pss_Shmem (VmRSS and 0
    where smaps_rollup cannot be read)."""
    private = shared = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith("kB\n")}
            private += fields["Pss"] - fields.get("Pss_Shmem", 0)
            shared += fields.get("Pss_Shmem", 0)
        except (OSError, KeyError, ValueError):
            try:
                with open(f"/proc/{entry}/status") as f:
                    private += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
            except (OSError, StopIteration, ValueError):
                continue
    return private, shared


def shmem_source() -> tuple[str, str]:
    """Where the kernel counts shared memory for this process: (file, key). The cgroup's memory.stat (v2
    ``shmem``, v1 ``total_shmem``, which includes child cgroups) where it can be read, else /proc/meminfo."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        lines = []
    candidates = []
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":  # cgroup v2
            candidates += [(f"/sys/fs/cgroup{path.rstrip('/')}/memory.stat", "shmem"),
                           ("/sys/fs/cgroup/memory.stat", "shmem")]
        elif "memory" in controllers.split(","):
            candidates += [(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.stat", "total_shmem"),
                           ("/sys/fs/cgroup/memory/memory.stat", "total_shmem")]
    for where, key in candidates:
        if read_shmem(where, key) is not None:
            return where, key
    return "/proc/meminfo", "Shmem"


def socket_source() -> tuple[str, str] | None:
    """Where the kernel counts socket buffers for this process's cgroup: (file, key; "" for a file holding one
    number), or None (no cgroup to read: not counted)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        lines = []
    candidates = []
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if controllers == "":  # cgroup v2: network buffers, unix sockets' included
            candidates += [(f"/sys/fs/cgroup{path.rstrip('/')}/memory.stat", "sock")]
        elif "memory" in controllers.split(","):  # v1: all kernel memory, unix socket buffers among it
            candidates += [(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.kmem.usage_in_bytes", ""),
                           ("/sys/fs/cgroup/memory/memory.kmem.usage_in_bytes", "")]
    for where, key in candidates:
        if read_shmem(where, key) is not None:
            return where, key
    return None


def read_shmem(where: str, key: str) -> int | None:
    try:
        with open(where) as f:
            if not key:  # a file holding one number (cgroup v1's memory.kmem.usage_in_bytes)
                return int(f.read().split()[0])
            for line in f:
                name, _, value = line.partition(" ") if where != "/proc/meminfo" else line.partition(":")
                if name == key:
                    return int(value.split()[0]) * (1024 if where == "/proc/meminfo" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def tmpfs_bytes(uid: int, places: list[str]) -> int:
    """Bytes of the files ``uid`` owns under ``places`` (tmpfs folders it can write), allocated blocks."""
    total = 0
    for place in places:
        stack = [place]
        while stack:
            folder = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == uid:
                    total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False) and len(stack) < 10_000:
                    stack.append(e.path)
    return total


def sysv_shm_bytes(uid: int) -> int:
    try:
        with open("/proc/sysvipc/shm") as f:
            header, *rows = [line.split() for line in f]
        col_uid, col_size = header.index("uid"), header.index("size")
        return sum(int(r[col_size]) for r in rows if int(r[col_uid]) == uid)
    except (OSError, ValueError, IndexError):
        return 0


def student_bytes(uid: int, places: list[str], shmem_growth: int = 0, socket_growth: int = 0) -> dict[str, int]:
    """The rank user's memory: its processes' private memory, the shared memory (the growth of the kernel's
    count since the test started, or what the user's files, segments and mappings add up to, if more) and the
    growth of the kernel's count of socket buffers."""
    private, mapped_shared = process_bytes(uid)
    owned = tmpfs_bytes(uid, places) + sysv_shm_bytes(uid)
    return {"processes": private, "shared memory (tmpfs, memfd, /dev/shm, System V)": max(shmem_growth, owned,
                                                                                         mapped_shared),
            "socket buffers": socket_growth}


class MemoryWatch:
    """While a test runs: poll the rank user's memory; at ``limit`` kill all of its processes (``kill``)."""

    def __init__(self, uid: int, limit: int, writable_places: list[str], kill):
        mounts = tmpfs_mounts()
        self.places = [p for p in writable_places
                       if any(p == m or p.startswith(m.rstrip("/") + "/") for m in mounts)]
        self.uid, self.limit, self.kill = uid, limit, kill
        self.shmem = shmem_source()
        self.shmem_baseline = 0
        self.sockets = socket_source()
        self.sockets_baseline = 0
        self.peak = 0
        self.killed: dict[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self.killed, self.peak = None, 0
        self.shmem_baseline = read_shmem(*self.shmem) or 0  # before the ranks start
        self.sockets_baseline = (read_shmem(*self.sockets) or 0) if self.sockets else 0
        self._thread = threading.Thread(target=self._run, name="fsdp-student-memory", daemon=True)
        self._thread.start()

    def stop(self) -> str | None:
        """Stop watching; a note for the test's output if the user was killed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.killed is None:
            return None
        parts = ", ".join(f"{k} {v >> 20} MiB" for k, v in self.killed.items())
        return (f"note: your code's processes were all killed: together they used {sum(self.killed.values()) >> 20} "
                f"MiB ({parts}), over the {self.limit >> 20} MiB a submission may use at once (every process "
                f"and child process, files in /dev/shm and /tmp, deleted or not, memfd files, shared memory, "
                f"socket buffers)")

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            now = read_shmem(*self.shmem)
            sockets = (read_shmem(*self.sockets) or 0) if self.sockets else 0
            used = student_bytes(self.uid, self.places, max(0, (now or 0) - self.shmem_baseline),
                                 max(0, sockets - self.sockets_baseline))
            total = sum(used.values())
            self.peak = max(self.peak, total)
            if total > self.limit and self.killed is None:
                self.killed = used
                self.kill(self.uid)
