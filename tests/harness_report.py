"""Reading reports and explaining failures (tests/harness.py's room for steps 4-6): a rank's report read from its
pipe without blocking and loaded as data only, its end judged from the kernel's exit status, and the message of
a RankFailure: which rank caused it and how, its traceback, its stacks when it hung or stopped, its output's tail.
The rank's files are read back without following links, only when they are regular files, and only their tail.
"""

from __future__ import annotations

import io
import os
import signal
import stat
import sys
import time
from typing import TYPE_CHECKING

import torch

from tests.rank_isolation import limits_note

if TYPE_CHECKING:  # annotations only (harness_start imports the rooms that name _Rank)
    from tests.harness_start import _Rank

OUTPUT_TAIL_CHARS = 2000  # how much of a failing rank's stdout/stderr goes into the failure message
SHOWN_OUTPUT_CHARS = 100_000  # how much of each rank's output every run prints, labelled (show_output)
STACK_DUMP_WAIT_S = 0.5  # after SIGUSR1, how long to wait for the stack dumps
STACK_TAIL_CHARS = 20_000  # how much of a hung rank's stack dump goes into the message
MAX_MESSAGE_BYTES = 64 << 20  # the largest report a rank may send (the biggest a test returns is under 1 MiB);
# the parent reads it without blocking, in pieces, and refuses a longer one as soon as its length arrives
_LENGTH_BYTES = 8  # each report: its length (8 bytes, big-endian), then a torch.save payload
_RANK_FILE = "harness_rank.py"  # where _run_body is: a stack is cut below it (_tidy_stacks)


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
            if not r.kernel.returned and r.buffer[:_LENGTH_BYTES] == bytes(_LENGTH_BYTES):
                # The empty frames the rank sends just before its body and just after it returns (two, at most):
                # its memory baseline, then the reading of its sockets before its closing barrier closes them.
                if not r.kernel.started:
                    r.kernel.body_started()
                else:
                    r.kernel.body_returned()
                try:  # the rank waits for this byte before it goes on (see _run_body)
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
            note = limits_note(_read_tail(r.out_path, 100_000))  # gloo could not start a thread: the grader's limits
            text += f"; {note}" if note else ""
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
            if f'{_RANK_FILE}", line' in line and line.rstrip().endswith("in _run_body"):
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


def show_output(ranks: list[_Rank], out=None) -> None:
    """Print what each rank wrote to its stdout and stderr (a student's prints, C++ warnings), each line labelled
    ``[rank r]``, in rank order, after every run, passing or failing. The pytest process's stdout is pytest's to
    capture: ``pytest -s`` shows it as each run ends, ``-rP`` shows it for passing tests, and a failing test
    shows it under "Captured stdout call" (its message keeps the failing rank's tail too). The label is put on
    every line and control characters are shown escaped, so a rank's output cannot pass for pytest's own lines.
    Read like every rank file: only a regular file, never through a link, at most the last
    SHOWN_OUTPUT_CHARS characters a rank."""
    out = out if out is not None else sys.stdout
    for r in ranks:
        size = _regular_file_size(r.out_path)
        if not size:
            continue
        text = _read_tail(r.out_path, SHOWN_OUTPUT_CHARS)
        lines = text.split("\n")  # on newlines only: a carriage return is shown, never obeyed
        if lines[-1] == "":
            lines.pop()
        not_shown = size - len(text.encode("utf-8", errors="replace"))
        if not_shown > 0:
            lines.insert(0, f"(its first {not_shown} bytes are not shown)")
        out.write("".join(f"[rank {r.rank}] {_printable(line)}\n" for line in lines))
    out.flush()


def _printable(line: str) -> str:
    """The line with every control character (an escape sequence, a carriage return) shown as its escape."""
    return "".join(c if c == "\t" or (c >= " " and c != "\x7f") else repr(c)[1:-1] for c in line)


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

