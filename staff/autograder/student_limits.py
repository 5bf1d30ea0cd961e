"""Memory for all of the rank user's processes together, counted by the grading process (root) from outside.

Per-rank rlimits (tests/harness.py) bound each process, not the student: 8 forked children of 350 MB each, or
1.5 GB of files in /dev/shm, passed beside a 256 MB rank limit. A cgroup would count all of it, but a Gradescope
container (Docker, cgroup file system read-only, no CAP_SYS_ADMIN) offers none, so the grading process counts
instead, while each test runs: the proportional set size (Pss, /proc/<pid>/smaps_rollup) of every process of the
rank user, the files it owns on tmpfs mounts (memory too), and its System V shared-memory segments. At the
limit it kills every process of the user at once (tests/rank_isolation.py, kill_everything_of) and says so; the ranks
then fail as killed by SIGKILL, and the test's output carries the note.
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


def process_bytes(uid: int) -> int:
    """Pss of every live process of ``uid`` (VmRSS where smaps_rollup cannot be read)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration, ValueError):
            try:
                with open(f"/proc/{entry}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
            except (OSError, StopIteration, ValueError):
                continue
    return total


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


def student_bytes(uid: int, places: list[str]) -> dict[str, int]:
    return {"processes": process_bytes(uid), "tmpfs files": tmpfs_bytes(uid, places),
            "System V shared memory": sysv_shm_bytes(uid)}


class MemoryWatch:
    """While a test runs: poll the rank user's memory; at ``limit`` kill all of its processes (``kill``)."""

    def __init__(self, uid: int, limit: int, writable_places: list[str], kill):
        mounts = tmpfs_mounts()
        self.places = [p for p in writable_places
                       if any(p == m or p.startswith(m.rstrip("/") + "/") for m in mounts)]
        self.uid, self.limit, self.kill = uid, limit, kill
        self.peak = 0
        self.killed: dict[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self.killed, self.peak = None, 0
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
                f"and child process, files in /dev/shm and /tmp, shared memory)")

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            used = student_bytes(self.uid, self.places)
            total = sum(used.values())
            self.peak = max(self.peak, total)
            if total > self.limit and self.killed is None:
                self.killed = used
                self.kill(self.uid)
