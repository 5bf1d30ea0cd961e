"""The distributed test harness: run a test body on W fresh rank processes, and never hang or be fooled.

    from tests.harness import run_ranks

    def _body(rank, world_size, n):              # module level, so a rank can import it by name
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)                       # the default process group is ready
        return t                                 # comes back to the test, in rank order

    def test_sum():
        results = run_ranks(_body, 4, 3)         # body(rank, 4, 3) on ranks 0..3
        assert all(torch.equal(t, torch.full((3,), 6.0)) for t in results)

The protocol, step by step. This file keeps run_ranks, which composes the steps; each step lives in a room that
can be imported and tested alone (tests/harness_*.py; the rank's limits and isolation are tests/rank_*.py):

| step | room |
| --- | --- |
| 1, the parent's wait of 4-5 (forkserver, ``_Rank``, ``_collect``) | ``harness_start.py`` |
| 2-4 in the rank (``_rank_main``, ``_run_body``, its report) | ``harness_rank.py`` |
| limits, privileges, the lifeline, the seccomp filter | ``rank_isolation.py`` |
| 4-6 in the parent: reading reports, RankFailure and its messages, stacks | ``harness_report.py`` |
| 7: the kernel's readings, ``Witness`` | ``harness_witness.py`` (memory cgroup: ``rank_cgroup.py``) |
| the end of every run: kill every rank's session, remove the run's folder | ``harness_cleanup.py`` |

1. Rank processes come from one multiprocessing "forkserver" per pytest process. The forkserver imports torch,
   torch.distributed, this module and its rooms once; each rank is a fork of it, so a rank starts in tens of
   milliseconds instead of the 1-2 s it takes to import torch. The forkserver never imports a test module or
   student code, and neither does the pytest process: student code runs only inside ranks, where the body calls
   `adapters`.
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

7. Memory and communication are read from the kernel by the parent while the ranks run, in every run alike
   (nothing a rank can read tells a run a test bounds, ``witness=Witness(peak_bytes=..., sent_bytes=...)``, from
   one it does not): each rank's VmHWM/VmRSS (/proc/<pid>/status), what it holds beyond its page tables (its
   cgroup or /proc: tmpfs, SysV, its children, its sockets' buffers), and the bytes it sent at its sockets (TCP's counters through sock_diag; ``wchar`` in /proc/<pid>/io as a
   second opinion). The rank says when its body starts and when it returned (an empty frame on its pipe each
   time, and it waits for the parent's reading: its baseline, then its sockets before the closing barrier closes
   them) and, after its report, waits for the parent's last reading before it exits. Whatever the rank's own
   counters say, these decide.
   A witnessed run that fails in any other way is read to its end too (a rank that reported an error waits for
   the reading; a live rank is read before the kill), and its bounds are checked; a run that timed out is judged
   as the timeout it is, never by its witness.

Compare results in the test (the pytest process), not inside the body, when the comparison is what is graded:
a rank runs student code, which could patch torch's comparison functions in its own process.
"""

from __future__ import annotations

import os
import pickle
import secrets
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness_cleanup import _kill_all, _remove_tree
# Some names are imported for those who use them from here: tests (_decode_message), the grader's self-test
# (_find_body), and the constants and helpers that lived in this file before its rooms.
from tests.harness_rank import _find_body, _rank_main, _run_body, _sendable  # noqa: F401
from tests.harness_report import (MAX_MESSAGE_BYTES, RankFailure, _decode_message, _read_report,  # noqa: F401
                                  show_output)
from tests.harness_sockets import SocketTable
from tests.harness_start import _CTX, StoreWatch, _body_reference, _collect, _ensure_forkserver, _Rank
from tests.harness_witness import (WITNESS_SETUP_SENT_BYTES, Witness, _KernelSamples,  # noqa: F401
                                   _read_status, _read_wchar)
from tests.rank_audit import AuditChannel, publish_run
from tests.rank_cgroup import ProcShmem, RankCgroup
from tests.rank_isolation import grader_settings, kill_everything_of

__all__ = ["run_ranks", "RankFailure", "require_backend", "Witness"]


def require_backend(backend: str, world_size: int) -> None:
    """Skip the calling test unless ``backend`` can run ``world_size`` ranks here (gloo always can)."""
    if backend == "gloo":
        return
    if backend != "nccl":
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' or 'nccl'")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world_size or not dist.is_nccl_available():
        pytest.skip(f"needs {world_size} CUDA GPUs for NCCL, found {found}")


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
    env.pop("FSDP_AUDIT_LOG", None)  # the parent writes the audit's log (tests/rank_audit.py); a rank never does
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
    # The kernel's per-socket counters (NETLINK_SOCK_DIAG), one dump per reading for the whole run; None where the
    # kernel refuses them (the witness then counts bytes with wchar, and says so).
    # Every run is watched alike, with a Witness or without: nothing a rank can read (its config, its descriptors,
    # /proc/self/cgroup, its environment) tells a run whose memory and bytes decide from one whose do not (issue 35
    # item 4). Only the bounds are the test's.
    watched = True
    sockets = SocketTable.open() if watched else None
    ranks: list[_Rank] = []
    audits: list[AuditChannel] = []  # each rank's runtime audit channel (tests/rank_audit.py)
    failure = None
    try:
        for rank in range(world_size):
            conn_r, conn_w = _CTX.Pipe(duplex=False)
            audits.append(AuditChannel(_CTX))
            ack_r, ack_w = _CTX.Pipe(duplex=False) if watched else (None, None)
            out_path = os.path.join(run_dir, f"rank{rank}.out")
            stack_path = os.path.join(run_dir, f"rank{rank}.stacks")
            config = dict(rank=rank, world_size=world_size, backend=backend, body_ref=body_ref,
                          args_blob=args_blob, env=env, rank_dir=rank_dir,
                          out_path=out_path, stack_path=stack_path, collective_timeout=collective_timeout,
                          memory_limit_bytes=memory_limit_bytes, limits=limits, run_as=run_as,
                          witnessed=watched, audit=audits[-1].writer, audit_token=audits[-1].token)
            proc = _CTX.Process(target=_rank_main, args=(config, conn_w, lifeline_r, ack_r), name=f"rank{rank}")
            ranks.append(_Rank(rank, proc, conn_r, out_path, stack_path))
            proc.start()
            conn_w.close()  # the rank holds the only write end now, so its death reads as EOF
            audits[-1].started()
            if watched:
                ack_r.close()
                ranks[-1].ack = ack_w
                # Its own memory cgroup, joined before its body runs (it waits for our reading first), where this
                # machine lets us make one; /proc alone otherwise.
                # Its name is random and says nothing (a rank reads it in /proc/self/cgroup): no run looks special.
                cgroup = RankCgroup.create(secrets.token_hex(8))
                if cgroup is not None and not cgroup.add(proc.pid):
                    cgroup.remove()
                    cgroup = None
                ranks[-1].kernel = _KernelSamples(proc.pid, cgroup or ProcShmem(proc.pid, _own_uid(run_as)),
                                                  sockets)
            os.set_blocking(conn_r.fileno(), False)  # read in pieces, never waiting on a rank (_read_report)
        store = StoreWatch(os.path.join(rank_dir, "store"))
        try:
            failure = _collect(ranks, deadline=time.monotonic() + timeout, timeout=timeout,
                               memory_limit_bytes=memory_limit_bytes, store=store)
            store.sample()
        finally:
            store.close()
        failure = failure or store.failure()
        if watched:
            for r in ranks:  # a failed run is read to its end too: every rank still alive, once more, before the kill
                if not r.kernel.final:
                    r.kernel.sample(final=True)
        if witness is not None:
            witness.measured = [r.kernel.figures(r, run_failed=failure is not None) for r in ranks]
    finally:
        # Whatever happened (a failure, a KeyboardInterrupt, pytest-timeout), nothing outlives the run.
        _kill_all(ranks)
        publish_run(audits, ranks)  # every rank has ended: its audit channel too
        if run_as is not None:  # and nothing the body started outside its session (a detached daemon)
            kill_everything_of(run_as[0])
        for r in ranks:
            if r.kernel is not None and r.kernel.cgroup is not None:
                r.kernel.cgroup.remove()
        if sockets is not None:
            sockets.close()
        lifeline_w.close()
        lifeline_r.close()
        for r in ranks:
            r.conn.close()
            if r.ack is not None:
                r.ack.close()
        try:
            show_output(ranks)  # a student's prints reach them (pytest -s), passing or failing
        finally:
            _remove_tree(run_dir)
    if failure is not None:
        if witness is not None and failure.kind != "timeout":
            # A witnessed run that fails another way (a rank raised or exited) is still judged by what the kernel saw
            # of it: a broken bound, or counters that could not be read, is a "witness" failure carrying this one.
            # A timeout is not evidence (issue 35): a run cut short on a loaded machine is judged as the timeout it
            # is (its stacks, the hang blamed on its functions), never as a lie; it fails this test either way.
            witness.check(run_failure=str(failure))
        raise failure
    if witness is not None and not witness.deferred:
        witness.check()
    return [r.result for r in ranks]



def _own_uid(run_as) -> int | None:
    """The rank's user where it is not ours (files and segments it owns are then its own), else None."""
    return run_as[0] if run_as is not None and run_as[0] != os.geteuid() else None
