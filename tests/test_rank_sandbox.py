"""Ranks share nothing but their process group (issue 35 item 4): under the grader's seccomp filter
(tests/rank_isolation.py, installed as ranks run when grading as root: after the process group is up, then the drop
to the rank user), every channel between ranks other than the process group is refused, each channel checked by a
body that tries it; threads, a signal to itself and torch.distributed still work; and a refused call that makes a
rank fail says the grader refused it.

Runs as root only (the rank user is the system's ``nobody``, as in tests/staff/test_rank_user.py), on x86_64 (the
probe calls some system calls by number). Everything the bodies use is imported here: ``nobody`` may not be able to
read the Python installation after the drop.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import socket
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist
import torch.utils.serialization  # noqa: F401  (torch.save imports it lazily)

from tests.harness import RankFailure, run_ranks
from tests.rank_isolation import REFUSED_NOTE

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or platform.machine() != "x86_64",
                                reason="needs root (ranks drop to the rank user as on Gradescope) and x86_64")

_NR = dict(shmget=29, shmat=30, semget=64, msgget=68, userfaultfd=323, tgkill=234, pidfd_send_signal=424)
_IPC_CREAT = 0o1000


def _outcome(call) -> str:
    try:
        call()
        return "done"
    except OSError as err:
        return errno.errorcode.get(err.errno, str(err.errno))


def _syscall(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def _fork_and_reap():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _mq_open():
    try:
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
    except OSError:
        rt = ctypes.CDLL(None, use_errno=True)
    name = f"/fsdp-sandbox-{os.getpid()}".encode()
    if rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    rt.mq_unlink(name)


def _proc_fd_signal(sibling: int):
    fd = os.open(f"/proc/{sibling}", os.O_RDONLY | os.O_DIRECTORY)  # a /proc/<pid> directory works as a pidfd
    try:
        _syscall(_NR["pidfd_send_signal"], fd, 0, 0, 0)
    finally:
        os.close(fd)


def _channels(sibling: int) -> dict:
    """Each channel between ranks, tried: name -> a callable."""
    abstract = b"\0fsdp-sandbox-%d" % os.getpid()
    return {
        "abstract unix socket": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(abstract),
        "socketpair": lambda: socket.socketpair(),
        "fork": _fork_and_reap,
        "subprocess": lambda: subprocess.run(["/bin/true"], check=True),
        "SysV shared memory": lambda: _syscall(_NR["shmget"], 0, 1 << 20, _IPC_CREAT | 0o600),
        "SysV shmat": lambda: _syscall(_NR["shmat"], 0, 0, 0),
        "SysV semaphore": lambda: _syscall(_NR["semget"], 0, 1, _IPC_CREAT | 0o600),
        "SysV message queue": lambda: _syscall(_NR["msgget"], 0, _IPC_CREAT | 0o600),
        "POSIX message queue": _mq_open,
        "userfaultfd": lambda: _syscall(_NR["userfaultfd"], 0),
        "kill the sibling": lambda: os.kill(sibling, 0),
        "kill every process of the user": lambda: os.kill(-1, 0),
        "tgkill the sibling": lambda: _syscall(_NR["tgkill"], sibling, sibling, 0),
        "pidfd_open the sibling": lambda: os.close(os.pidfd_open(sibling)),
        "pidfd_send_signal through /proc/<pid>": lambda: _proc_fd_signal(sibling),
    }


def _still_works() -> dict:
    thread = threading.Thread(target=lambda: None)
    return {
        "a thread": lambda: (thread.start(), thread.join()),
        "a signal to itself": lambda: os.kill(os.getpid(), 0),
        "a signal to its own thread": lambda: signal.pthread_kill(threading.get_ident(), 0),
        "a TCP socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(),
        "a new process group": lambda: dist.all_reduce(torch.ones(1), group=dist.new_group(backend="gloo")),
    }


def _tries_every_channel(rank, world_size):
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    sibling = pids[(rank + 1) % world_size]
    out = {name: _outcome(call) for name, call in _channels(sibling).items()}
    out.update({name: _outcome(call) for name, call in _still_works().items()})
    dist.barrier()  # neither leaves (and is killed) while the other still tries
    return out


@pytest.fixture(scope="module")
def outcomes():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSDP_RANK_USER", "nobody")
        return run_ranks(_tries_every_channel, 2, timeout=120)


@pytest.mark.parametrize("channel", list(_channels(0)))
def test_each_channel_between_ranks_is_refused(outcomes, channel):
    for rank, got in enumerate(outcomes):
        assert got[channel] == "EPERM", f"rank {rank}: {channel}: {got[channel]} (all: {got})"


@pytest.mark.parametrize("what", list(_still_works()))
def test_what_a_rank_needs_still_works(outcomes, what):
    for rank, got in enumerate(outcomes):
        assert got[what] == "done", f"rank {rank}: {what}: {got[what]}"


def _starts_a_process(rank, world_size):
    subprocess.run(["/bin/true"], check=True)


def test_a_refused_call_that_fails_a_rank_says_the_grader_refused_it(monkeypatch):
    monkeypatch.setenv("FSDP_RANK_USER", "nobody")
    with pytest.raises(RankFailure) as info:
        run_ranks(_starts_a_process, 1)
    message = str(info.value)
    assert "rank 0 of 1 raised PermissionError" in message and REFUSED_NOTE in message, message
