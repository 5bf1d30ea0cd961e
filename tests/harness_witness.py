"""The witness (tests/harness.py's room for step 7): memory and bytes as the kernel counts them for each rank,
read by the parent from /proc while the ranks run (``_KernelSamples``), and the test's bounds on them (``Witness``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tests.harness_report import RankFailure, _regular_file_size
from tests.harness_sockets import RankSockets, SocketTable
from tests.rank_cgroup import ProcShmem, RankCgroup, private_bytes, rank_processes

if TYPE_CHECKING:  # annotations only (harness_start imports the rooms that name _Rank)
    from tests.harness_start import _Rank

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
PROCESSES_EVERY_S = 0.050  # how often the parent lists a rank's processes and their descriptors
# What gloo's own connections may hold in their socket buffers while a collective runs, not counted as memory the
# rank holds (measured: see Witness); what a rank's sockets hold beyond it is.
WITNESS_SOCKET_BUFFER_BYTES = 16 << 20


class Witness:
    """A test's bounds on what each rank does, checked in the parent against the kernel's own counts.

        w = Witness(peak_bytes=..., sent_bytes=...)
        results = run_ranks(body, 2, witness=w)       # raises RankFailure (kind "witness") when a bound is broken
        w.measured[rank]["peak_bytes"], w.measured[rank]["sent_bytes"]

    peak_bytes: how far each rank's resident memory may rise above its level when the body starts. The parent
    reads VmHWM and VmRSS in /proc/<pid>/status every WITNESS_SAMPLE_S while the rank runs, and once more after
    its report. A peak that falls between two readings (``echo 5 > /proc/self/clear_refs`` resets it) fails the
    run; so does a peak above the rank's first reading + WITNESS_START_ALLOWANCE_BYTES + peak_bytes (a
    backstop: the rank waits before its body until the parent has read its level). Witnessed ranks have glibc
    unmap every freed block of 1 MiB or more (_malloc_returns_big_blocks), so resident memory follows the tensors
    alive, and run a warm-up before the baseline (harness_rank._warm_up: autograd, a transformer step's kernels,
    one collective of each kind), so a body's first step does not pay torch's one-time costs inside its bound.
    The noise a bound must beat, measured with the warm-up (W=2, gloo, load 7-10 on 2 cores): an empty body peaks
    0.69 MiB above its baseline (16 rank-runs, spread < 0.01 MiB); a 2-layer GPT (n_embd 64) step sharded by
    FSDP, whose parameters are 0.1 MiB, 3.7-4.4 MiB (16 rank-runs; 27.0-27.6 MiB without the warm-up); the
    witnessed Task 7 step (GPT 8x512, one block 12.6 MiB) 153.2-154.0 MiB (6 rank-runs; 175.9-176.4 without).
    So a fixed floor of about 4 MiB for the first FSDP step of any model, and run-to-run noise under 1 MiB: a
    unit of 4 MiB or more stands out of it; bounds should leave the floor plus a few MiB.
    Beyond its page tables, a rank's peak also counts, at each reading, what it holds where VmRSS does not show:
    shared and tmpfs pages it does not map (its memory cgroup, else /proc: files it holds open or mapped, files it
    left in /dev/shm, SysV segments it made; tests/rank_cgroup.py), its forked children's own pages, and its
    sockets' buffers (TCP, and unix ones without a cgroup) beyond WITNESS_SOCKET_BUFFER_BYTES (gloo's own hold up
    to 4.2 MiB a peer in a 16 MiB all-gather, 3.8-6.9 MiB at a reading of the witnessed Task 7 step).
    What watching costs (the witnessed Task 7 body, W=2, 3 runs each, load 11-13): 4.0-5.0 s a run without a
    witness, 6.0-7.5 s with one; the parent's sampling is 0.70-0.84 s of CPU of that, the rest is the ranks'
    (glibc unmapping every freed block of 1 MiB or more, the warm-up, the waits for the parent's readings).
    sent_bytes: how many bytes each rank may send to its peers, counted at its sockets from the start of its body
    to its closing barrier (harness_sockets: TCP's own counters, through sock_diag; what the kernel says the rank
    wrote to each socket), plus WITNESS_SETUP_SENT_BYTES. Measured (W=2, gloo, N = 4 Mi fp32 elements): an
    all-gather must move N*4 = 16,777,216 bytes out of each rank, and the sockets counted 16,777,504-16,777,600;
    a reduce-scatter (as it moves data: all_to_all) 8,388,608, counted 8,388,752 (gloo's own reduce_scatter
    all-reduces: 16,779,520, as an all-reduce does); an empty body 0. So the overhead is gloo's headers, about
    150-400 bytes a collective; setting up the group, the barriers and the report fall outside the count. A socket
    the body opens and closes between two listings of its sockets (50 ms) is not seen. ``wchar`` in
    /proc/<pid>/io (every write() of the rank, less its report and output: 3.5-4.2 KiB more than the sockets in
    the runs above) is the second opinion: over the bound while the sockets are not is itself a failure, and it
    is the only count where the kernel refuses sock_diag (the failure then says so).
    deferred: check only when the test calls ``check()``, after its own asserts on what the ranks reported, and
    whether they passed or not (``check(reported=...)`` then adds their failure to the message): the kernel is
    asked in every run, and a failure it finds is a "witness" failure of this test, and of no other.
    """

    def __init__(self, *, peak_bytes: int | None = None, sent_bytes: int | None = None, deferred: bool = False,
                 marks: int | None = None, held_bytes: dict | None = None, rise_bytes: dict | None = None):
        self.peak_bytes, self.sent_bytes, self.deferred = peak_bytes, sent_bytes, deferred
        self.marks = marks
        self.held_bytes = dict(held_bytes or {})
        self.rise_bytes = dict(rise_bytes or {})
        if (self.held_bytes or self.rise_bytes) and marks is None:
            marks = self.marks = 0
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
                        f"than the rank held just after it started ({_mib(m['first_bytes'])}) + what setting up may "
                        f"take ({_mib(WITNESS_START_ALLOWANCE_BYTES)}) + this test's bound ({_mib(self.peak_bytes)})")
            if self.sent_bytes is not None:
                problems += _sent_problems(where, m, self.sent_bytes)
            if self.marks is not None:
                problems += _reading_problems(where, m, self.marks, self.held_bytes, self.rise_bytes)
        if problems:
            raise RankFailure(
                "the kernel's witness disagrees with this run: " + "; ".join(problems) + ". The kernel's counts "
                "decide: whatever the rank's own counters, monitor or memory tracker reported, they cannot overrule "
                "them." + (f"\n\nWhat the ranks reported failed the test's checks too:\n{reported}" if reported else "")
                + (f"\n\nThe run failed as well:\n{run_failure}" if run_failure else ""),
                kind="witness", rank=int(problems[0].split(":")[0].split()[1]))


def _reading_problems(where: str, m: dict, marks: int, held: dict, rise: dict) -> list[str]:
    """The readings at the body's marks (harness_rank.witness_mark) and at its return against the test's bounds:
    ``held[k]``, what the rank may hold at reading k above its level when the body started (k = 1..marks, or
    "return"); ``rise[k]``, how far its memory may rise above what it held at reading k (0: the body's start)
    until the body returns."""
    readings = m.get("readings") or []
    if "each" in held:  # every mark (not the return) under one bound
        held = {**{i: held["each"] for i in range(1, len(readings))}, **held}
        del held["each"]
    if len(readings) != marks + 1:
        return [f"{where}: it asked the parent for {len(readings)} readings of its memory after its body started; "
                f"this test's body marks {marks} moments and then returns ({marks + 1}): a mark (witness_mark) called "
                f"from somewhere else, or one skipped"]
    problems = []
    for k, bound in sorted(held.items(), key=str):
        i = marks + 1 if k == "return" else int(k)
        got = readings[i - 1]["held_bytes"]
        if got > bound:
            when = "when its body returned" if i == marks + 1 else f"at the body's mark {i}"
            problems.append(f"{where}: the kernel saw it hold {_mib(got)} above its level when the body started "
                            f"{when}, more than this test's bound there of {_mib(bound)}: memory the property frees "
                            f"by then (full parameters, gradients) was still held")
    for k, bound in sorted(rise.items(), key=str):
        i = int(k)
        base = readings[i - 1]["held_bytes"] if i else 0
        got = max(r["peak_bytes"] for r in readings[i:]) - base
        if got > bound:
            problems.append(f"{where}: the kernel saw its memory rise {_mib(got)} above what it held "
                            f"{f'at the body mark {i}' if i else 'when the body started'} before the body returned, "
                            f"more than this test's bound of {_mib(bound)}")
    return problems


def _sent_problems(where: str, m: dict, bound: int) -> list[str]:
    """The bytes a rank sent against the test's bound: counted at its sockets (sock_diag) where the kernel lets
    the parent ask, with wchar as a second opinion (over the bound while the sockets are not: bytes left through a
    channel the sockets did not show, or the rank wrote files); with wchar alone where it does not."""
    allowed = bound + WITNESS_SETUP_SENT_BYTES
    hint = ("it communicated more than the collectives FSDP needs (an all-reduce where a reduce-scatter does, or a "
            "unit gathered twice?)")
    if m["socket_sent_bytes"] is not None and m["socket_sent_bytes"] > allowed:
        return [f"{where}: the kernel counted {m['socket_sent_bytes']} bytes written to the rank's sockets (TCP's own "
                f"counters, read through sock_diag, from its body's start to its closing barrier), more than this "
                f"test's bound of {bound} (+{WITNESS_SETUP_SENT_BYTES} allowed): {hint}"]
    if m["wchar_sent_bytes"] > allowed:
        if m["socket_sent_bytes"] is None:
            how = ("its sockets could not be read here (sock_diag refused), so this is 'wchar' in /proc/<pid>/io: "
                   "every write() of the rank, its sockets to the other ranks among them, less its report and output")
        else:
            how = (f"'wchar' in /proc/<pid>/io, the second opinion: every write() of the rank less its report and "
                   f"output, while its sockets showed {m['socket_sent_bytes']}: bytes left through a channel the "
                   f"socket count did not see (a socket closed between two readings?), or the rank wrote files")
        return [f"{where}: the kernel counted {m['wchar_sent_bytes']} bytes written by the rank ({how}), more than "
                f"this test's bound of {bound} (+{WITNESS_SETUP_SENT_BYTES} for joining the group): {hint}"]
    return []


_CGROUP_WORDS = (", with what it holds beyond its page tables: shared, tmpfs and SysV pages it does not map, its "
                 "forked children's own memory, and its sockets' buffers")


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
    """What the parent read about one rank from /proc and sock_diag while it ran (see Witness)."""

    def __init__(self, pid: int, cgroup: "RankCgroup | ProcShmem | None" = None, sockets: SocketTable | None = None):
        self.pid = pid
        self.cgroup = cgroup  # its own memory cgroup where one could be made, else /proc (tests/rank_cgroup.py)
        self.sockets = RankSockets(sockets) if sockets is not None else None  # its sockets' counters
        self.pids = [pid]  # the rank and the processes it started, listed every PROCESSES_EVERY_S
        self.listed_at = -1.0
        self.listings = 0
        self.children_bytes = 0  # what its forked children hold of their own at the last listing
        self.buffers_peak = 0  # the most its sockets' buffers held at one reading
        self.held_peak = 0  # the most it held at one reading beyond what VmHWM counts (see sample)
        self.idle = _forkserver_rss()  # an upper bound of what it holds when it is forked
        self.first_rss = None  # what it held at the parent's first reading, soon after the fork
        self.started = False
        # harness_report reads a rank's empty frames as readings it asks for while this is False; it stays False:
        # after the body's start every empty frame is a reading (body_returned), the marks, then the return.
        self.returned = False
        self.readings: list[dict] = []  # at each mark of the body, then at its return (body_returned)
        self.segment_peak = 0  # the highest rise above start_rss read since the last reading (or the start)
        self.held_now = 0  # what it held above start_rss at the last sample: resident + beyond its page tables
        self.start_rss = 0
        self.start_wchar = 0
        self.peak_hwm = 0  # highest VmHWM (or VmRSS) read
        self.last_hwm = 0
        self.hwm_fell = ""  # a reading where the peak fell: a reset
        self.wchar = None  # the last reading
        self.final = False  # read after the complete report, before the rank was let go
        self.received = 0  # bytes the parent read from the rank's report pipe (they count in wchar)
        self.samples = 0
        self.unreadable = ""

    def sample(self, final: bool = False, sockets_now: bool = False) -> None:
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
        self.wchar = wchar
        self.final = self.final or final
        if not self.started:
            return
        now = time.monotonic()
        relist = sockets_now or final or now - self.listed_at >= PROCESSES_EVERY_S
        if relist:
            # Its forked children (and theirs), whose memory no page table of the rank shows: what each holds of
            # its own (pages it shares with the rank since the fork are the rank's, counted in its VmHWM).
            self.pids = rank_processes(self.pid, whole_session=self.listings % 20 == 19)  # the walk: every 1 s
            self.children_bytes = sum(private_bytes(child) for child in self.pids[1:])
            self.listed_at, self.listings = now, self.listings + 1
        if self.sockets is not None:
            self.sockets.sample(self.pids, relist=relist, force=sockets_now or final)
        rss_shmem = st.get("RssShmem", 0)
        if isinstance(self.cgroup, ProcShmem):
            hidden = self.cgroup.hidden(rss_shmem, self.pids)
        else:
            hidden = self.cgroup.hidden(rss_shmem) if self.cgroup is not None else None
        # What it holds now beyond its page tables: shared and tmpfs pages it does not map (its cgroup, or /proc),
        # its children's own memory, and its sockets' buffers beyond what gloo's own may hold in a collective
        # (unix sockets' are in a cgroup's kernel memory already).
        buffers = 0
        if self.sockets is not None:
            unix = 0 if isinstance(self.cgroup, RankCgroup) else self.sockets.unix_buffers
            buffers = self.sockets.tcp_buffers + unix
        extra = (hidden or 0) + self.children_bytes + max(0, buffers - WITNESS_SOCKET_BUFFER_BYTES)
        if hidden is not None or extra:
            self.held_peak = max(self.held_peak, st["VmRSS"] - self.start_rss + extra)
        self.held_now = st["VmRSS"] - self.start_rss + extra
        self.segment_peak = max(self.segment_peak, hwm - self.start_rss, self.held_now)
        self.buffers_peak = max(self.buffers_peak, buffers)

    def body_started(self) -> None:
        self.sample()
        if self.cgroup is not None:
            self.cgroup.start()
        if self.sockets is not None:
            self.sockets.start(self.pids)
        self.started = True
        self.start_rss = _read_status(self.pid).get("VmRSS", 0)
        self.start_wchar = _read_wchar(self.pid) or 0

    def body_returned(self) -> None:
        """A reading the rank asked for after its body started: at each mark of its body (harness_rank.witness_mark),
        then when the body returned (its sockets read now, before its closing barrier closes gloo's). They look
        alike when they come: the last one is the return (the Witness knows how many marks its body makes).
        Recorded: what the rank holds now above its start, and its peak since the last reading; then its peak is
        reset (VmHWM through /proc/<pid>/clear_refs, the cgroup's kernel memory peak), so the next reading's peak
        is that of the next part of the body. The rank waits for the parent's byte meanwhile: nothing it does
        falls between the sample and the reset. The whole run's peak is the highest of all readings."""
        self.sample(sockets_now=True)
        self.readings.append({"held_bytes": self.held_now, "peak_bytes": self.segment_peak})
        self.segment_peak = self.held_now
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS now
            self.last_hwm = _read_status(self.pid).get("VmHWM", self.last_hwm)  # not a reset of the rank's own
        except OSError:
            pass  # the segment's peak is then the run's peak so far: a bound on it only looser
        if isinstance(self.cgroup, RankCgroup) and self.cgroup.started:
            self.cgroup.reset_peak()

    def figures(self, r: _Rank, run_failed: bool = False) -> dict:
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
        elif self.sockets is not None and not self.readings and not run_failed:
            error = ("the parent never had its sockets read before its closing barrier (the harness's 'body "
                     "returned' frame did not arrive)")
        out_size = min(_regular_file_size(r.out_path) or 0, WITNESS_OUTPUT_BYTES)
        wchar_sent = (self.wchar or 0) - self.received - out_size
        socket_sent = self.sockets.sent_bytes() if self.sockets is not None else None
        # Resident memory's rise, or its rise with what it holds beyond its page tables at one reading, if more.
        peak = max(self.peak_hwm - self.start_rss, self.held_peak)
        return {"rank": r.rank, "error": error, "peak_bytes": peak, "held_bytes": self.held_peak,
                "beyond_page_tables": self.cgroup is not None and self.cgroup.started,
                "peak_abs_bytes": self.peak_hwm, "start_bytes": self.start_rss, "idle_bytes": self.idle,
                "first_bytes": self.first_rss or self.idle,
                "sent_bytes": socket_sent if socket_sent is not None else wchar_sent,
                "socket_sent_bytes": socket_sent, "wchar_sent_bytes": wchar_sent,
                "wchar_body_bytes": (self.wchar or 0) - self.start_wchar,
                "received_bytes": self.sockets.received_bytes() if self.sockets is not None else None,
                "children_bytes": self.children_bytes, "readings": list(self.readings),
                "socket_buffer_peak_bytes": self.buffers_peak, "samples": self.samples}
