"""Rank bodies as an unprivileged user (FSDP_RANK_USER, tests/harness.py), and the reaping of that user's leftover
processes (staff/autograder/grading_plugin.py). When the grader runs as root, each
rank drops to that user right before the body runs. The body then cannot write the grader's files or signal the
grading processes, while collectives and the result's way back still work.

Runs as root only (it uses the system's ``nobody``). On machines where that user cannot read the Python
installation (here: /root/.pyenv behind a 0700 /root) a rank can no longer import new modules after the drop,
so this module imports up front what the body and the harness's send path need; on Gradescope the virtualenv in
/autograder/venv is world-readable and nothing of the kind is needed.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.utils.serialization  # noqa: F401  (torch.save imports it lazily)

from tests.harness import run_ranks

pytestmark = pytest.mark.staff


def _probe(rank, world_size, forbidden_path):
    out = {"uid": os.getuid(), "euid": os.geteuid()}
    try:
        with open(forbidden_path, "w") as f:
            f.write("forged")
        out["wrote"] = True
    except OSError:
        out["wrote"] = False
    try:
        os.kill(os.getppid(), 0)  # the forkserver, root's
        out["signalled"] = True
    except OSError:
        out["signalled"] = False
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out["sum"] = t
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the grader's situation on Gradescope)")
def test_bodies_run_as_the_rank_user(monkeypatch):
    import pwd
    nobody = pwd.getpwnam("nobody").pw_uid
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        forbidden = os.path.join(d, "results.json")
        monkeypatch.setenv("FSDP_RANK_USER", "nobody")
        results = run_ranks(_probe, 2, forbidden)
        assert not os.path.exists(forbidden)
    for rank, got in enumerate(results):
        assert (got["uid"], got["euid"]) == (nobody, nobody), f"rank {rank} ran its body as {got['uid']}"
        assert not got["wrote"], f"rank {rank} could write into a directory of the grader's"
        assert not got["signalled"], f"rank {rank} could signal a process of the grader's"
        assert torch.equal(got["sum"], torch.ones(2)), "collectives must still work after the drop"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_leftover_processes_of_the_rank_user_are_reaped():
    """What the grading plugin does after each test when ranks run as the rank user: every live process of that
    user dies, even one that left its session (a rank's process group kill would miss it)."""
    import pwd
    import subprocess
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from grading_plugin import processes_of, reap_user_processes
    uid = pwd.getpwnam("nobody").pw_uid
    if processes_of(uid):
        pytest.skip("processes of 'nobody' already run on this machine; not killing them")
    child = subprocess.Popen(["sleep", "600"], user=uid, group=pwd.getpwnam("nobody").pw_gid, extra_groups=[],
                             start_new_session=True)
    try:
        assert processes_of(uid) == [child.pid]
        assert reap_user_processes(uid) == 1
        assert child.wait(timeout=10) == -9
        assert processes_of(uid) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
