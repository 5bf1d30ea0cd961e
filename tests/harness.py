"""The distributed test harness: run a test body on W fresh rank processes, and never hang or be fooled.

    from tests.harness import run_ranks

    def _body(rank, world_size, n):              # module level, so a rank can import it by name
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)                       # the default process group is ready
        return t                                 # comes back to the test, in rank order

    def test_sum():
        results = run_ranks(_body, 4, 3)         # body(rank, 4, 3) on ranks 0..3
        assert all(torch.equal(t, torch.full((3,), 6.0)) for t in results)

The protocol, step by step:

1. Rank processes come from one multiprocessing "forkserver" per pytest process. The forkserver imports torch,
   torch.distributed and this module once; each rank is a fork of it, so a rank starts in tens of milliseconds
   instead of the 1-2 s it takes to import torch. The forkserver never imports a test module or student code,
   and neither does the pytest process: student code runs only inside ranks, where the body calls `adapters`.
2. Each rank starts its own session (os.setsid), so its process group holds it and anything it spawns; the
   harness always ends a run by SIGKILLing every rank's whole group. A lifeline thread in each rank blocks on a
   pipe whose only write end the pytest process holds: if pytest dies, for any reason, the read returns EOF and
   the rank kills its own group. (PR_SET_PDEATHSIG would not do: a rank's parent is the forkserver.)
3. A rank redirects its stdout and stderr (file descriptors 1 and 2, so C++ output too) to a per-rank file,
   registers faulthandler for SIGUSR1 (stacks of every thread, to a per-rank file) and for fatal signals, sets
   the parent's environment plus FSDP_RANK_PROCESS=1 and one thread, joins the default process group through a
   FileStore (never a TCP port) with a short collective timeout, waits at a barrier for every rank, and applies
   its limits (memory, file size, processes). Two directories per run: the parent's, holding the output and
   stack files (created by the rank before it drops privileges, so the body can neither replace them with a link
   nor a FIFO), and inside it the body's own (the FileStore, TMPDIR and HOME), removed with the run. The parent
   reads a rank's files back without following links, only if they are regular files, and only their tail.
4. The rank reports data; the parent decides. After the body returns, the rank meets the others at a closing
   barrier, destroys the process group and sends its result (torch.save, length-prefixed) down its pipe, then
   exits with code 0. Nothing in a rank is trusted to say "passed": a rank runs student code, which can read
   or rewrite anything in its own process (its memory, the harness's functions, torch's), so no secret kept there
   could stay secret. The parent reads each report without blocking and with a size cap (MAX_MESSAGE_BYTES)
   inside the run's timeout, loads it with torch.load(weights_only=True) (tensors and plain containers; a rank
   cannot make the parent run code), and counts a rank as finished only when its report is complete and the
   kernel then shows the process ended with exit code 0. Exiting without a report, sys.exit, a signal, a hang, a
   stop, a destroyed default group: all are failures (RankFailure), named by rank.
   What decides a pass is the test's own check, in the parent, of what the ranks sent: values against its own
   single-process computation on inputs the test chose, and evidence of sharding that single-process code does
   not produce (each rank's shard sizes and contents against the parent's model, counted collectives). A
   submission that fakes its results must fake all of that consistently; one that computes single-process
   values and claims success is caught by the evidence.
5. A rank that raises sends its traceback instead. The parent gives the other ranks a moment to report their
   own errors, then kills them all (they would otherwise wait out their collective timeout), and raises
   RankFailure with the first traceback, a line for each other rank, and the tail of the failing rank's output.
   The rank named first is the cause, not an echo: a stopped rank (SIGSTOP; its stacks are taken after a
   SIGCONT), one that destroyed the default group or reached into the harness, before one that raised on its
   own, before peers whose collectives failed because of it.
6. At `timeout`, the parent sends SIGUSR1 to every live rank, waits for their stack dumps, kills them, and
   raises RankFailure with every hung rank's stacks.

7. Memory and communication, where a test bounds them (``witness=Witness(peak_bytes=..., sent_bytes=...)``),
   are read from the kernel by the parent while the ranks run: each rank's VmHWM/VmRSS (/proc/<pid>/status)
   and the bytes it wrote (``wchar`` in /proc/<pid>/io, which counts gloo's socket writes: gloo's threads are
   the rank's own). The rank says when its body starts (an empty frame on its pipe) and, after its report,
   waits for the parent's last reading before it exits. Whatever the rank's own counters say, these decide.
   A witnessed run that fails in any other way is read to its end too (a rank that reported an error waits for
   the reading; a live rank is read before the kill), and its bounds are checked: evidence fails closed.

Compare results in the test (the pytest process), not inside the body, when the comparison is what is graded:
a rank runs student code, which could patch torch's comparison functions in its own process.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.rank_cgroup import ProcShmem, RankCgroup
from tests.rank_isolation import (apply_limits, close_inherited_fds, create_private, drop_privileges,
                                   grader_settings, kill_everything_of, redirect_output, trace_task_calls,
                                   watch_lifeline)

__all__ = ["run_ranks", "RankFailure", "require_backend", "Witness"]

OUTPUT_TAIL_CHARS = 2000  # how much of a failing rank's stdout/stderr goes into the failure message
GRACE_AFTER_FAILURE_S = 0.5  # after a first failure, how long other ranks get to report theirs before the kill
STACK_DUMP_WAIT_S = 0.5  # after SIGUSR1, how long to wait for the stack dumps
STACK_TAIL_CHARS = 20_000  # how much of a hung rank's stack dump goes into the message
STOPPED_POLL_S = 1.0  # how often the parent looks for stopped ranks while it waits
STOPPED_GRACE_S = 2.0  # a rank stopped this long is a failure (a stop the body resumes itself is fine)
MAX_MESSAGE_BYTES = 64 << 20  # the largest report a rank may send (the biggest a test returns is under 1 MiB);
# the parent reads it without blocking, in pieces, and refuses a longer one as soon as its length arrives
_LENGTH_BYTES = 8  # each report: its length (8 bytes, big-endian), then a torch.save payload


# One forkserver per pytest process, started on first use. Preloading this module (by the name pytest gave it)
# also preloads torch, torch.distributed and pytest, which test modules import again in every rank.
# torch.distributed.fsdp (FSDP2, MixedPrecisionPolicy) costs ~0.6 s to import: once here, not once per rank.
_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp"] + ([__name__] if __name__ != "__main__" else [])
_CTX.set_forkserver_preload(_PRELOAD)
_forkserver_lock = threading.Lock()


def _ensure_forkserver() -> None:
    """Start the forkserver (once) so that it can import this module. Python 3.11's forkserver ignores the
    parent's sys.path when it preloads, and runs in the parent's working directory: without help it cannot
    find `tests.harness`, and every rank would import it and pytest again (+150 ms a rank)."""
    from multiprocessing import forkserver
    with _forkserver_lock:
        root = os.path.dirname(os.path.abspath(__file__))
        for _ in range(__name__.count(".")):  # tests/harness.py as tests.harness -> the repo root
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


class RankFailure(AssertionError):
    """A run failed. The message says which rank did what; ``kind`` and ``rank`` say it to code.

    kind: "raised" (the body raised; includes sys.exit), "bad-result" (the result cannot be sent back),
    "peer-lost" (the body returned but a peer failed before the end), "exited" (the process ended without
    reporting), "signal" (a signal ended it), "bad-message" (the rank sent something that is not a valid
    result message for this run), "timeout" (the run outlived `timeout`), "stopped" (SIGSTOP and never
    resumed), "group-destroyed" (the body returned after destroying the default process group). The rank that
    caused the failure sets the kind.
    """

    def __init__(self, message: str, *, kind: str, rank: int | None):
        super().__init__(message)
        self.kind = kind
        self.rank = rank


# ---- Kernel witnesses: memory and bytes as the kernel counts them, not as the rank reports them ------------------
WITNESS_SAMPLE_S = 0.005  # how often the parent reads each witnessed rank's /proc files while it runs
# Writes a rank makes that are not sends to its peers, allowed on top of the test's bound: joining the process
# group (FileStore writes, gloo's handshakes and barriers; measured 1-8 KiB) and its output (warnings).
WITNESS_SETUP_SENT_BYTES = 64 << 10
# The kernel's RSS counters are approximate (per-CPU batches), so VmHWM can read a little lower than a reading
# before; a reset (clear_refs) drops it to the current RSS, far more than this when it hides a unit's memory.
WITNESS_HWM_NOISE_BYTES = 4 << 20
WITNESS_OUTPUT_BYTES = 1 << 20  # at most this much of the output file is subtracted (ftruncate would fake more)
# What a rank may add between the parent's first reading (soon after the fork) and the start of its body
# (importing the test module, joining the process group: 5-15 MiB quiet, 35 MiB seen in CI's graded bundle under
# load). A backstop only: the rank waits before its body until the parent has read its baseline, so no body can
# make that baseline later or higher; this bounds what setting up, which runs no student code, may add.
WITNESS_START_ALLOWANCE_BYTES = 128 << 20


class Witness:
    """A test's bounds on what each rank does, checked in the parent against the kernel's own counts.

        w = Witness(peak_bytes=..., sent_bytes=...)
        results = run_ranks(body, 2, witness=w)       # raises RankFailure (kind "witness") when a bound is broken
        w.measured[rank]["peak_bytes"], w.measured[rank]["sent_bytes"]

    peak_bytes: how far each rank's resident memory may rise above its level when the body starts. The parent
    reads VmHWM and VmRSS in /proc/<pid>/status every WITNESS_SAMPLE_S while the rank runs, and once more after
    its report. A peak that falls between two readings (``echo 5 > /proc/self/clear_refs`` resets it) fails the
    run; so does a peak above the rank's first reading + WITNESS_START_ALLOWANCE_BYTES + peak_bytes (a
    backstop: the rank waits before its body until the parent has read its level). Witnessed ranks have glibc unmap every freed block of
    1 MiB or more (_malloc_returns_big_blocks), so resident memory follows the tensors alive; an idle rank's
    resident memory moves by about 1-2 MiB, so a bound should be tens of MiB to mean anything.
    sent_bytes: how many bytes each rank may write in all (``wchar`` in /proc/<pid>/io counts every write,
    gloo's socket writes from its own threads included), less its report to the parent and its output file,
    with WITNESS_SETUP_SENT_BYTES for joining the process group.
    deferred: check only when the test calls ``check()``, after its own asserts on what the ranks reported, and
    whether they passed or not (``check(reported=...)`` then adds their failure to the message): the kernel is
    asked in every run, and a failure it finds is a "witness" failure, which the grader carries to every test that
    decides the same property from the ranks' reports (staff/autograder/grading_plugin.py, refute).
    """

    def __init__(self, *, peak_bytes: int | None = None, sent_bytes: int | None = None, deferred: bool = False):
        self.peak_bytes, self.sent_bytes, self.deferred = peak_bytes, sent_bytes, deferred
        self.measured: list[dict] = []

    def check(self, reported: str = "", run_failure: str = "") -> None:
        """Raise RankFailure (kind "witness") when a rank broke a bound; ``reported``: how the test's own checks
        of the ranks' reports failed, if they did; ``run_failure``: how the run itself failed (run_ranks passes
        it): each is added to the message."""
        __tracebackhide__ = True
        problems = []
        for m in self.measured:
            where = f"rank {m['rank']}"
            if m["error"]:
                problems.append(f"{where}: {m['error']}")
                continue
            if self.peak_bytes is not None:
                if m["peak_bytes"] > self.peak_bytes:
                    problems.append(
                        f"{where}: the kernel saw its resident memory rise {_mib(m['peak_bytes'])} above its level "
                        f"when the body started (VmHWM in /proc/<pid>/status"
                        f"{_CGROUP_WORDS if m.get('beyond_page_tables') else ''}"
                        f"), more than this test's bound of "
                        f"{_mib(self.peak_bytes)}: full parameters or gradients that should have been freed were "
                        f"still alive")
                elif m["peak_abs_bytes"] > m["first_bytes"] + WITNESS_START_ALLOWANCE_BYTES + self.peak_bytes:
                    problems.append(
                        f"{where}: the kernel saw its resident memory peak at {_mib(m['peak_abs_bytes'])}, more "
                        f"than the rank held just after it started ({_mib(m['first_bytes'])}) + what setting up may take "
                        f"({_mib(WITNESS_START_ALLOWANCE_BYTES)}) + this test's bound ({_mib(self.peak_bytes)})")
            if self.sent_bytes is not None and m["sent_bytes"] > self.sent_bytes + WITNESS_SETUP_SENT_BYTES:
                problems.append(
                    f"{where}: the kernel counted {m['sent_bytes']} bytes written by the rank ('wchar' in "
                    f"/proc/<pid>/io: its sockets to the other ranks, less its report and output), more than this "
                    f"test's bound of {self.sent_bytes} (+{WITNESS_SETUP_SENT_BYTES} for joining the group): it "
                    f"communicated more than the collectives FSDP needs (an all-reduce where a reduce-scatter "
                    f"does, or a unit gathered twice?)")
        if problems:
            raise RankFailure(
                "the kernel's witness disagrees with this run: " + "; ".join(problems) + ". The kernel's counts "
                "decide: whatever the rank's own counters, monitor or memory tracker reported, they cannot overrule "
                "them." + (f"\n\nWhat the ranks reported failed the test's checks too:\n{reported}" if reported else "")
                + (f"\n\nThe run failed as well:\n{run_failure}" if run_failure else ""),
                kind="witness", rank=int(problems[0].split(":")[0].split()[1]))


_CGROUP_WORDS = (", with what it holds beyond its page tables: shared and tmpfs pages it does not map, and socket "
                 "buffers where it has a memory cgroup")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _forkserver_rss() -> int:
    """The forkserver's resident memory: what every rank holds when it is forked (torch imported)."""
    from multiprocessing import forkserver
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return _read_status(pid).get("VmRSS", 0) if pid else 0


def _read_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS and RssShmem of a process in bytes (empty when it is gone or a zombie)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith((b"VmHWM:", b"VmRSS:", b"RssShmem:")):
                    key, value = line.split(b":", 1)
                    out[key.decode()] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _read_wchar(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class _KernelSamples:
    """What the parent read about one rank from /proc while it ran (see Witness)."""

    def __init__(self, pid: int, cgroup: "RankCgroup | ProcShmem | None" = None):
        self.pid = pid
        self.cgroup = cgroup  # its own memory cgroup where one could be made, else /proc (tests/rank_cgroup.py)
        self.held_peak = 0  # the most it held at one reading beyond what VmHWM counts (its cgroup's hidden())
        self.idle = _forkserver_rss()  # an upper bound of what it holds when it is forked
        self.first_rss = None  # what it held at the parent's first reading, soon after the fork
        self.started = False
        self.start_rss = 0
        self.peak_hwm = 0  # highest VmHWM (or VmRSS) read
        self.last_hwm = 0
        self.hwm_fell = ""  # a reading where the peak fell: a reset
        self.wchar = None  # the last reading
        self.final = False  # read after the complete report, before the rank was let go
        self.received = 0  # bytes the parent read from the rank's report pipe (they count in wchar)
        self.samples = 0
        self.unreadable = ""

    def sample(self, final: bool = False) -> None:
        st = _read_status(self.pid)
        wchar = _read_wchar(self.pid)
        if "VmHWM" not in st or wchar is None:
            if "VmHWM" in st and not self.unreadable:  # alive, but its counters hidden (PR_SET_DUMPABLE 0?)
                self.unreadable = "its kernel counters (/proc/<pid>/io) could not be read while it ran"
            return  # gone already (or not readable): `final` stays False and the check fails
        self.samples += 1
        if self.first_rss is None:
            self.first_rss = st["VmRSS"]
        hwm = max(st["VmHWM"], st["VmRSS"])
        if st["VmHWM"] < self.last_hwm - WITNESS_HWM_NOISE_BYTES and not self.hwm_fell:
            self.hwm_fell = (f"its peak resident memory (VmHWM) fell from {_mib(self.last_hwm)} to "
                             f"{_mib(st['VmHWM'])} between two readings: the peak was reset (/proc/self/clear_refs), "
                             f"which hides memory from the parent")
        self.last_hwm = max(self.last_hwm, hwm)
        self.peak_hwm = max(self.peak_hwm, hwm)
        hidden = self.cgroup.hidden(st.get("RssShmem", 0)) if self.cgroup is not None and self.started else None
        if hidden:  # on top of what it holds in its page tables now
            self.held_peak = max(self.held_peak, st["VmRSS"] - self.start_rss + hidden)
        self.wchar = wchar
        self.final = self.final or final

    def body_started(self) -> None:
        self.sample()
        if self.cgroup is not None:
            self.cgroup.start()
        self.started = True
        self.start_rss = _read_status(self.pid).get("VmRSS", 0)

    def figures(self, r: "_Rank", run_failed: bool = False) -> dict:
        error = ""
        if not self.started and run_failed:
            pass  # the run failed before this rank's body began: no student code ran in it, nothing to witness
        elif not self.started:
            error = "the parent never saw its body start (the harness's 'body starts' frame did not arrive)"
        elif self.unreadable and not self.final:
            error = self.unreadable
        elif not self.final:
            error = ("it exited before the parent could read its kernel counters after its report (a rank waits "
                     "for the parent's go before it exits)")
        elif self.hwm_fell:
            error = self.hwm_fell
        out_size = min(_regular_file_size(r.out_path) or 0, WITNESS_OUTPUT_BYTES)
        sent = (self.wchar or 0) - self.received - out_size
        # Resident memory's rise, or its rise with what the rank's cgroup shows it holds beyond its page tables
        # (tmpfs pages it does not map, socket buffers: tests/rank_cgroup.py) at one reading, whichever is more.
        peak = max(self.peak_hwm - self.start_rss, self.held_peak)
        return {"rank": r.rank, "error": error, "peak_bytes": peak, "held_bytes": self.held_peak,
                "beyond_page_tables": self.cgroup is not None and self.cgroup.started,
                "peak_abs_bytes": self.peak_hwm, "start_bytes": self.start_rss, "idle_bytes": self.idle,
                "first_bytes": self.first_rss or self.idle,
                "sent_bytes": sent, "samples": self.samples}


def require_backend(backend: str, world_size: int) -> None:
    """Skip the calling test unless ``backend`` can run ``world_size`` ranks here (gloo always can)."""
    if backend == "gloo":
        return
    if backend != "nccl":
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' or 'nccl'")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world_size or not dist.is_nccl_available():
        pytest.skip(f"needs {world_size} CUDA GPUs for NCCL, found {found}")


# ==========================================================================================================
# The parent side: start the ranks, collect their messages, kill them, explain what went wrong
# ==========================================================================================================
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


def run_ranks(body, world_size: int, *args, backend: str = "gloo", timeout: float = 60.0,
              collective_timeout: float = 10.0, memory_limit_bytes: int | None = None,
              witness: "Witness | None" = None) -> list:
    """Run body(rank, world_size, *args) on `world_size` fresh rank processes with the default process group
    initialized; return the per-rank return values ordered by rank.

    body: a module-level function (a rank imports it by module and qualified name). args: picklable.
    Results may be tensors (sent back detached, on CPU), bool, int, float, str, None, torch.dtype,
    torch.Size, and lists, tuples and dicts of these.
    timeout: seconds for the whole run, counted once every rank has started; then stacks are dumped and
    every rank is killed. collective_timeout: the process group's timeout, so a mismatched collective
    raises in its rank (with a traceback) well before `timeout`.
    memory_limit_bytes: how many bytes each rank may allocate on top of what it holds when the body starts
    (RLIMIT_DATA, and RLIMIT_AS for shared mappings: see apply_limits in tests/rank_isolation.py); beyond that
    an allocation fails (MemoryError or torch's "can't allocate memory").
    witness: a Witness with the test's bounds on each rank's peak resident memory and bytes sent to its peers,
    as the kernel counts them (see Witness); the parent samples /proc for every rank while it runs, fills
    ``witness.measured`` and checks the bounds (at once, or when the test calls ``witness.check()``).
    Raises RankFailure on any failure; skips the test when the backend lacks devices (require_backend).

    The autograder sets environment variables (see `grader_settings` in tests/rank_isolation.py):
    FSDP_RANK_MEMORY_LIMIT_BYTES (the default for memory_limit_bytes), FSDP_RANK_TIMEOUT_CAP (seconds: caps timeout and collective_timeout),
    FSDP_RANK_DEADLINE, FSDP_RANK_FILE_LIMIT_BYTES, FSDP_RANK_MAX_PROCESSES and FSDP_RANK_USER (when the harness
    runs as root: run each body as this unprivileged user).
    """
    __tracebackhide__ = True  # pytest: show the test, not the harness
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    require_backend(backend, world_size)
    timeout, collective_timeout, memory_limit_bytes, limits, run_as = grader_settings(
        timeout, collective_timeout, memory_limit_bytes)
    body_ref = _body_reference(body)
    args_blob = pickle.dumps(args)
    _ensure_forkserver()
    # The environment now, not the forkserver's (a snapshot taken when it started): tests may set FSDP_IMPL.
    env = dict(os.environ)
    # Two places per run. run_dir is ours: each rank's output and stack files, which we read back, live here,
    # where the body can neither replace them (with a link to a hidden test, or a FIFO) nor add files.
    # rank_dir, inside it, is the body's: the FileStore and the body's TMPDIR and HOME; we never read from it.
    run_dir = tempfile.mkdtemp(prefix="fsdp-ranks-")
    rank_dir = os.path.join(run_dir, "rank")
    os.mkdir(rank_dir, 0o700)
    os.mkdir(os.path.join(rank_dir, "tmp"), 0o700)
    open(os.path.join(rank_dir, "store"), "w").close()
    if run_as is not None:
        os.chmod(run_dir, 0o711)  # the rank user may pass through to rank_dir, and list nothing of ours
        for path in (rank_dir, os.path.join(rank_dir, "tmp"), os.path.join(rank_dir, "store")):
            os.chown(path, run_as[0], run_as[1])
    lifeline_r, lifeline_w = _CTX.Pipe(duplex=False)  # the parent keeps the only write end
    if witness is not None:
        witness.measured = []
    ranks: list[_Rank] = []
    failure = None
    try:
        for rank in range(world_size):
            conn_r, conn_w = _CTX.Pipe(duplex=False)
            ack_r, ack_w = _CTX.Pipe(duplex=False) if witness is not None else (None, None)
            out_path = os.path.join(run_dir, f"rank{rank}.out")
            stack_path = os.path.join(run_dir, f"rank{rank}.stacks")
            config = dict(rank=rank, world_size=world_size, backend=backend, body_ref=body_ref,
                          args_blob=args_blob, env=env, rank_dir=rank_dir,
                          out_path=out_path, stack_path=stack_path, collective_timeout=collective_timeout,
                          memory_limit_bytes=memory_limit_bytes, limits=limits, run_as=run_as,
                          witnessed=witness is not None)
            proc = _CTX.Process(target=_rank_main, args=(config, conn_w, lifeline_r, ack_r), name=f"rank{rank}")
            ranks.append(_Rank(rank, proc, conn_r, out_path, stack_path))
            proc.start()
            conn_w.close()  # the rank holds the only write end now, so its death reads as EOF
            if witness is not None:
                ack_r.close()
                ranks[-1].ack = ack_w
                # Its own memory cgroup, joined before its body runs (it waits for our reading first), where this
                # machine lets us make one; /proc alone otherwise.
                cgroup = RankCgroup.create(f"fsdp-{os.path.basename(run_dir)}-rank{rank}")
                if cgroup is not None and not cgroup.add(proc.pid):
                    cgroup.remove()
                    cgroup = None
                ranks[-1].kernel = _KernelSamples(proc.pid, cgroup or ProcShmem(proc.pid))
            os.set_blocking(conn_r.fileno(), False)  # read in pieces, never waiting on a rank (_read_report)
        failure = _collect(ranks, deadline=time.monotonic() + timeout, timeout=timeout,
                           memory_limit_bytes=memory_limit_bytes)
        if witness is not None:
            for r in ranks:  # a failed run is read to its end too: every rank still alive, once more, before the kill
                if not r.kernel.final:
                    r.kernel.sample(final=True)
            witness.measured = [r.kernel.figures(r, run_failed=failure is not None) for r in ranks]
    finally:
        # Whatever happened (a failure, a KeyboardInterrupt, pytest-timeout), nothing outlives the run.
        _kill_all(ranks)
        if run_as is not None:  # and nothing the body started outside its session (a detached daemon)
            kill_everything_of(run_as[0])
        for r in ranks:
            if r.kernel is not None and r.kernel.cgroup is not None:
                r.kernel.cgroup.remove()
        lifeline_w.close()
        lifeline_r.close()
        for r in ranks:
            r.conn.close()
            if r.ack is not None:
                r.ack.close()
        _remove_tree(run_dir)
    if failure is not None:
        if witness is not None:
            # Evidence fails closed: a witnessed run that fails any other way (a rank raised, exited, hung) is still
            # judged by what the kernel saw of it, and a broken bound, or counters that could not be read, is a
            # "witness" failure (the grader then refutes the ranks' reports of that property) carrying this one.
            witness.check(run_failure=str(failure))
        raise failure
    if witness is not None and not witness.deferred:
        witness.check()
    return [r.result for r in ranks]


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


def _remove_tree(path: str) -> None:
    """Remove a run's folder, however deep the body made it, never raising: ``rm -rf`` walks it without recursion
    and never follows a link. (shutil.rmtree recurses in Python: a 1,500-deep tree in a rank's TMPDIR raised
    RecursionError, which ignore_errors does not catch, out of run_ranks, and the folder stayed; issue 32.)"""
    try:
        subprocess.run(["rm", "-rf", "--", path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError):  # no rm (or it hung): what Python can remove
        try:
            shutil.rmtree(path, ignore_errors=True)
        except RecursionError:
            pass


def _collect(ranks: list[_Rank], *, deadline: float, timeout: float,
             memory_limit_bytes: int | None) -> RankFailure | None:
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


def _read_report(r: _Rank) -> None:
    """Read what the rank's pipe holds now, without blocking (the descriptor is non-blocking), never more than
    MAX_MESSAGE_BYTES in all. A complete report is kept until the rank's exit is seen (_ended)."""
    fd = r.conn.fileno()
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # EOF: the rank closed its end (it exited, or closed it itself)
            _ended(r)
            return
        r.buffer += chunk
        if r.kernel is not None:
            r.kernel.received += len(chunk)
            if not r.kernel.started and r.buffer[:_LENGTH_BYTES] == bytes(_LENGTH_BYTES):
                r.kernel.body_started()  # the empty frame the rank sends just before the body (one, at most)
                try:  # the rank waits for this byte before its body runs (see _run_body)
                    os.write(r.ack.fileno(), b"\0")
                except OSError:
                    pass
                del r.buffer[:_LENGTH_BYTES]
                if not r.buffer:
                    continue
        if r.report is not None or len(r.buffer) > _LENGTH_BYTES + MAX_MESSAGE_BYTES:
            r.status, r.bad = "bad-message", "sent more than one report, or a report over the size limit"
            return
        if len(r.buffer) >= _LENGTH_BYTES:
            length = int.from_bytes(r.buffer[:_LENGTH_BYTES], "big")
            if length > MAX_MESSAGE_BYTES:
                r.status, r.bad = "bad-message", (f"announced a report of {length} bytes (the limit is "
                                                  f"{MAX_MESSAGE_BYTES}): results must be small")
                return
            if len(r.buffer) == _LENGTH_BYTES + length:
                r.report = _decode_message(bytes(r.buffer[_LENGTH_BYTES:]))
                r.buffer = bytearray()
                if r.report is None:
                    r.status, r.bad = "bad-message", "sent a report the parent cannot read"
                    return
                if r.kernel is not None:  # a result or an error: the rank waits for this before it exits
                    r.kernel.sample(final=True)
                    try:
                        os.write(r.ack.fileno(), b"\0")
                    except OSError:
                        pass
                if r.report.get("kind") != "result":  # an error report fails the rank at once
                    status = r.report.get("status")
                    r.status = status if status in ("bad-result", "peer-lost", "group-destroyed") else "raised"
                    r.error = {k: str(r.report.get(k, "")) for k in ("type", "message", "traceback")}
                    return


def _ended(r: _Rank) -> None:
    """The rank's pipe is closed: it finished only with a complete result report and exit code 0 (from the
    kernel, through waitpid: not something the rank says)."""
    r.proc.join(1.0)
    r.exitcode = r.proc.exitcode
    if r.report is not None and r.report.get("kind") == "result" and r.exitcode == 0 and not r.buffer:
        r.status, r.result = "ok", r.report.get("result")
    elif r.report is not None and r.report.get("kind") == "result" and r.exitcode is not None:
        r.status, r.bad = "bad-message", (f"reported a result, then exited with code {r.exitcode}: a rank counts "
                                          f"only if it ends with code 0 after its report")
    elif r.report is not None and r.report.get("kind") == "result":
        r.status, r.bad = "bad-message", "closed its result pipe after reporting but did not exit"
    elif r.buffer:
        r.status, r.bad = "bad-message", "ended in the middle of its report"
    else:
        r.status = "signal" if r.exitcode is not None and r.exitcode < 0 else "exited"


def _decode_message(data: bytes) -> dict | None:
    """A rank's message, or None when it is not one. weights_only=True: tensors and plain containers only,
    so a hostile pickle cannot run code here."""
    try:
        message = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception:
        return None
    return message if isinstance(message, dict) else None


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.pid is None:
            continue  # never started
        for kill, target in ((os.killpg, r.proc.pid), (os.kill, r.proc.pid)):
            # killpg: the rank's session and everything it spawned. kill: in case it died before os.setsid.
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for r in ranks:
        if r.proc.pid is not None:
            r.proc.join(5.0)  # the forkserver reaps it; this reads its exit status
            if r.exitcode is None:
                r.exitcode = r.proc.exitcode
            if r.proc.exitcode is not None:
                r.proc.close()  # its sentinel's file descriptor, now rather than at garbage collection


# ---- Failure messages -------------------------------------------------------------------------------------
def _explain_failures(failures: list[_Rank], ranks: list[_Rank], memory_limit_bytes: int | None) -> RankFailure:
    # The story is the first failure that is a cause rather than an echo: a rank that was stopped or destroyed
    # the process group comes first; then one that failed on its own; last the
    # peers whose collectives failed because of another rank ("Connection closed by peer").
    def rank_of_cause(r: _Rank) -> tuple:
        cause = r.status in ("stopped", "group-destroyed")
        return (0 if cause else 2 if _is_echo(r) else 1, failures.index(r))
    first, world_size = min(failures, key=rank_of_cause), len(ranks)
    lines = [f"rank {first.rank} of {world_size} {_what_happened(first, memory_limit_bytes)}"]
    if first.status in ("raised", "bad-result") and first.error.get("traceback"):
        lines += ["", f"---- rank {first.rank} traceback ----", first.error["traceback"].rstrip()]
    if first.status == "stopped":
        stacks = _dump_stacks([first]).get(first.rank)
        lines += ["", f"---- rank {first.rank} stacks (most recent call first; resumed with SIGCONT to get them) "
                      f"----", stacks or "(no stack dump)"]
    lines += _output_section(first)
    others = [r for r in ranks if r is not first]
    if others:
        lines += ["", "---- other ranks ----"]
        for r in others:
            if r.status == "ok":
                lines.append(f"rank {r.rank}: finished")
            elif r.status == "running":
                lines.append(f"rank {r.rank}: still running, killed after rank {first.rank} failed")
            else:
                lines.append(f"rank {r.rank}: {_what_happened(r, memory_limit_bytes)}")
    return RankFailure("\n".join(lines), kind=first.status, rank=first.rank)


def _is_echo(r: _Rank) -> bool:
    message = r.error.get("message", "")
    return r.status == "peer-lost" or (r.status == "raised" and any(
        words in message for words in ("closed by peer", "reset by peer", "Timed out waiting", "timed out",
                                       "Timeout waiting", "Connection refused")))


def _what_happened(r: _Rank, memory_limit_bytes: int | None) -> str:
    memory_note = ""
    if memory_limit_bytes is not None:
        memory_note = f" (its memory limit: {memory_limit_bytes} bytes above its usage at start)"
    if r.status == "raised":
        if r.error["type"] == "SystemExit":
            return f"called sys.exit({r.error['message']}) instead of returning (SystemExit)"
        first_line = _first_line(r.error["message"])
        text = f"raised {r.error['type']}" + (f": {first_line}" if first_line else "")
        if r.error["type"] == "MemoryError" or "can't allocate memory" in r.error["message"]:
            text += " -- out of memory" + memory_note
        elif r.error["type"] == "OSError" and "File too large" in r.error["message"]:
            text += " -- a file (or its output) grew past the rank's file size limit"
        return text
    if r.status in ("bad-result", "peer-lost", "group-destroyed"):
        return r.error["message"]
    if r.status == "stopped":
        return ("was stopped (SIGSTOP or SIGTSTP: os.kill(os.getpid(), signal.SIGSTOP)?) and never resumed; a "
                "stopped rank cannot run or report, and its peers wait for it in their collectives")
    if r.status == "bad-message":
        return f"{r.bad or 'sent a message that is not a valid result report'} (no result from this rank)"
    if r.status == "signal":
        name = _signal_name(-r.exitcode)
        text = f"was killed by signal {name} before reporting a result"
        if name == "SIGKILL":
            text += " (not by the harness: out of memory?)" + memory_note
        elif name == "SIGABRT":
            text += " (os.abort(), or a C++ exception / failed check in native code)" + memory_note
        elif name == "SIGSEGV":
            text += " (a segmentation fault in native code)"
        elif name == "SIGXFSZ":
            text += " (a file grew past the rank's file size limit)"
        return text
    if r.status == "exited" and not os.path.lexists(r.out_path):
        # It died in multiprocessing's start-up, before _rank_main: most likely re-importing __main__.
        main = sys.modules["__main__"]
        main_name = main.__spec__.name if getattr(main, "__spec__", None) else getattr(main, "__file__", "?")
        return (f"exited with code {r.exitcode} before the harness could set it up: multiprocessing re-imports "
                f"the main module ({main_name}) in every rank; is its work guarded by "
                f"`if __name__ == '__main__':`? The error went to this process's stderr")
    if r.status == "exited":
        return (f"exited with code {r.exitcode} without reporting a result (os._exit, or the process ended "
                f"outside Python): only a body that returns counts as passing")
    return r.status


def _dump_stacks(ranks: list[_Rank]) -> dict[int, str]:
    """Ask each rank for its stacks (faulthandler on SIGUSR1), a stopped one too (SIGCONT lets it answer)."""
    for r in ranks:
        for sig in (signal.SIGUSR1, signal.SIGCONT):  # SIGUSR1 stays pending until SIGCONT resumes it
            try:
                os.kill(r.proc.pid, sig)
            except (ProcessLookupError, PermissionError, TypeError):
                pass
    wait_until = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < wait_until and not all(_regular_file_size(r.stack_path) for r in ranks):
        time.sleep(0.02)
    time.sleep(0.05)  # let the last dump finish writing
    return {r.rank: _tidy_stacks(_read_tail(r.stack_path, STACK_TAIL_CHARS)) for r in ranks}


def _explain_timeout(hung: list[_Rank], ranks: list[_Rank], timeout: float) -> RankFailure:
    stacks = _dump_stacks(hung)  # faulthandler in each rank dumps every thread's stack to its stack file
    finished = [str(r.rank) for r in ranks if r not in hung]
    headline = (f"timed out after {timeout:g} s: rank{'s' if len(hung) > 1 else ''} "
                f"{', '.join(str(r.rank) for r in hung)} of {len(ranks)} did not finish"
                + (f" (finished: {', '.join(finished)})" if finished else "")
                + "; a collective that not every rank calls, or an endless loop? Stacks below; all ranks killed.")
    lines = [headline]
    for r in hung:
        dump = stacks.get(r.rank) or "(no stack dump: it did not answer SIGUSR1)"
        lines += ["", f"---- rank {r.rank} stacks (most recent call first) ----", dump]
        lines += _output_section(r)
    return RankFailure("\n".join(lines), kind="timeout", rank=hung[0].rank)


def _open_regular(path: str) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file, else None. Never follows a link (O_NOFOLLOW)
    and never blocks on a FIFO or a device (O_NONBLOCK): a rank's files are read back by the grading process,
    which must neither quote a file the rank pointed it to nor wait on one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _regular_file_size(path: str) -> int | None:
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _tidy_stacks(dump: str) -> str:
    """A faulthandler dump without the harness: drop the lifeline thread, and cut each stack below the body
    (the harness and multiprocessing frames that called it)."""
    blocks = []
    for block in dump.strip().split("\n\n"):
        if "in watch_lifeline" in block:
            continue
        kept = []
        for line in block.splitlines():
            if f'{os.path.basename(__file__)}", line' in line and line.rstrip().endswith("in _run_body"):
                break
            kept.append(line)
        blocks.append("\n".join(kept))
    return "\n\n".join(blocks)


def _output_section(r: _Rank) -> list[str]:
    if _regular_file_size(r.out_path) is None and os.path.lexists(r.out_path):
        return ["", f"---- rank {r.rank} stdout/stderr: not shown, its output file is no longer a regular file "
                    f"(replaced by a link, a FIFO or a device) ----"]
    tail = _tidy_stacks(_read_tail(r.out_path, OUTPUT_TAIL_CHARS)).rstrip()  # may hold a fatal-error dump
    if not tail:
        return []
    return ["", f"---- rank {r.rank} stdout/stderr (last {OUTPUT_TAIL_CHARS} characters) ----", tail]


def _read_tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of a regular file, reading at most 4 bytes a character."""
    fd = _open_regular(path)
    if fd is None:
        return ""
    try:
        size = os.fstat(fd).st_size
        want = min(size, 4 * chars)
        data = os.pread(fd, want, size - want) if want else b""
        return data.decode("utf-8", errors="replace")[-chars:]
    except OSError:
        return ""
    finally:
        os.close(fd)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ==========================================================================================================
# The rank side: everything below runs in a rank process, forked from the forkserver
# ==========================================================================================================
_body_code = None  # the body's code object, once found: where a rank's traceback starts


def _rank_main(config: dict, conn, lifeline, ack=None) -> None:
    """A rank's whole life. It never returns: it ends with os._exit, so no atexit handler or leftover thread
    of the body can keep it alive or change its exit code."""
    close_inherited_fds(keep={conn.fileno(), lifeline.fileno()} | ({ack.fileno()} if ack is not None else set()))
    os.setsid()  # own process group: the parent kills it, and everything it spawns, with one killpg
    threading.Thread(target=watch_lifeline, args=(lifeline,), name="harness-lifeline", daemon=True).start()
    # Both files are created here, in the parent's directory (the rank user cannot write there), before the
    # rank drops privileges: the body writes through the descriptors and cannot replace the files.
    redirect_output(config["out_path"])
    stack_file = os.fdopen(create_private(config["stack_path"]), "w")
    import faulthandler
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults, aborts: stacks into the output file
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    # The report is data for the parent to check, not a verdict: nothing here needs protecting from the body
    # (see the module docstring, step 4).
    fd = conn.fileno()
    try:
        message = {"kind": "result", "result": _run_body(config, _sendable, fd, ack)}
    except (_BadResult, _PeerLost, _GroupDestroyed) as e:  # the harness's own words; no traceback needed
        status = {_BadResult: "bad-result", _PeerLost: "peer-lost", _GroupDestroyed: "group-destroyed"}[type(e)]
        message = {"kind": "error", "status": status, "type": type(e).__name__, "message": str(e), "traceback": ""}
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: only a return counts
        message = {"kind": "error", "status": "raised", "type": type(e).__name__, "message": str(e),
                   "traceback": _format_traceback(e)}
    try:
        buf = io.BytesIO()
        torch.save(message, buf)
        data = memoryview(len(buf.getvalue()).to_bytes(_LENGTH_BYTES, "big") + buf.getvalue())
        while data:
            data = data[os.write(fd, data):]
    except BaseException:
        traceback.print_exc()
        code = 3
    else:
        code = 0 if message["kind"] == "result" else 1
    sys.stdout.flush()
    sys.stderr.flush()
    if ack is not None and code in (0, 1):
        # After a result or an error report alike (a witnessed run that fails is read to its end too: evidence
        # fails closed), the parent reads our kernel counters one last time, then lets us go (a byte, or EOF).
        try:
            os.read(ack.fileno(), 1)
        except OSError:
            pass
    os._exit(code)


def _run_body(config: dict, sendable, report_fd: int | None = None, ack=None):
    rank, world_size, backend = config["rank"], config["world_size"], config["backend"]
    # The parent's environment at the time of the call, plus what a rank needs. TMPDIR and HOME: the body's own
    # directory, removed with the run (nothing the body writes there outlives the test).
    os.environ.clear()
    os.environ.update(config["env"])
    body_tmp = os.path.join(config["rank_dir"], "tmp")
    os.environ.update(FSDP_RANK_PROCESS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      TMPDIR=body_tmp, HOME=body_tmp)
    tempfile.tempdir = None  # tempfile caches the directory it found first: look again
    torch.set_num_threads(1)  # 2 cores and up to 4 ranks: more threads only fight
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    device_id = None
    if backend == "nccl":  # one GPU per rank; device_id also makes NCCL connect now, not at first use
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    store = dist.FileStore(os.path.join(config["rank_dir"], "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device_id,
                            timeout=timedelta(seconds=config["collective_timeout"]))
    # Every rank connected before any body runs: else a fast rank could finish and exit while a slow one is
    # still connecting to it, and the slow one would fail for no fault of the body.
    dist.barrier()
    body = _find_body(config["body_ref"])
    global _body_code
    _body_code = getattr(body, "__code__", None)
    args = pickle.loads(config["args_blob"])
    apply_limits(config["memory_limit_bytes"], config.get("limits") or {})
    if config.get("run_as") is not None:  # last: the harness and the test module were set up as ourselves
        drop_privileges(*config["run_as"])
    if os.environ.get("FSDP_TRACE_TASK_CALLS"):  # staff/grader_selftest/measure_times.py: which task functions run
        trace_task_calls(os.environ["FSDP_TRACE_TASK_CALLS"])
    if config.get("witnessed"):
        _malloc_returns_big_blocks()
    if config.get("witnessed") and report_fd is not None:
        os.write(report_fd, bytes(_LENGTH_BYTES))  # an empty frame: "the body starts now" (the memory baseline)
        if ack is not None:
            # Wait until the parent has read our resident memory: the baseline is then exactly the body's start,
            # however late a loaded parent gets to it (the body has not run a line yet).
            try:
                os.read(ack.fileno(), 1)
            except OSError:
                pass
    result = body(rank, world_size, *args)
    result = sendable(result, "result")
    if not dist.is_initialized():
        raise _GroupDestroyed("returned without the default process group: the body (or code it called) "
                              "destroyed it (dist.destroy_process_group()), so its peers' collectives with this "
                              "rank could not finish; leave the default group to the harness")
    try:
        dist.barrier()  # no rank tears down its connections while a peer may still be reading from them
    except Exception as e:
        raise _PeerLost(f"returned, then lost its peers at the closing barrier (another rank failed?): "
                        f"{_first_line(str(e))}") from None
    dist.destroy_process_group()
    return result


def _malloc_returns_big_blocks() -> None:
    """Make glibc give every block of 1 MiB or more its own mapping, unmapped when freed, so that the kernel's
    resident memory follows the tensors alive (the Witness's peak). By default glibc raises that threshold
    after the first large free (up to 32 MiB), and keeps later blocks of a unit's size in its heap, where a
    freed one stays resident: a correct FSDP run would then look as if it never freed anything."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: no dynamic adjustment)
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: return a freed heap top to the kernel
    except (OSError, AttributeError):
        pass


def _format_traceback(e: BaseException) -> str:
    """The traceback from the body's frame on, when the body is in it: the harness frames above say nothing
    about the test. (An error while setting up, before the body ran, keeps its whole traceback.)"""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _body_code:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb if tb is not None else e.__traceback__))


def _find_body(ref: dict):
    try:
        module = importlib.import_module(ref["module"])
    except ImportError:
        if not ref["filename"]:
            raise
        # pytest's importlib mode: the module is not importable by name, so load it from its file.
        spec = importlib.util.spec_from_file_location(ref["module"], ref["filename"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[ref["module"]] = module
        spec.loader.exec_module(module)
    found = module
    for part in ref["qualname"].split("."):
        found = getattr(found, part)
    return found


class _BadResult(TypeError):
    """The body's result cannot travel to the parent."""


class _PeerLost(RuntimeError):
    """The body returned, but a peer never reached the end: the peer's failure is the story, not this."""


class _GroupDestroyed(RuntimeError):
    """The body returned, but destroyed the default process group on the way: its peers could not finish."""


def _sendable(value, where: str):
    """The result as the parent will receive it, or _BadResult saying what is wrong and where."""
    if value is None or isinstance(value, torch.dtype):
        return value
    for plain in (bool, int, float, str):  # exactly these: a subclass (numpy.float64, an enum) would not load
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, torch.Tensor):
        # Detached, on CPU (the parent does not touch CUDA), compact (a view of a big buffer sends only
        # itself), and a plain tensor (a subclass could not be loaded safely).
        return value.detach().to("cpu").clone().as_subclass(torch.Tensor)
    if isinstance(value, torch.Size):
        return torch.Size(value)
    if isinstance(value, (list, tuple)):
        items = [_sendable(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise _BadResult(f"returned a dict with a key of type {type(k).__qualname__} at {where}: "
                                 f"keys must be str or int")
            out[k] = _sendable(v, f"{where}[{k!r}]")
        return out
    raise _BadResult(f"returned an object of type {type(value).__module__}.{type(value).__qualname__} at "
                     f"{where}: a body may return tensors, bool, int, float, str, None, torch.dtype, "
                     f"torch.Size, and lists, tuples and dicts of these")
