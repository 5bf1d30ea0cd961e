"""Starting ranks (tests/harness.py's room for steps 1-2 and the wait of step 4): the forkserver every rank is forked
from, what the parent knows about each rank (``_Rank``), how a rank finds its body, and the parent's wait for the
ranks' reports or deaths (``_collect``), which samples the witnessed ranks on the way.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import threading
import time

from tests.harness_report import RankFailure, _ended, _explain_failures, _explain_timeout, _read_report
from tests.harness_witness import WITNESS_SAMPLE_S

GRACE_AFTER_FAILURE_S = 0.5  # after a first failure, how long other ranks get to report theirs before the kill
STORE_BOUND_BYTES = 1 << 20  # the run's FileStore: 64 process groups on 4 ranks left it at 54,620 bytes (StoreWatch)
STOPPED_POLL_S = 1.0  # how often the parent looks for stopped ranks while it waits
STOPPED_GRACE_S = 2.0  # a rank stopped this long is a failure (a stop the body resumes itself is fine)


# One forkserver per pytest process, started on first use. Preloading the harness and its rooms (by the names
# pytest gave them) also preloads torch, torch.distributed and pytest, which test modules import again in every
# rank; the rank's entry point (harness_rank._rank_main) is pickled by its qualified name and found there.
# torch.distributed.fsdp (FSDP2, MixedPrecisionPolicy) costs ~0.6 s to import: once here, not once per rank.
_PACKAGE = __name__.rpartition(".")[0]  # "tests"
_ROOMS = ["harness", "harness_report", "harness_witness", "harness_cleanup", "harness_rank", "harness_start"]
_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp"] + (
    [f"{_PACKAGE}.{room}" if _PACKAGE else room for room in _ROOMS] if __name__ != "__main__" else [])
_CTX.set_forkserver_preload(_PRELOAD)
_forkserver_lock = threading.Lock()


def _ensure_forkserver() -> None:
    """Start the forkserver (once) so that it can import this module. Python 3.11's forkserver ignores the
    parent's sys.path when it preloads, and runs in the parent's working directory: without help it cannot
    find `tests.harness` and its rooms, and every rank would import it and pytest again (+150 ms a rank)."""
    from multiprocessing import forkserver
    with _forkserver_lock:
        root = os.path.dirname(os.path.abspath(__file__))
        for _ in range(__name__.count(".")):  # tests/harness_start.py as tests.harness_start -> the repo root
            root = os.path.dirname(root)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([old] if old else []))
        try:
            forkserver.ensure_running()
        finally:  # only the forkserver's environment has it; ranks get the parent's (see _run_body)
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old


class _Rank:
    """What the parent knows about one rank of a run."""

    def __init__(self, rank: int, proc, conn, out_path: str, stack_path: str):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.out_path, self.stack_path = out_path, stack_path
        self.status = "running"  # -> "ok", or a RankFailure kind
        self.result = None
        self.error: dict = {}  # for "raised"/"bad-result": type, message, traceback
        self.exitcode: int | None = None
        self.finished_at: float | None = None
        self.buffer = bytearray()  # the report as it arrives
        self.report: dict | None = None  # the complete report
        self.bad = ""  # for "bad-message": what was wrong with it
        self.ack = None  # with a witness: the parent's end of the pipe that lets the rank exit (see _Witnessing)
        self.kernel = None  # with a witness: what the kernel showed about this rank (_KernelSamples)


def _body_reference(body) -> dict:
    """How a rank finds `body`: its module and qualified name, and its file in case the module is not on
    sys.path (pytest's importlib import mode)."""
    module, qualname = getattr(body, "__module__", None), getattr(body, "__qualname__", "")
    if not callable(body) or module is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_ranks needs a module-level function as its body, got {body!r}")
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not body:
        raise TypeError(f"run_ranks: {module}.{qualname} does not name the body {body!r}")
    filename = getattr(getattr(sys.modules[module], "__spec__", None), "origin", None)
    return dict(module=module, qualname=qualname, filename=filename)


class StoreWatch:
    """The size of the run's FileStore file, the most the parent saw. The store is the one file every rank of a
    run shares (the process group's rendezvous: each group's addresses and barriers, a few KiB), and it only grows
    (every ``set`` appends), so its size bounds what passed through it. Data moved between ranks with
    ``store.set``/``get`` would pass no socket the witness counts: past STORE_BOUND_BYTES the run fails."""

    def __init__(self, path: str):
        self.path = path
        self.sizes: dict[int, int] = {}  # inode -> the most seen: a store unlinked and made anew counts both files
        # Held open, so that the file the run started with is read even if a rank unlinks it.
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)

    @property
    def most(self) -> int:
        return sum(self.sizes.values())

    def sample(self) -> None:
        for read in (lambda: os.fstat(self.fd), lambda: os.stat(self.path, follow_symlinks=False)):
            try:
                st = read()
            except OSError:
                continue  # removed by its last user at the end of the run: its size was read before
            self.sizes[st.st_ino] = max(self.sizes.get(st.st_ino, 0), st.st_size)

    def close(self) -> None:
        os.close(self.fd)

    def failure(self) -> "RankFailure | None":
        if self.most <= STORE_BOUND_BYTES:
            return None
        return RankFailure(
            f"the process group's store (the file the ranks rendezvous through) grew to {self.most} bytes, more "
            f"than the {STORE_BOUND_BYTES} that setting up every process group of a run needs: data passed "
            f"between ranks through the store instead of through collectives. Move data between ranks only with "
            f"torch.distributed's collectives.", kind="store", rank=None)


def _collect(ranks: list[_Rank], *, deadline: float, timeout: float,
             memory_limit_bytes: int | None, store: StoreWatch | None = None) -> RankFailure | None:
    """Wait for every rank's message or death; stop early after a failure. Returns the failure, if any."""
    give_up_at = deadline
    failures: list[_Rank] = []
    stopped_since: dict[int, float] = {}
    while True:
        running = [r for r in ranks if r.status == "running"]
        now = time.monotonic()
        if not running or now >= give_up_at:
            break
        waitables = [r.conn for r in running] + [r.proc.sentinel for r in running]
        witnessed = [r for r in running if r.kernel is not None]
        poll = min(STOPPED_POLL_S, WITNESS_SAMPLE_S) if witnessed else STOPPED_POLL_S
        ready = set(mp.connection.wait(waitables, timeout=min(give_up_at - now, poll)))
        for r in witnessed:
            r.kernel.sample()
        if store is not None:
            store.sample()
        for r in running:
            # A report is read before a death is believed: a rank exits right after sending.
            if r.conn in ready:
                _read_report(r)
            if r.status != "running":
                pass
            elif r.proc.sentinel in ready and not r.conn.poll(0):
                _read_report(r)  # whatever is left, then EOF
                if r.status == "running":
                    _ended(r)
            elif _proc_state(r.proc.pid) == "T":
                # Stopped (SIGSTOP, SIGTSTP): it can neither run nor answer, and its peers wait for it in their
                # collectives until they time out. It is the cause, not them.
                since = stopped_since.setdefault(r.rank, time.monotonic())
                if time.monotonic() - since >= STOPPED_GRACE_S:
                    r.status = "stopped"
            else:
                stopped_since.pop(r.rank, None)
            if r.status not in ("running", "ok"):
                r.finished_at = time.monotonic()
                failures.append(r)
                give_up_at = min(give_up_at, r.finished_at + GRACE_AFTER_FAILURE_S)
    for r in ranks:  # stopped while the others failed or timed out: still the cause
        if r.status == "running" and _proc_state(r.proc.pid) == "T":
            r.status = "stopped"
            failures.append(r)
    if failures:
        return _explain_failures(failures, ranks, memory_limit_bytes)
    hung = [r for r in ranks if r.status == "running"]
    if hung:
        return _explain_timeout(hung, ranks, timeout)
    return None


def _proc_state(pid: int | None) -> str:
    """The process's state letter from /proc (R, S, D, T stopped, t traced, Z, ...), or "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read(4096).rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, TypeError):
        return ""

