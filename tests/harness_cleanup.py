"""Cleanup (tests/harness.py's room for the end of every run): nothing outlives a run. Every rank's whole session
is SIGKILLed and reaped, and the run's folder is removed however deep the body made it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only (harness_start imports the rooms that name _Rank)
    from tests.harness_start import _Rank


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

