"""The processes a zoo case started: every process that carries the case's tag in its environment (grade.py passes
FSDP_ZOO_* through to pytest and so to every rank), found and killed by the tag alone. Both the zoo (zoo.py) and
its hanging cases (zoo_hangs.py) use it; neither imports the other for it."""

from __future__ import annotations

import os
import signal

TAG_VAR = "FSDP_ZOO_TAG"        # grade.py passes FSDP_ZOO_* through to pytest and so to every rank


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds TAG_VAR=tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
        except OSError:
            continue
    return found


def kill_tagged(tag: str) -> None:
    for pid, _ in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
