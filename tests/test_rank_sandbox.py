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
import encodings.idna  # noqa: F401  (getaddrinfo imports it lazily)
import errno
import os
import platform
import signal
import socket
import subprocess
import tempfile
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
        # Issue 40: bytes that the count of TCP sockets would not see.
        "UDP socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close(),
        "UDP socket over IPv6": lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close(),
        "UDP socket, non-blocking": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK),
        "ICMP datagram socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP),
        "raw socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP),
        "packet socket": lambda: socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM),
        "SCTP stream socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132),
        "sock_diag netlink socket": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4),
    }


def _still_works() -> dict:
    thread = threading.Thread(target=lambda: None)
    return {
        "a thread": lambda: (thread.start(), thread.join()),
        "a signal to itself": lambda: os.kill(os.getpid(), 0),
        "a signal to its own thread": lambda: signal.pthread_kill(threading.get_ident(), 0),
        "a TCP socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(),
        "a TCP socket over IPv6": lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close(),
        "the C library's address lookup": lambda: socket.getaddrinfo(socket.gethostname(), None),
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


def test_a_raw_socket_is_refused_by_the_filter_itself_not_only_for_want_of_root():
    """A raw socket needs CAP_NET_RAW, which the rank user lacks anyway; the filter refuses it even to root (tried in
    a forked child under the filter, so the grader keeps none)."""
    from tests.rank_isolation import refuse_hidden_memory
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        answer = "?"
        try:
            answer = refuse_hidden_memory() or _outcome(
                lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP).close())
        finally:
            os.write(write, answer.encode()[:1000])
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    assert answer == "EPERM", answer


# ---- The evasions of issue 40, written as a dishonest rank would ----------------------------------------------
def _all_reduce_over_udp(rank, world_size):
    """16.8 MB from rank to rank over UDP counted as 384 bytes at the TCP sockets (issue 40)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    ports = [None] * world_size
    dist.all_gather_object(ports, sock.getsockname()[1])
    if rank == 0:
        for _ in range(64):
            sock.sendto(bytes(60_000), ("127.0.0.1", ports[1]))
    return rank


def test_data_between_ranks_over_udp_fails_with_the_graders_message(monkeypatch):
    monkeypatch.setenv("FSDP_RANK_USER", "nobody")
    with pytest.raises(RankFailure) as info:
        run_ranks(_all_reduce_over_udp, 2, timeout=60)
    message = str(info.value)
    assert "raised PermissionError" in message and REFUSED_NOTE in message, message


# Files: each place a dishonest rank 0 writes to (mode 666, its own folder opened to all), and rank 1 reads back.
_PLACES = ("TMPDIR", "/tmp", "/var/tmp", "/dev/shm")


def _shares_files(rank, world_size, token):
    """Rank 0 leaves data at a path in each shared place, and a torch.from_file(shared=True) window (issue 40's
    all-reduce through 1 MiB windows of files in the run's TMPDIR); rank 1 reads them at the same paths."""
    folder = tempfile.gettempdir()
    paths = {place: os.path.join(folder if place == "TMPDIR" else place, f"fsdp-sandbox-{token}")
             for place in _PLACES if place == "TMPDIR" or os.path.isdir(place)}
    paths["torch.from_file window"] = os.path.join(folder, f"fsdp-window-{token}")
    mine = {"TMPDIR": folder, "mode": f"{os.stat(folder).st_mode & 0o777:o}", "uid": os.getuid()}
    if rank == 0:
        os.chmod(folder, 0o777)
        for place, path in paths.items():
            if place != "torch.from_file window":
                with open(path, "w") as f:
                    f.write("from rank 0")
                os.chmod(path, 0o666)
        window = torch.from_file(paths["torch.from_file window"], shared=True, size=1024)
        window.fill_(1.0)
    theirs = [None] * world_size
    dist.all_gather_object(theirs, paths)
    dist.barrier()
    got = {}
    if rank == 1:
        for place, path in theirs[0].items():
            if place == "torch.from_file window":
                got[place] = _outcome(lambda: got.__setitem__(
                    "window sum", float(torch.from_file(path, shared=True, size=1024).sum())))
                continue
            try:
                with open(path) as f:
                    got[place] = f.read()
            except OSError as err:
                got[place] = errno.errorcode.get(err.errno, str(err.errno))
    dist.barrier()
    return mine, got


def _file_outcomes():
    token = os.urandom(6).hex()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FSDP_RANK_USER", "nobody")
            return run_ranks(_shares_files, 2, token, timeout=120)
    finally:  # what rank 0 left in the machine's places where it had no namespace (the grader's cleanup.py's job)
        for place in _PLACES[1:]:
            try:
                os.unlink(os.path.join(place, f"fsdp-sandbox-{token}"))
            except OSError:
                pass


def _file_outcomes_with(namespace: str):
    """_file_outcomes in a pytest-free Python of its own whose forkserver reads FSDP_RANK_MOUNT_NAMESPACE."""
    import json
    import sys
    code = ("import json, tests.test_rank_sandbox as t; print('OUT', json.dumps(t._file_outcomes()))")
    env = dict(os.environ, FSDP_RANK_MOUNT_NAMESPACE=namespace)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1][4:])


def test_a_file_rank_0_writes_is_not_there_for_rank_1():
    """Where the kernel lets root make a mount namespace (here) and FSDP_RANK_MOUNT_NAMESPACE=1 turns it on, every
    shared temporary place and TMPDIR is a private tmpfs per rank: what rank 0 writes at a path, whatever its mode,
    rank 1 does not find there."""
    (mine0, _), (mine1, got) = _file_outcomes_with("1")
    assert set(got) >= {"TMPDIR", "/tmp", "/dev/shm", "torch.from_file window"}, got
    for place, outcome in got.items():
        assert outcome != "from rank 0" and not (place == "window sum" and outcome != 0.0), (place, got)
    # The same path for both (its own tmpfs in each rank's namespace), which neither can open to the other.
    assert mine0["TMPDIR"] == mine1["TMPDIR"] and mine0["mode"] == mine1["mode"] == "700", (mine0, mine1)


def test_without_a_mount_namespace_each_rank_still_gets_a_folder_of_its_own():
    """The fallback (a container where root cannot make a mount namespace), forced by FSDP_RANK_MOUNT_NAMESPACE=0 in
    a pytest of its own (the rank reads it in the forkserver's environment): TMPDIR is a folder per rank, mode 700.
    Ranks that share one uid can still open each other's folder and meet in /tmp and /dev/shm: a uid per rank
    is what would close that (issue 40 item 4, not done: see the module's docstring)."""
    (mine0, _), (mine1, got) = _file_outcomes_with("0")
    assert mine0["TMPDIR"].endswith("/rank0") and mine1["TMPDIR"].endswith("/rank1"), (mine0, mine1)
    assert mine0["mode"] == mine1["mode"] == "700", (mine0, mine1)
    assert got["TMPDIR"] == "from rank 0", got  # the fallback's known gap: one uid for both ranks
