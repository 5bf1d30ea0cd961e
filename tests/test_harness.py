"""Tests of the distributed test harness itself (no task marker: they grade nothing, they guard the grader).

Every failure mode of a rank that the autograder must survive is played here once, on gloo: results in rank
order; a rank that raises (fails fast, its traceback in the message); sys.exit(0), os._exit(0), os.abort()
and SIGKILL (failures, named); a hung collective and an endless loop (killed at the timeout, stacks shown);
a result that cannot travel safely; a memory bomb under a limit; no process left behind, even when the
pytest process itself is killed; and the kernel witnesses (peak memory a rank freed, a peak it reset, bytes it
sent), which decide in the parent whatever the rank reports.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, Witness, _decode_message, run_ranks

ROOT = Path(__file__).resolve().parents[1]


# ---- Helpers ------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Is `pid` a live process? A zombie is dead: it only waits for its (re)parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _assert_all_dead(pids: list[int], within: float = 60.0) -> None:
    # `within` only bounds the wait (it returns as soon as all are dead: well under a second quiet); it is generous
    # so that a loaded machine (load 10) cannot fail it.
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if _alive(p)], f"processes outlived the run: {[p for p in pids if _alive(p)]}"


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
        if ppid == pid:
            children.append(int(entry))
    return children


def _read_pids(directory: Path) -> list[int]:
    return [int(p) for f in sorted(directory.glob("*.pids")) for p in f.read_text().split()]


def _spawn_sleeper_and_record(rank: int, directory: str) -> None:
    """Record this rank's pid and that of a child it spawns (which must die with the rank)."""
    child = subprocess.Popen(["sleep", "300"])
    Path(directory, f"rank{rank}.pids").write_text(f"{os.getpid()} {child.pid}")


# ---- Bodies (module level: ranks import them by name) ---------------------------------------------------------
def _sum_of_ranks(rank, world_size, n):
    t = torch.full((n,), float(rank))
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": t, "pid": os.getpid(),
            "rank_process": os.environ.get("FSDP_RANK_PROCESS"), "impl": os.environ.get("FSDP_IMPL"),
            "threads": torch.get_num_threads(), "misc": (None, True, 1.5, "s", [torch.float32, torch.Size([2])]),
            # This module imports neither: if a rank has them, the forkserver preloaded them.
            "implementation_loaded": sorted(m for m in sys.modules if m == "adapters" or m.startswith("fsdp_"))}


def _rank1_raises(rank, world_size):
    print(f"rank {rank} about to fail")
    if rank == 1:
        assert rank == 0, "rank 1 disagrees: shard 3 differs"
    time.sleep(600)  # rank 0 is busy: the harness must kill it, not wait for it
    return rank


def _rank1_raises_rank0_returns(rank, world_size):
    if rank == 1:
        time.sleep(0.1)
        raise ValueError("rank 1 failed late")
    return rank  # rank 0 returns, then waits for rank 1 at the harness's closing barrier


def _every_rank_raises(rank, world_size):
    raise NotImplementedError("Task 3: implement unshard in fsdp_assignment/task3_forward.py")


def _sys_exit(rank, world_size):
    sys.exit(0)


def _os_exit(rank, world_size):
    os._exit(0)


def _abort(rank, world_size):
    os.abort()


def _sigkill_self(rank, world_size):
    os.kill(os.getpid(), signal.SIGKILL)


def _collective_only_on_rank0(rank, world_size, directory):
    _spawn_sleeper_and_record(rank, directory)
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 skips it ...
    else:
        dist.broadcast(torch.ones(4), src=1)  # ... and waits in another collective: a deadlock
    return rank


def _endless_loop(rank, world_size, directory):
    _spawn_sleeper_and_record(rank, directory)
    while True:
        pass


class _Custom:
    pass


def _returns_custom_object(rank, world_size):
    return {"ok": torch.ones(2), "bad": [1, _Custom()]}


def _memory_bomb(rank, world_size):
    hoard = []
    while True:
        hoard.append(torch.empty(25_000_000))  # 100 MB a step (RLIMIT_DATA counts it untouched)


def _sleep_forever(rank, world_size, directory):
    _spawn_sleeper_and_record(rank, directory)
    time.sleep(300)


# ---- Results -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size, monkeypatch):
    monkeypatch.setenv("FSDP_IMPL", "student")  # set after the forkserver started: must still reach the ranks
    results = run_ranks(_sum_of_ranks, world_size, 3)
    total = float(sum(range(world_size)))
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["world_size"] == world_size
        assert torch.equal(r["sum"], torch.full((3,), total))
        assert r["rank_process"] == "1" and r["impl"] == "student" and r["threads"] == 1
        assert r["misc"] == (None, True, 1.5, "s", [torch.float32, torch.Size([2])])
        assert r["implementation_loaded"] == []
    assert len({r["pid"] for r in results}) == world_size
    assert os.environ.get("FSDP_RANK_PROCESS") is None  # the pytest process is not a rank
    _assert_all_dead([r["pid"] for r in results])


# ---- A rank that raises --------------------------------------------------------------------------------------
def test_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_raises, 2, timeout=600, collective_timeout=600)
    # Rank 0 is killed, not left to its 600 s sleep: 0.6 s quiet; the bound holds at any sane load.
    assert time.monotonic() - start < 100
    message = str(info.value)
    assert info.value.kind == "raised" and info.value.rank == 1
    assert message.startswith("rank 1 of 2 raised AssertionError: rank 1 disagrees: shard 3 differs")
    assert "Traceback (most recent call last)" in message
    assert "in _rank1_raises" in message and 'assert rank == 0, "rank 1 disagrees' in message
    assert "rank 1 about to fail" in message  # the tail of the rank's output
    assert "rank 0: still running, killed after rank 1 failed" in message


def test_a_rank_that_returned_is_not_blamed_for_a_peer_failure(monkeypatch):
    # Rank 0 learns of rank 1's death only when rank 1's process has exited and closed its sockets; on a loaded
    # 2-core machine (CI) that can take longer than the usual half second the harness waits for other ranks'
    # reports after a first failure, and rank 0 is then killed "still running" (also true, but not this test's
    # case). The wait is lengthened here, so the test judges how a returned rank is described, not the load.
    import tests.harness_start
    monkeypatch.setattr(tests.harness_start, "GRACE_AFTER_FAILURE_S", 30.0)
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_raises_rank0_returns, 2)
    assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 2 raised ValueError: rank 1 failed late")
    assert "rank 0: returned, then lost its peers at the closing barrier" in str(info.value)


def test_every_rank_raising_shows_the_first_and_summarizes_the_rest():
    with pytest.raises(RankFailure) as info:
        run_ranks(_every_rank_raises, 3)
    message = str(info.value)
    first = info.value.rank
    assert message.startswith(f"rank {first} of 3 raised NotImplementedError: Task 3: implement unshard")
    assert message.count("Traceback (most recent call last)") == 1
    for other in {0, 1, 2} - {first}:
        assert f"rank {other}: raised NotImplementedError: Task 3" in message


# ---- Exits and signals: no positive signal, no pass --------------------------------------------------------
@pytest.mark.parametrize("body, kind, words", [
    (_sys_exit, "raised", "called sys.exit(0)"),
    (_os_exit, "exited", "exited with code 0 without reporting a result"),
    (_abort, "signal", "was killed by signal SIGABRT"),
    (_sigkill_self, "signal", "was killed by signal SIGKILL"),
])
def test_exiting_without_returning_is_a_failure(body, kind, words):
    with pytest.raises(RankFailure) as info:
        run_ranks(body, 2)
    assert info.value.kind == kind
    assert str(info.value).startswith(f"rank {info.value.rank} of 2 {words}")


# ---- Hangs: killed at the timeout, stacks shown, nothing left behind -----------------------------------------
def _hang(body, world_size: int, directory: Path) -> tuple[RankFailure, float, float]:
    """Run a body that hangs until the harness kills it; (the failure, its timeout, seconds it took). The
    timeout counts from the ranks' start, so on a loaded machine a short one can fire before every rank reached
    the body (its stacks then show set-up, not the hang): then it is tried again with a longer one. Quiet, the
    first try (3 s) does."""
    for timeout in (3, 15, 60):
        for old in directory.glob("*.pids"):
            old.unlink()
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            run_ranks(body, world_size, str(directory), timeout=timeout, collective_timeout=600)
        seconds = time.monotonic() - start
        if len(list(directory.glob("*.pids"))) == world_size:  # every rank was in the body when killed
            break
    return info.value, timeout, seconds


def test_collective_on_one_rank_is_killed_at_timeout_with_stacks(tmp_path):
    failure, timeout, seconds = _hang(_collective_only_on_rank0, 2, tmp_path)
    # Killed at the timeout, not at the collective timeout (600 s): timeout + 1 s quiet.
    assert seconds < timeout + 60
    message = str(failure)
    assert failure.kind == "timeout"
    assert message.startswith(f"timed out after {timeout} s: ranks 0, 1 of 2 did not finish")
    assert "rank 0 stacks" in message and "rank 1 stacks" in message
    assert "in all_reduce" in message and "in broadcast" in message and "in _collective_only_on_rank0" in message
    assert "watch_lifeline" not in message  # the harness's own thread is left out
    _assert_all_dead(_read_pids(tmp_path))  # ranks and the processes they spawned


def test_endless_loop_is_killed_at_timeout_with_stacks(tmp_path):
    failure, _, _ = _hang(_endless_loop, 1, tmp_path)
    assert failure.kind == "timeout"
    assert "rank 0 stacks" in str(failure) and "in _endless_loop" in str(failure)
    _assert_all_dead(_read_pids(tmp_path))


def test_ranks_die_when_the_pytest_process_dies(tmp_path):
    # A stand-in for pytest: a fresh Python that runs two ranks that sleep, then is SIGKILLed (no finally runs).
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.harness import run_ranks
        from tests.test_harness import _sleep_forever
        run_ranks(_sleep_forever, 2, {str(tmp_path)!r}, timeout=120)
    """)
    # Its temporary folders (the run's, multiprocessing's) inside tmp_path: killed, it removes none of them.
    (tmp_path / "tmp").mkdir()
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                              env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))
    try:
        deadline = time.monotonic() + 300  # ~2 s quiet (a fresh Python imports torch); generous for load 10
        while len(list(tmp_path.glob("*.pids"))) < 2 and time.monotonic() < deadline:
            assert parent.poll() is None, "the stand-in parent exited early"
            time.sleep(0.05)
        pids = _read_pids(tmp_path)
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        helpers = _children_of(parent.pid)  # multiprocessing's forkserver and resource tracker
    finally:
        parent.kill()
        parent.wait()
    _assert_all_dead(pids + helpers)  # the lifeline: each rank kills its own group


# ---- Results that cannot travel safely -------------------------------------------------------------------------
def test_result_of_an_arbitrary_class_is_rejected():
    with pytest.raises(RankFailure) as info:
        run_ranks(_returns_custom_object, 1)
    assert info.value.kind == "bad-result"
    assert "returned an object of type tests.test_harness._Custom at result['bad'][1]" in str(info.value)


def _result_pipe():
    # What a body can always find: the harness's result pipe (here a local of the rank's main, up the stack; the
    # garbage collector also holds other writable pipes, such as the runtime audit's).
    frame = sys._getframe()
    while frame.f_code.co_name != "_rank_main":
        frame = frame.f_back
    return frame.f_locals["conn"]


def _announces_a_huge_report(rank, world_size):
    os.write(_result_pipe().fileno(), (2 << 30).to_bytes(8, "big"))  # 2 GiB to come, then nothing
    time.sleep(60)


def test_a_report_over_the_size_limit_fails_at_once_without_buffering_it():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_announces_a_huge_report, 1, timeout=30)
    assert info.value.kind == "bad-message" and "announced a report of 2147483648 bytes" in str(info.value)
    assert time.monotonic() - start < 25, "the parent must refuse the length at once, not wait for the timeout"


def _reports_then_exits_nonzero(rank, world_size):
    buf = io.BytesIO()
    torch.save({"kind": "result", "result": rank}, buf)
    os.write(_result_pipe().fileno(), len(buf.getvalue()).to_bytes(8, "big") + buf.getvalue())
    os._exit(3)


def test_a_report_is_believed_only_with_exit_code_0():
    # The rank's report is data; whether the process finished is the kernel's word (waitpid), not the rank's.
    with pytest.raises(RankFailure) as info:
        run_ranks(_reports_then_exits_nonzero, 2)
    assert info.value.kind == "bad-message" and "then exited with code 3" in str(info.value)


def _debugging_leftovers(rank, world_size):
    # Correct code may use what the old in-rank guard forbade: nothing in a rank decides a pass any more.
    import ctypes
    import gc
    objects = len(gc.get_objects())
    frames = len(sys._current_frames())
    trimmed = ctypes.CDLL(None).malloc_trim(0)
    sys.settrace(None)
    return [objects > 0, frames >= 1, trimmed in (0, 1)]


def test_gc_ctypes_and_frame_introspection_are_allowed():
    for got in run_ranks(_debugging_leftovers, 2):
        assert got == [True, True, True]


def _walks_its_own_stack_and_formats_tracebacks(rank, world_size):
    # What correct code may do while a body runs: inspect its own stack, log, format a traceback.
    import inspect
    import logging
    import traceback as tb
    logging.getLogger("fsdp-test").warning("rank %d logs", rank)
    try:
        raise ValueError("caught")
    except ValueError:
        text = tb.format_exc()
    return [len(inspect.stack()) > 0, "caught" in text, inspect.currentframe().f_code.co_name]


def test_stack_walks_and_tracebacks_stay_allowed():
    for got in run_ranks(_walks_its_own_stack_and_formats_tracebacks, 2):
        assert got == [True, True, "_walks_its_own_stack_and_formats_tracebacks"]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch exploited",))


def test_parent_refuses_a_hostile_message(tmp_path, monkeypatch):
    # What a rank could send if it bypassed the harness's own checks: the parent must not unpickle it freely.
    monkeypatch.chdir(tmp_path)
    buf = io.BytesIO()
    torch.save({"kind": "result", "result": _Exploit()}, buf)
    assert _decode_message(buf.getvalue()) is None
    assert not (tmp_path / "exploited").exists()
    assert _decode_message(b"not a torch.save payload") is None


# ---- Memory -------------------------------------------------------------------------------------------------------
def test_memory_bomb_is_stopped_by_the_limit():
    run_ranks(_sum_of_ranks, 2, 3, memory_limit_bytes=100_000_000)  # a limit that leaves room: no effect
    with pytest.raises(RankFailure) as info:
        run_ranks(_memory_bomb, 1, memory_limit_bytes=300_000_000)
    message = str(info.value)
    assert "out of memory" in message and "memory limit: 300000000 bytes" in message


def _shared_memory_bomb(rank, world_size):
    import mmap
    hoard = []
    while True:  # MAP_SHARED | MAP_ANONYMOUS, touched: RLIMIT_DATA does not count it
        m = mmap.mmap(-1, 100 << 20, flags=mmap.MAP_SHARED)
        m.write(b"x" * (100 << 20))
        hoard.append(m)


def test_shared_memory_counts_against_the_limit():
    with pytest.raises(RankFailure) as info:
        run_ranks(_shared_memory_bomb, 1, memory_limit_bytes=100_000_000)
    message = str(info.value)
    assert "rank 0 of 1 raised" in message and "out of memory" in message, message


# ---- Files -------------------------------------------------------------------------------------------------------
def _writes_a_big_file(rank, world_size):
    import tempfile
    with tempfile.NamedTemporaryFile() as f:  # in the rank's own TMPDIR
        f.write(b"x" * (8 << 20))
        f.flush()
    return rank


def test_file_size_limit(monkeypatch):
    monkeypatch.setenv("FSDP_RANK_FILE_LIMIT_BYTES", str(4 << 20))
    with pytest.raises(RankFailure) as info:
        run_ranks(_writes_a_big_file, 1)
    assert "File too large" in str(info.value) and "file size limit" in str(info.value), str(info.value)
    monkeypatch.setenv("FSDP_RANK_FILE_LIMIT_BYTES", str(16 << 20))
    assert run_ranks(_writes_a_big_file, 1) == [0]


def _tmp_of_the_body(rank, world_size):
    import tempfile
    path = tempfile.mkdtemp()
    Path(path, "left-behind").write_text("x")
    return path


def test_the_body_gets_a_temporary_directory_of_its_own_that_goes_with_the_run():
    paths = run_ranks(_tmp_of_the_body, 2)
    import tempfile
    for path in paths:
        assert not path.startswith(tempfile.gettempdir() + os.sep + "tmp"), path
        assert "fsdp-ranks-" in path and not os.path.exists(path), path


def _deep_tree_in_its_tmp(rank, world_size, outside):
    """1,500 levels of 12-character names (the path is longer than PATH_MAX) in the body's TMPDIR, with links out."""
    import tempfile
    top = tempfile.gettempdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(1500):
        name = f"level{level:07d}"
        os.mkdir(name, dir_fd=fd)
        if level == 700:
            os.symlink(outside, "link-out", dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    return top


def test_a_tree_too_deep_for_recursion_goes_with_the_run(tmp_path):
    """Issue 32: shutil.rmtree recursed on a 1,500-deep tree in a rank's TMPDIR, raised RecursionError out of
    run_ranks, and the folder stayed. The run's folder goes, whatever its depth, and no link out is followed."""
    outside = tmp_path / "not-the-run's"
    outside.mkdir()
    (outside / "kept").write_text("x")
    [top] = run_ranks(_deep_tree_in_its_tmp, 1, str(outside))
    run_dir = top.split(os.sep + "rank" + os.sep)[0]
    assert "fsdp-ranks-" in run_dir and not os.path.exists(run_dir), run_dir
    assert (outside / "kept").read_text() == "x"


def _replaces_its_output(rank, world_size, how, target):
    print("before the swap")
    out = os.readlink("/proc/self/fd/1")
    os.unlink(out)
    if how == "fifo":
        os.mkfifo(out)
    else:
        os.symlink(target, out)
    raise RuntimeError(f"rank {rank} swapped its output for a {how}")


@pytest.mark.parametrize("how", ["fifo", "symlink"])
def test_an_output_file_swapped_for_a_fifo_or_a_link_is_not_read(how, tmp_path):
    secret = tmp_path / "hidden_test.py"
    secret.write_text("SECRET_CONSTANT = 'do not print me'\n")
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_replaces_its_output, 1, how, str(secret), timeout=30)
    message = str(info.value)
    assert time.monotonic() - start < 25, "the grader waited on the FIFO"
    assert "do not print me" not in message
    assert "rank 0 of 1 raised RuntimeError: rank 0 swapped its output" in message
    assert "not shown, its output file is no longer a regular file" in message


# ---- Messages that name the rank that caused the failure ----------------------------------------------------------
def _rank1_stops_itself(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(2))
    return rank


def test_a_stopped_rank_is_named_with_its_stacks():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_stops_itself, 2, timeout=30, collective_timeout=20)
    message = str(info.value)
    assert info.value.kind == "stopped" and info.value.rank == 1, message
    assert message.startswith("rank 1 of 2 was stopped (SIGSTOP"), message
    assert "in _rank1_stops_itself" in message, "the stopped rank's stack must be shown"


def _rank0_destroys_the_group(rank, world_size):
    if rank == 0:
        dist.destroy_process_group()
        return rank
    time.sleep(0.2)
    dist.all_reduce(torch.ones(2))
    return rank


def test_a_rank_that_destroyed_the_process_group_is_named():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank0_destroys_the_group, 2, timeout=30, collective_timeout=5)
    message = str(info.value)
    assert info.value.kind == "group-destroyed" and info.value.rank == 0, message
    assert message.startswith("rank 0 of 2 returned without the default process group"), message


# ---- Kernel witnesses ---------------------------------------------------------------------------------------
def _peak_then_free(rank, world_size, nbytes, reset):
    t = torch.ones(nbytes // 4)  # written: resident
    time.sleep(0.05)  # the parent reads it at least once
    del t
    if reset:  # hide the peak: VmHWM starts again from what is resident now
        time.sleep(0.05)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        time.sleep(0.1)
    return 0


def _peak_then_raise(rank, world_size, nbytes):
    t = torch.ones(nbytes // 4)
    time.sleep(0.05)
    raise ZeroDivisionError(f"rank {rank} gives up holding {t.numel()} elements")


def test_a_witnessed_run_that_fails_is_still_judged_by_the_kernel():
    # Evidence fails closed: a rank that raises in a witnessed run (as a submission might, only there) is still
    # read to its end; a broken bound is then the kernel's failure (kind "witness", which the grader carries to
    # the tests that decide memory from the ranks' reports), with the rank's own failure in its message.
    with pytest.raises(RankFailure) as info:
        run_ranks(_peak_then_raise, 1, 96 << 20, witness=Witness(peak_bytes=32 << 20, deferred=True))
    message = str(info.value)
    assert info.value.kind == "witness" and "resident memory rise" in message, message
    assert "The run failed as well" in message and "ZeroDivisionError" in message, message
    # Within its bound the run's own failure stands, as it is.
    with pytest.raises(RankFailure) as info:
        run_ranks(_peak_then_raise, 1, 1 << 20, witness=Witness(peak_bytes=32 << 20, deferred=True))
    assert info.value.kind == "raised" and "ZeroDivisionError" in str(info.value), str(info.value)


def _holds_outside_its_page_tables(rank, world_size, how, nbytes):
    """Memory VmHWM does not show (issue 32): pages of an unlinked /dev/shm file, mapped MAP_SHARED and dropped
    with MADV_DONTNEED ("freed"), which stay in the file; or unix socket buffers, filled and never read."""
    import mmap
    import socket
    held = []
    if how == "shm":
        fd = os.open(f"/dev/shm/fsdp-witness-{os.getpid()}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(f"/dev/shm/fsdp-witness-{os.getpid()}")
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        window = 4 << 20  # written and dropped a window at a time: resident memory never rises above one
        for start in range(0, nbytes, window):
            for i in range(start, start + window, 4096):
                m[i] = 1
            m.madvise(mmap.MADV_DONTNEED, start, window)
        held.append((fd, m))
    else:
        while sum(a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for a, _ in held) < nbytes:
            a, b = socket.socketpair()
            a.setblocking(False)
            try:
                while True:
                    a.send(bytes(65536))
            except BlockingIOError:
                pass
            held.append((a, b))
    time.sleep(0.1)
    return len(held)


@pytest.mark.parametrize("how", ["shm", "sockets"])
def test_witness_counts_memory_held_outside_the_page_tables(how):
    from tests.rank_cgroup import RankCgroup
    probe = RankCgroup.create(f"fsdp-probe-{os.getpid()}")
    if probe is None:
        pytest.skip("no memory cgroup can be made here (not root, or a read-only cgroup file system): the witness "
                    "reads /proc alone")
    probe.remove()
    witness = Witness(peak_bytes=32 << 20, deferred=True)
    run_ranks(_holds_outside_its_page_tables, 1, how, 80 << 20, witness=witness)
    measured = witness.measured[0]
    assert measured["beyond_page_tables"] and measured["held_bytes"] >= 60 << 20, measured
    with pytest.raises(RankFailure, match="beyond its page tables") as info:
        witness.check()
    assert info.value.kind == "witness"


def test_without_a_cgroup_the_witness_counts_tmpfs_files_the_rank_holds(monkeypatch):
    # A Gradescope container has no cgroup to make: the parent reads the rank's descriptors and mappings instead.
    import tests.harness
    monkeypatch.setattr(tests.harness.RankCgroup, "create", classmethod(lambda cls, name: None))
    witness = Witness(peak_bytes=32 << 20, deferred=True)
    run_ranks(_holds_outside_its_page_tables, 1, "shm", 80 << 20, witness=witness)
    assert witness.measured[0]["held_bytes"] >= 60 << 20, witness.measured
    with pytest.raises(RankFailure, match="beyond its page tables"):
        witness.check()


def test_witness_sees_the_peak_of_memory_the_rank_freed_and_a_reset_of_it():
    witness = Witness(peak_bytes=32 << 20, deferred=True)
    run_ranks(_peak_then_free, 1, 96 << 20, False, witness=witness)
    assert witness.measured[0]["peak_bytes"] >= 90 << 20, witness.measured
    with pytest.raises(RankFailure, match="resident memory rise") as info:
        witness.check()
    assert info.value.kind == "witness" and "kernel's counts decide" in str(info.value)
    run_ranks(_peak_then_free, 1, 96 << 20, False, witness=Witness(peak_bytes=128 << 20))  # within: passes
    with pytest.raises(RankFailure, match="the peak was reset"):
        run_ranks(_peak_then_free, 1, 96 << 20, True, witness=Witness(peak_bytes=128 << 20))


def _gather(rank, world_size, numel):
    out = torch.empty(numel * world_size)
    dist.all_gather_into_tensor(out, torch.full((numel,), float(rank)))
    return 0


def test_witness_counts_the_bytes_sent_to_peers():
    # Counted at the rank's sockets (TCP's counters, through sock_diag), and by wchar (gloo writes with write()):
    # each rank sends its 8 MiB once, and a few hundred bytes of gloo's headers.
    witness = Witness(sent_bytes=4 << 20, deferred=True)
    run_ranks(_gather, 2, 2 << 20, witness=witness)
    for m in witness.measured:
        assert 8 << 20 <= m["sent_bytes"] <= (8 << 20) + (64 << 10), witness.measured
        assert 8 << 20 <= m["wchar_sent_bytes"] <= (8 << 20) + (64 << 10), witness.measured
    with pytest.raises(RankFailure, match="bytes written to the rank's sockets|bytes written"):
        witness.check()


def _reduce_scatter(rank, world_size, numel, how):
    """A reduce-scatter of ``numel`` elements as it moves data (each rank sends each peer only that peer's chunk:
    all_to_all; gloo's own reduce_scatter all-reduces), or an all-reduce in its place."""
    x = torch.full((numel,), float(rank + 1))
    if how == "all_reduce":
        dist.all_reduce(x)
        return x[rank * numel // world_size].item()
    received = torch.empty(numel)
    dist.all_to_all_single(received, x)
    return received.view(world_size, -1).sum(0)[0].item()


@pytest.mark.parametrize("counted_by", ["sockets", "wchar"])
def test_an_all_reduce_in_place_of_a_reduce_scatter_breaks_its_sent_bound(counted_by, monkeypatch):
    # W=2, 2 Mi elements: a reduce-scatter sends 4 MiB from each rank, an all-reduce 8 MiB (measured: 8,388,752
    # and 16,779,616 bytes at the sockets). The bound is the reduce-scatter's; counted at the sockets, and by
    # wchar alone where sock_diag is refused (forced here), with the failure saying so.
    if counted_by == "wchar":
        import tests.harness
        monkeypatch.setattr(tests.harness.SocketTable, "open", classmethod(lambda cls: None))
    numel = 2 << 20
    bound = numel * 4 // 2
    witness = Witness(sent_bytes=bound)
    assert run_ranks(_reduce_scatter, 2, numel, "reduce_scatter", witness=witness) == [3.0, 3.0]
    for m in witness.measured:
        assert bound <= m["sent_bytes"] <= bound + (64 << 10), witness.measured
        assert (m["socket_sent_bytes"] is None) == (counted_by == "wchar"), witness.measured
    with pytest.raises(RankFailure) as info:
        run_ranks(_reduce_scatter, 2, numel, "all_reduce", witness=Witness(sent_bytes=bound))
    message = str(info.value)
    assert info.value.kind == "witness" and "an all-reduce where a reduce-scatter does" in message, message
    if counted_by == "sockets":
        assert "bytes written to the rank's sockets" in message, message
    else:
        assert "sock_diag refused" in message, message


def _sends_without_write(rank, world_size, nbytes):
    """Bytes through send() on a loopback TCP connection of the rank's own: wchar does not count them."""
    import socket
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    chunk, sent, received = bytes(1 << 20), 0, 0
    while sent < nbytes:
        sent += a.send(chunk)
        while received < sent:  # read what was sent, so that the next send() never waits
            received += len(b.recv(1 << 20))
    time.sleep(0.3)  # open across the parent's listings of its sockets (every 50 ms)
    return sent


def test_bytes_a_rank_sends_without_write_are_counted_at_its_sockets():
    # wchar counts write() and writev() only: 16 MiB sent with send() leave it unchanged, not the sockets. (A
    # socket opened, used and closed between two listings of the rank's sockets, 50 ms apart, is not seen.)
    if __import__("tests.harness_sockets", fromlist=["SocketTable"]).SocketTable.open() is None:
        pytest.skip("sock_diag is refused here: bytes are counted with wchar alone")
    witness = Witness(sent_bytes=4 << 20, deferred=True)
    run_ranks(_sends_without_write, 1, 16 << 20, witness=witness)
    m = witness.measured[0]
    assert m["socket_sent_bytes"] >= 16 << 20 and m["wchar_body_bytes"] < 1 << 20, witness.measured
    with pytest.raises(RankFailure, match="bytes written to the rank's sockets"):
        witness.check()


def _hides_memory(rank, world_size, case, nbytes, name):
    """Memory a rank holds where its page tables do not show it (issue 35's cases), ``nbytes`` of it, kept until
    the harness ends the run. ``name``: the /dev/shm file or the SysV key the test removes afterwards."""
    import ctypes
    import socket
    held = []
    if case == "forked child":  # a child of the rank's own, parking memory (pages the rank never had)
        if os.fork() == 0:
            block = bytearray(b"\1") * nbytes  # written: resident in the child
            time.sleep(60)  # the harness kills the run long before: `block` is held until then
            del block
            os._exit(0)
    elif case == "tcp buffers":  # loopback connections filled and never read
        server = socket.create_server(("127.0.0.1", 0))
        total = 0
        while total < nbytes and len(held) < 200:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
            a.setblocking(False)
            try:
                while True:
                    total += a.send(bytes(1 << 16))
            except BlockingIOError:
                pass
            held.append((a, b))
    elif case == "unix buffers":
        total = 0
        while total < nbytes and len(held) < 2000:
            a, b = socket.socketpair()
            a.setblocking(False)
            try:
                while True:
                    total += a.send(bytes(1 << 16))
            except BlockingIOError:
                pass
            held.append((a, b))
    elif case == "named /dev/shm file":  # written, closed, never mapped: nothing of the rank points at it
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, nbytes)  # its pages, at once: open for a few ms only
        os.close(fd)
    elif case == "detached SysV segment":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        shmid = libc.shmget(name, ctypes.c_size_t(nbytes), 0o1000 | 0o600)  # IPC_CREAT
        assert shmid >= 0, os.strerror(ctypes.get_errno())
        address = libc.shmat(shmid, None, 0)
        ctypes.memset(address, 1, nbytes)
        libc.shmdt(ctypes.c_void_p(address))
    time.sleep(0.4)  # across the parent's listings (every 50 ms) and walks of /dev/shm (every 250 ms)
    return len(held)


HIDING_CASES = ["forked child", "tcp buffers", "unix buffers", "named /dev/shm file", "detached SysV segment"]


@pytest.mark.parametrize("path", ["cgroup", "proc"])
@pytest.mark.parametrize("case", HIDING_CASES)
def test_witness_counts_memory_a_rank_hides(case, path, monkeypatch):
    # Issue 35: each rank of the witnessed test parked 200 MiB in each of these, unseen by the kernel's count on
    # one path or both. Counted now on both: with a memory cgroup of the rank's own, and on the /proc fallback
    # (a Gradescope container can make no cgroup; forced here). The grader's seccomp filter refuses fork, unix
    # sockets and SysV in graded ranks (tests/rank_isolation.py); this counting is the second line, shown here
    # without the filter (run_ranks outside the grader installs none).
    import ctypes

    import tests.harness
    if path == "cgroup":
        probe = tests.harness.RankCgroup.create(f"probe{os.getpid()}")
        if probe is None:
            pytest.skip("no memory cgroup can be made here (not root, or a read-only cgroup file system)")
        probe.remove()
    else:
        monkeypatch.setattr(tests.harness.RankCgroup, "create", classmethod(lambda cls, name: None))
    nbytes = 96 << 20
    name = f"/dev/shm/fsdp-hide-{os.getpid()}" if case == "named /dev/shm file" else 0x46530000 + os.getpid() % 65536
    witness = Witness(peak_bytes=48 << 20, deferred=True)
    try:
        run_ranks(_hides_memory, 1, case, nbytes, name, witness=witness)
    finally:
        if case == "named /dev/shm file" and os.path.exists(name):
            os.unlink(name)
        if case == "detached SysV segment":
            libc = ctypes.CDLL(None)
            shmid = libc.shmget(name, ctypes.c_size_t(0), 0)
            if shmid >= 0:
                libc.shmctl(shmid, 0, None)  # IPC_RMID
    measured = witness.measured[0]
    assert measured["held_bytes"] >= 64 << 20, measured
    with pytest.raises(RankFailure, match="beyond its page tables") as info:
        witness.check()
    assert info.value.kind == "witness"
