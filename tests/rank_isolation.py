"""What a rank does to itself, and what the autograder asks of it: the isolation and limits of tests/harness.py.

A student reading a failure needs only tests/harness.py (run_ranks, its messages). This module holds the parts
that keep a rank from harming the machine or the grader, all applied inside the rank before the body runs:

- ``grader_settings``: the autograder's overrides, read from the environment (timeouts, memory, files,
  processes, the unprivileged rank user); unset, the call's own values apply and nothing else changes.
- ``close_inherited_fds``, ``create_private``, ``redirect_output``: a rank starts with no descriptor of the
  grader's and writes its output and stacks into files it cannot swap for links.
- ``watch_lifeline``: the rank kills its own process group when the pytest process goes away.
- ``apply_limits``, ``drop_privileges``: hard rlimits (room for 64 process groups' threads), and, grading as
  root, the system calls a rank may not make (``refuse_hidden_memory``: memory the grader could not count, and
  every channel to another process but the process group: new processes, unix sockets, System V IPC, message
  queues, userfaultfd, signals to other pids), then the rank user with umask 077, right before the body.
  ``explain_refusal`` and ``limits_note`` say so when a refused call or a limit fails a rank. Before the drop,
  the rank's temporary places become its own (tests/rank_places.py: a private tmpfs on /tmp, /dev/shm and its
  TMPDIR in a mount namespace of its own, where the kernel allows one; else a folder per rank).
- ``kill_everything_of``: the harness ends every process of the rank user after each run, so nothing a body
  started (a daemon that left its session) outlives it into the next run (the FSDP2 run a test compares with).
- ``trace_task_calls``: staff measurement (which task functions a test calls; measure_times.py).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import sys
import threading
import time

from tests.rank_places import enter_own_mount_namespace, make_places_private

# Address space a rank may reserve beyond its memory limit: a correct implementation reserves at most 63 MiB more
# after the limit is set (measured over every public and hidden test); 4x that.
MEMORY_AS_SLACK_BYTES = 256 << 20
# Room for the process groups a correct design may create: one gloo group per unit, several models to a test (a
# differential test shards two), with room to spare (issue 35: a design with one group per unit still failed with
# "Resource temporarily unavailable" in two graded tests with 17 groups of room). A gloo group starts 3 threads,
# and each thread's stack counts against RLIMIT_DATA and RLIMIT_AS although almost none of it is touched; at the
# C library's default (8 MiB here) 64 groups would need 1.5 GiB of room beyond the memory limit. So threads started
# after the limits are set get 1 MiB stacks (gloo's ran its collectives with 64 KiB, measured), and 64 groups need
# 192 MiB. RLIMIT_NPROC counts every thread of the rank user: grade.py's RANK_MAX_PROCESSES leaves room for four
# ranks of 64 groups each, twice over (two gradings at once share the rank user).
GROUPS_ROOM = 64
THREADS_PER_GLOO_GROUP = 3
THREAD_STACK_BYTES = 1 << 20


def thread_stack_bytes() -> int:
    """The stack a new thread reserves: glibc's default thread attributes, else RLIMIT_STACK, else 8 MiB."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        attr, size = ctypes.create_string_buffer(256), ctypes.c_size_t()  # pthread_attr_t: 56 bytes on Linux
        if libc.pthread_getattr_default_np(attr) == 0 and \
                libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0 and size.value > 0:
            return size.value
    except (OSError, AttributeError):
        pass
    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return soft if 0 < soft != resource.RLIM_INFINITY else 8 << 20


def set_thread_stack_bytes(size: int) -> None:
    """The stack every thread started from now on reserves, unless it asks for its own (glibc's default attributes;
    gloo's and torch's std::thread and Python's threads use them)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        attr = ctypes.create_string_buffer(256)
        if libc.pthread_getattr_default_np(attr) == 0 and \
                libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(size)) == 0:
            libc.pthread_setattr_default_np(attr)
    except (OSError, AttributeError):
        pass


def groups_room_bytes() -> int:
    """What GROUPS_ROOM gloo groups reserve (their threads' stacks and guard pages), beyond any memory limit."""
    return GROUPS_ROOM * THREADS_PER_GLOO_GROUP * (thread_stack_bytes() + 4096)


def limits_note(text: str) -> str:
    """What to tell a student whose rank could not start a thread: EAGAIN ("Resource temporarily unavailable") in
    a traceback, or a C++ abort while a process group was being made (gloo's constructor, its thread half-started,
    ends in "terminate called without an active exception"); else ""."""
    if "Resource temporarily unavailable" not in text and not ("terminate called" in text and "new_group" in text):
        return ""
    nproc = os.environ.get("FSDP_RANK_MAX_PROCESSES", "").strip()
    return (f"a thread could not start: the grader's limits were reached (room for {GROUPS_ROOM} process groups "
            f"per rank beyond its memory limit, {THREADS_PER_GLOO_GROUP} threads of "
            f"{THREAD_STACK_BYTES >> 10} KiB stack each" + (f"; {nproc} threads for all ranks together, "
                                                          f"RLIMIT_NPROC" if nproc else "") +
            "): create fewer process groups or threads (one group per unit fits)")


def grader_settings(timeout: float, collective_timeout: float, memory_limit_bytes: int | None):
    """The autograder's overrides, from the environment (unset: the call's own values, and no user change).

    FSDP_RANK_MEMORY_LIMIT_BYTES: memory_limit_bytes for calls that give none (a memory bomb then fails its
    own test instead of the whole machine). FSDP_RANK_TIMEOUT_CAP: an upper bound, in seconds, on timeout and
    collective_timeout. FSDP_RANK_DEADLINE: the time (time.time()) by which the current test must end (the
    grading plugin's per-test limit, staff/autograder/grading_plugin.py): timeouts shrink to what is left of
    it, so a test that calls run_ranks several times still ends by then. FSDP_RANK_FILE_LIMIT_BYTES: the
    largest file a rank may write (RLIMIT_FSIZE; its output file included). FSDP_RANK_MAX_PROCESSES: how many processes and threads the rank user may have at
    once (RLIMIT_NPROC; only with FSDP_RANK_USER, since it counts every process of the user). FSDP_RANK_USER: a
    user name; when this process is root, each rank drops to that user right before the body runs (returned as
    (uid, gid)); otherwise it is ignored."""
    cap = os.environ.get("FSDP_RANK_TIMEOUT_CAP", "").strip()
    if cap:
        timeout, collective_timeout = min(timeout, float(cap)), min(collective_timeout, float(cap))
    deadline = os.environ.get("FSDP_RANK_DEADLINE", "").strip()
    if deadline:  # the grading plugin's time limit for the whole test (time.time()): what is left of it
        left = max(1.0, float(deadline) - time.time())
        timeout, collective_timeout = min(timeout, left), min(collective_timeout, left)
    limit = os.environ.get("FSDP_RANK_MEMORY_LIMIT_BYTES", "").strip()
    if memory_limit_bytes is None and limit:
        memory_limit_bytes = int(limit)
    run_as = None
    user = os.environ.get("FSDP_RANK_USER", "").strip()
    if user and os.geteuid() == 0:
        import pwd
        entry = pwd.getpwnam(user)
        if entry.pw_uid != 0:
            run_as = (entry.pw_uid, entry.pw_gid)
    limits = {}
    file_limit = os.environ.get("FSDP_RANK_FILE_LIMIT_BYTES", "").strip()
    if file_limit:
        limits["fsize"] = int(file_limit)
    nproc = os.environ.get("FSDP_RANK_MAX_PROCESSES", "").strip()
    if nproc and run_as is not None:
        limits["nproc"] = int(nproc)
    if run_as is not None:  # the grader counts the rank user's memory as a whole: nothing may hide from it
        limits["msgqueue"] = 0
        limits["refuse_hidden_memory"] = True
    return timeout, collective_timeout, memory_limit_bytes, limits, run_as

def close_inherited_fds(keep: set[int]) -> None:
    """Close every descriptor the rank inherited but stdin/out/err and ``keep``: the forkserver's, and the write
    end of the grading process's multiprocessing resource tracker (through which a rank could have the tracker,
    run by the grader, unlink a file or semaphore of the grader's, and fill its log). Nothing of this rank's own
    is open yet.

    This is the rank's first step, while it has one thread: so it also enters a mount namespace of its own here
    (tests/rank_places.py), which every thread it starts later shares."""
    enter_own_mount_namespace()
    from multiprocessing import resource_tracker
    tracker = resource_tracker._resource_tracker
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already
    tracker._fd = tracker._pid = None  # if the body uses shared memory, it starts a tracker of its own

def trace_task_calls(path: str) -> None:
    """Append "taskN_x.py:function" to `path` the first time each function of a task file runs in this rank.
    Staff measurement only (the grading plugin reads the result to know which tests call a function that hung);
    sys.setprofile slows every call, so timings are measured in runs without it."""
    seen: set = set()
    pattern = re.compile(r"fsdp_assignment[/\\](task\d_\w+\.py)$")

    def profile(frame, event, arg):
        if event != "call" or frame.f_code in seen:
            return
        seen.add(frame.f_code)
        m = pattern.search(frame.f_code.co_filename)
        if m:
            with open(path, "a") as f:
                f.write(f"{m.group(1)}:{frame.f_code.co_name}\n")

    threading.setprofile(profile)
    sys.setprofile(profile)

def drop_privileges(uid: int, gid: int) -> None:
    # First, still root, the rank's own temporary places (tests/rank_places.py): a private tmpfs on /tmp, /dev/shm
    # and its TMPDIR where it has a mount namespace, else a folder of its own. _run_body set TMPDIR to the run's
    # rank_dir/tmp and RANK to this rank.
    make_places_private(os.path.dirname(os.environ["TMPDIR"]), int(os.environ["RANK"]), uid, gid)
    # Every thread of the process (glibc applies setuid to all of them), before any student code runs: the body
    # can then write neither the grader's files nor its results, nor signal the grading process.
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.umask(0o077)  # what the body creates is its own user's alone


def apply_limits(memory_limit_bytes: int | None, limits: dict) -> None:
    """Hard limits (the body cannot raise them again), applied just before the body runs.

    Memory, two ways. RLIMIT_DATA counts private writable mappings (malloc, the large mmaps behind tensors)
    but not the address space torch and glibc reserve without using, so a test's number means "this much
    more". It does not count MAP_SHARED memory (1.5 GiB passed under a 256 MiB limit), so RLIMIT_AS, which
    counts every mapping, backs it up, with room for the reservations a rank makes as it runs (thread stacks,
    gloo's buffers; MEMORY_AS_SLACK_BYTES, measured). Both leave room for the thread stacks of one gloo group
    per unit (GROUPS_ROOM), and both are relative to the usage now, after torch and the process group are set up. glibc's per-thread malloc arenas (64 MiB of address space each) are capped at
    two first, so the address space a rank reserves does not grow with its thread count.

    A cgroup would count everything a rank's processes use, but needs a writable cgroup file system, which
    a Gradescope container (Docker, cgroup file system read-only, no CAP_SYS_ADMIN) does not give; rlimits work
    in any container.

    Files: RLIMIT_FSIZE bounds each file a rank writes (its output too), and SIGXFSZ is ignored so a write past
    it fails with "File too large" (OSError) instead of killing the rank without a word. Processes:
    RLIMIT_NPROC bounds the rank user's processes and threads (a fork bomb stops there)."""
    if memory_limit_bytes is not None:
        try:
            libc = __import__("ctypes").CDLL(None)
            libc.mallopt(-8, 2)  # M_ARENA_MAX = 2
        except (OSError, AttributeError):
            pass
        set_thread_stack_bytes(THREAD_STACK_BYTES)  # before the room is measured (GROUPS_ROOM)
        with open("/proc/self/status") as f:
            status = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmData:",
                                                                                                "VmSize:"))}
        room = groups_room_bytes()  # thread stacks: reserved, not used, but counted by both limits
        data = status["VmData"] * 1024 + int(memory_limit_bytes) + room
        resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        space = status["VmSize"] * 1024 + int(memory_limit_bytes) + MEMORY_AS_SLACK_BYTES + room
        resource.setrlimit(resource.RLIMIT_AS, (space, space))
    if limits.get("fsize") is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
    if limits.get("nproc") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    if limits.get("msgqueue") is not None:  # POSIX message queues: memory outside every count, and kept after exit
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (limits["msgqueue"], limits["msgqueue"]))
    if limits.get("refuse_hidden_memory"):
        why_not = refuse_hidden_memory()
        if why_not:
            print(f"harness: {why_not}", file=sys.stderr, flush=True)


# ---- system calls a rank may not make when grading as root -------------------------------------------------
# Memory the grader could not charge to the student (issue 25: three ranks held 2.8 GiB in memfd files and unlinked
# /dev/shm files against a 2 GiB limit): memfd_create and memfd_secret; and new namespaces (unshare, setns, clone
# with a CLONE_NEW* flag), in which a rank could mount a private tmpfs or hide its processes. The grader counts
# shared memory as a whole anyway (staff/autograder/student_limits.py); refusing these makes it plain.
# Ranks share nothing but the process group (issues 32 and 35): no reading or writing another process's memory
# (ptrace, process_vm_readv/writev; /proc/<pid>/mem needs the target dumpable, and a rank is not after it drops to
# the rank user, so prctl(PR_SET_DUMPABLE) and Yama's PR_SET_PTRACER, which would open it, are refused too), no
# kernel keyring (add_key, request_key, keyctl: a key outlives the run, and no cleanup step can see it), no io_uring
# (its reads and writes are no write() calls, so the witness's byte count would miss them); no unix sockets (an
# abstract one needs no file: socket(AF_UNIX), socketpair), no UDP, raw or packet socket (issue 40: 16.8 MB sent
# over UDP from rank to rank counted as 384 bytes at the TCP sockets, and 97 MB parked in UDP receive queues), no
# System V IPC, no POSIX message queue, no userfaultfd; no new process (fork, vfork, a clone without CLONE_THREAD:
# its memory would be no rank's, and it could outlive the run; threads still start, gloo and torch need them); no
# signal to another process (kill, tkill, tgkill and pidfd_open name a pid, allowed only for the rank itself, its
# process group after setsid, or 0; pidfd_send_signal and pidfd_getfd take a descriptor a /proc/<pid> directory
# can stand for: refused).
# Per architecture: (AUDIT_ARCH, {name: number}); clone3's flags sit in memory a filter cannot read, so it gets
# ENOSYS and the C library falls back to clone, whose flags it can.
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(clone=56, unshare=272, setns=308, memfd_create=319, clone3=435, memfd_secret=447,
                                seccomp=317, prctl=157, ptrace=101, process_vm_readv=310, process_vm_writev=311,
                                add_key=248, request_key=249, keyctl=250, io_uring_setup=425, io_uring_enter=426,
                                io_uring_register=427, fork=57, vfork=58, socket=41, socketpair=53, shmget=29,
                                shmat=30, shmctl=31, semget=64, semop=65, semctl=66, msgget=68, msgsnd=69,
                                msgrcv=70, msgctl=71, semtimedop=220, mq_open=240, userfaultfd=323, kill=62,
                                tkill=200, tgkill=234, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438)),
    "aarch64": (0xC00000B7, dict(clone=220, unshare=97, setns=268, memfd_create=279, clone3=435, memfd_secret=447,
                                 seccomp=277, prctl=167, ptrace=117, process_vm_readv=270, process_vm_writev=271,
                                 add_key=217, request_key=218, keyctl=219, io_uring_setup=425, io_uring_enter=426,
                                 io_uring_register=427, socket=198, socketpair=199, shmget=194, shmctl=195,
                                 shmat=196, semget=190, semctl=191, semtimedop=192, semop=193, msgget=186,
                                 msgctl=187, msgrcv=188, msgsnd=189, mq_open=180, userfaultfd=282, kill=129,
                                 tkill=130, tgkill=131, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438)),
}
_REFUSED = ("unshare", "setns", "memfd_create", "memfd_secret", "ptrace", "process_vm_readv", "process_vm_writev",
            "add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register", "fork",
            "vfork", "socketpair", "shmget", "shmat", "shmctl", "semget", "semop", "semctl", "semtimedop", "msgget",
            "msgsnd", "msgrcv", "msgctl", "mq_open", "userfaultfd", "pidfd_send_signal", "pidfd_getfd")
_CLONE_NEW_ANY = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_THREAD = 0x00010000
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_TYPE_MASK = 1, 0xF  # the type's low bits (SOCK_NONBLOCK and SOCK_CLOEXEC sit above them)
_IPPROTO_TCP, _NETLINK_ROUTE = 6, 0
_PR_SET_DUMPABLE, _PR_SET_PTRACER = 4, 0x59616D61  # prctl options refused (its others, thread names etc., are not)
# What a rank is told when it makes one of these calls (tests/harness.py adds it to an EPERM's message).
REFUSED_NOTE = ("the grader refuses this system call in a rank: ranks share nothing but their process group (no "
                "new process: fork, subprocess, os.system; no unix, UDP or raw socket, System V IPC, message "
                "queue, userfaultfd or memfd; no signal to another process); threads, files in the rank's folder "
                "and torch.distributed are fine")
_filter_installed = False


def _filter_program(audit_arch: int, nr: dict, pid: int) -> list[tuple]:
    """The BPF program: (code, jump if true, jump if false, k), jumps given as labels and resolved at the end.
    seccomp_data is {int nr; u32 arch; u64 ip; u64 args[6]}: args[i]'s low 32 bits at 16 + 8 i."""
    LD_W_ABS, JEQ, JSET, RET, ALU_AND = 0x20, 0x15, 0x45, 0x06, 0x54
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    arg0, arg1, arg2 = (LD_W_ABS, 0, 0, 16), (LD_W_ABS, 0, 0, 24), (LD_W_ABS, 0, 0, 32)
    own = [pid, 0, -pid & 0xFFFFFFFF]  # itself, its process group (0, or -pgid: a rank is its group's leader)
    code: list = [
        (LD_W_ABS, 0, 0, 4), (JEQ, 0, "deny", audit_arch),  # another ABI (i386 on x86_64): no
        (LD_W_ABS, 0, 0, 0), (JSET, "deny", 0, 0x40000000),  # x32 numbers: no
        (JEQ, "enosys", 0, nr["clone3"]),
        (JEQ, "clone", 0, nr["clone"]),
        (JEQ, "prctl", 0, nr["prctl"]),
        (JEQ, "socket", 0, nr["socket"]),
        (JEQ, "kill", 0, nr["kill"]),
        (JEQ, "self", 0, nr["tkill"]), (JEQ, "self", 0, nr["tgkill"]), (JEQ, "self", 0, nr["pidfd_open"]),
    ]
    code += [(JEQ, "deny", 0, nr[name]) for name in _REFUSED if name in nr]  # (aarch64 has no fork or vfork)
    code += [
        (RET, 0, 0, ALLOW),
        "clone", arg0, (JSET, "deny", 0, _CLONE_NEW_ANY), (JSET, "allow", "deny", _CLONE_THREAD),
        "prctl", arg0, (JEQ, "deny", 0, _PR_SET_DUMPABLE), (JEQ, "deny", "allow", _PR_SET_PTRACER),
        # Sockets: TCP over IPv4 or IPv6 (the process group's, counted at the sockets), and the routing netlink
        # socket the C library reads the machine's addresses through (getaddrinfo, getifaddrs; an unprivileged
        # process can send nothing to another socket on it). No UDP, raw or packet socket (bytes the sockets'
        # count of TCP would not see), no unix socket, no other family.
        "socket", arg0, (JEQ, "inet", 0, _AF_INET), (JEQ, "inet", 0, _AF_INET6),
        (JEQ, "netlink", "deny", _AF_NETLINK),
        "inet", arg1, (ALU_AND, 0, 0, _SOCK_TYPE_MASK), (JEQ, 0, "deny", _SOCK_STREAM),
        arg2, (JEQ, "allow", 0, 0), (JEQ, "allow", "deny", _IPPROTO_TCP),
        "netlink", arg2, (JEQ, "allow", "deny", _NETLINK_ROUTE),
        "kill", arg0, (JEQ, "allow", 0, own[1]), (JEQ, "allow", 0, own[2]), (JEQ, "allow", "deny", own[0]),
        "self", arg0, (JEQ, "allow", "deny", pid),
        "enosys", (RET, 0, 0, ENOSYS),
        "allow", (RET, 0, 0, ALLOW),
        "deny", (RET, 0, 0, EPERM),
    ]
    labels, at = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = at
        else:
            at += 1
    program = []
    for item in (i for i in code if not isinstance(i, str)):
        here = len(program) + 1  # jumps count from the next instruction, forward only
        op, jt, jf, k = item
        program.append((op, labels[jt] - here if isinstance(jt, str) else jt,
                        labels[jf] - here if isinstance(jf, str) else jf, k))
    return program


def refuse_hidden_memory() -> str:
    """Install a seccomp filter on every thread of this process (and so on everything it starts): the calls
    above fail with EPERM (clone3 with ENOSYS; prctl, clone, socket and the signals only as said above),
    everything else is allowed. Returns "" when installed, else why not (another architecture, a kernel or
    container without seccomp): then the memory count alone applies."""
    import ctypes
    import platform
    import struct
    global _filter_installed
    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        return f"memfd_create and unshare are not refused on {platform.machine()} (no system call table here)"
    program = _filter_program(*arch, os.getpid())
    raw = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(raw)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(program), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 38, 1, 1
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.syscall(ctypes.c_long(arch[1]["seccomp"]), SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC,
                         ctypes.byref(prog)) != 0:
        return f"memfd_create and unshare are not refused here: seccomp failed ({os.strerror(ctypes.get_errno())})"
    _filter_installed = True
    return ""


def explain_refusal(error: BaseException) -> str:
    """REFUSED_NOTE for an EPERM raised in a rank under the filter (PermissionError, or torch's and ctypes'
    "Operation not permitted"), else ""."""
    import errno
    if not _filter_installed:
        return ""
    if getattr(error, "errno", None) == errno.EPERM or "Operation not permitted" in str(error):
        return REFUSED_NOTE
    return ""


def kill_everything_of(uid: int) -> None:
    """SIGKILL every process of ``uid`` at once: kill(-1, SIGKILL) from a child that has become ``uid`` (the kernel
    signals all that user's processes while holding the task list, so no fork can slip between; see
    staff/autograder/cleanup.py, reap_user_processes). Root only."""
    import pwd
    gid = pwd.getpwuid(uid).pw_gid  # here: the child of a threaded process makes no library call that may lock
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)

def create_private(path: str) -> int:
    """A new file for this rank to write: never an existing one, never through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC,
                   0o600)


def redirect_output(path: str) -> None:
    fd = create_private(path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def watch_lifeline(lifeline) -> None:
    """Block until the pytest process is gone (EOF on the lifeline), then kill this rank's whole group."""
    while True:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            break
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(137)
