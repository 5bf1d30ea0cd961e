"""Rank bodies as an unprivileged user (FSDP_RANK_USER, tests/harness.py), and the reaping of that user's leftover
processes (staff/autograder/cleanup.py). When the grader runs as root, each
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

from tests.harness import RankFailure, run_ranks

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
    from cleanup import processes_of, reap_user_processes
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


_FORK_STORM = """
import os, sys, time
beat = sys.argv[1]
if os.fork():
    os._exit(0)
while True:  # a new process every 2 ms, each parent gone at once: no pid lives long enough to be listed and killed
    try:
        if os.fork():
            os._exit(0)
    except OSError:  # out of processes for the moment (zombies count until reaped): try again
        pass
    with open(beat, "w") as f:  # the heartbeat: the pid of the current generation
        f.write(str(os.getpid()))
    time.sleep(0.002)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_a_fork_and_exit_storm_of_the_rank_user_is_reaped():
    """The final reap: kill(-1, SIGKILL) sent as the rank user, which no fork can outrun (see
    cleanup.reap_user_processes). A listing of the user's processes cannot even see such a storm
    reliably, so the storm writes a heartbeat file: after the reap it must stop changing."""
    import pwd
    import subprocess
    import sys
    import time
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from cleanup import kill_everything_of, processes_of, reap_user_processes
    entry = pwd.getpwnam("nobody")
    if processes_of(entry.pw_uid):
        pytest.skip("processes of 'nobody' already run on this machine; not killing them")
    import shutil
    import tempfile
    where = Path(tempfile.mkdtemp(prefix="fsdp-storm-"))  # (pytest's tmp_path is behind a 0700 folder)
    os.chmod(where, 0o777)
    beat = where / "beat"
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    starter = subprocess.Popen([python, "-c", _FORK_STORM, str(beat)], user=entry.pw_uid, group=entry.pw_gid,
                               extra_groups=[], start_new_session=True, cwd="/", stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})  # no PYTHON* of ours
    starter.wait(timeout=30)

    def heartbeat() -> str:
        try:
            return beat.read_text()
        except OSError:
            return ""
    try:
        deadline = time.monotonic() + 20
        first = ""
        while time.monotonic() < deadline and not first:
            first = heartbeat()
            time.sleep(0.05)
        time.sleep(0.2)
        assert first and heartbeat() != first, "the storm did not start (can 'nobody' run Python here?)"
        reap_user_processes(entry.pw_uid)  # (how many it saw depends on timing: a storm hides from listings)
        time.sleep(0.1)
        last = heartbeat()
        time.sleep(0.5)
        assert heartbeat() == last, "the storm outlived the reap"
        assert processes_of(entry.pw_uid) == []
    finally:
        for _ in range(3):
            kill_everything_of(entry.pw_uid)
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_the_rank_users_files_in_shared_temporary_folders_are_removed():
    import pwd
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from cleanup import remove_user_files
    entry = pwd.getpwnam("nobody")
    place = Path(tempfile.mkdtemp(prefix="fsdp-shared-"))  # a stand-in for /tmp (pytest's tmp_path is 0700)
    os.chmod(place, 0o1777)
    try:
        _leave_files_and_remove_them(entry, place, remove_user_files)
    finally:
        shutil.rmtree(place, ignore_errors=True)


def _leave_files_and_remove_them(entry, place, remove_user_files):
    import subprocess
    import sys
    ours = place / "graders-file"
    ours.write_text("root's")
    script = (f"import os; os.makedirs({str(place / 'leak')!r}); "
              f"open({str(place / 'leak' / 'hidden-constants.txt')!r}, 'w').write('x' * 1000); "
              f"open({str(place / 'top.txt')!r}, 'w').write('y'); "
              f"os.symlink({str(ours)!r}, {str(place / 'link')!r})")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    subprocess.run([python, "-c", script], user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], check=True,
                   cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert remove_user_files(entry.pw_uid, (str(place),)) == 3
    assert sorted(p.name for p in place.iterdir()) == ["graders-file"] and ours.read_text() == "root's"


def _tries_to_swap_its_output(rank, world_size, secret):
    out = os.readlink("/proc/self/fd/1")
    try:
        os.unlink(out)
        os.symlink(secret, out)
        swapped = True
    except OSError:
        swapped = False
    print(f"swapped={swapped}")
    raise RuntimeError(f"rank {rank} swapped={swapped}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the grader's situation on Gradescope)")
def test_the_rank_user_cannot_swap_the_files_the_grader_reads_back(monkeypatch, tmp_path):
    secret = tmp_path / "hidden.py"
    secret.write_text("HIDDEN = 'never in a visible message'\n")
    monkeypatch.setenv("FSDP_RANK_USER", "nobody")
    with pytest.raises(RankFailure) as info:
        run_ranks(_tries_to_swap_its_output, 1, str(secret))
    message = str(info.value)
    assert "rank 0 of 1 raised RuntimeError: rank 0 swapped=False" in message, message
    assert "never in a visible message" not in message


@pytest.mark.slow  # walks the whole file system (seconds)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_every_world_writable_place_on_the_image_is_cleaned():
    """Issue 18: every directory on the image where the rank user may write is found by the plugin's shallow
    walk (none lies deeper), and what the rank user leaves in each is removed."""
    import pwd
    import subprocess
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from cleanup import remove_user_files, world_writable_places
    shallow = world_writable_places()
    everywhere = world_writable_places(depth=None)
    missed = [p for p in everywhere if not any(p == s or p.startswith(s.rstrip("/") + "/") for s in shallow)]
    assert not missed, f"world-writable directories deeper than the plugin looks: {missed}"
    entry = pwd.getpwnam("nobody")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    for place in shallow:
        name = os.path.join(place, f"fsdp-leftover-{os.getpid()}")
        made = subprocess.run([python, "-c", f"open({name!r}, 'w').write('x')"], user=entry.pw_uid,
                              group=entry.pw_gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"})
        if made.returncode != 0:
            continue  # o+w, but not for this user (an ACL, a read-only mount)
        remove_user_files(entry.pw_uid, tuple(shallow))
        assert not os.path.lexists(name), f"{name} (left by the rank user) was not removed"


_MAKE_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
ids = [libc.shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0o600), libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600),
       libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)]
assert min(ids) >= 0, ids
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_the_rank_users_sysv_ipc_objects_are_removed():
    import pwd
    import subprocess
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from cleanup import remove_user_ipc

    def owned(uid: int) -> int:
        count = 0
        for kind in ("shm", "sem", "msg"):
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
            count += sum(int(r[header.index("uid")]) == uid for r in rows)
        return count
    entry = pwd.getpwnam("nobody")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    made = subprocess.run([python, "-c", _MAKE_SHM], user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
                          cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"System V IPC is not available here: {made.stderr[-300:]}")
    assert owned(entry.pw_uid) >= 3
    assert remove_user_ipc(entry.pw_uid) >= 3
    assert owned(entry.pw_uid) == 0


_HOG = """
import os, sys, time
kind = sys.argv[1]
if kind == "children":  # several processes, each under any per-process limit
    for _ in range(3):
        if os.fork() == 0:
            block = bytearray(80 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(60)
            os._exit(0)
else:  # files on tmpfs, mapped by nobody
    with open(sys.argv[2], "wb") as f:
        for _ in range(24):
            f.write(b"x" * (10 << 20))
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.parametrize("kind", ["children", "tmpfs"])
def test_the_rank_users_memory_is_bounded_all_together(kind):
    """Issue 18: the grading process counts all of the rank user's memory (processes' Pss, tmpfs files, SysV
    shared memory) and kills every process of the user past the limit."""
    import pwd
    import subprocess
    import sys
    import time
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "staff" / "autograder"))
    from cleanup import kill_everything_of, processes_of, remove_user_files
    from student_limits import MemoryWatch, tmpfs_mounts
    entry = pwd.getpwnam("nobody")
    if processes_of(entry.pw_uid):
        pytest.skip("processes of 'nobody' already run on this machine; not killing them")
    if kind == "tmpfs" and "/dev/shm" not in tmpfs_mounts():
        pytest.skip("/dev/shm is not a tmpfs here")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    watch = MemoryWatch(entry.pw_uid, 150 << 20, ["/dev/shm"], kill_everything_of)
    watch.start()
    hog = subprocess.Popen([python, "-c", _HOG, kind, f"/dev/shm/fsdp-hog-{os.getpid()}"], user=entry.pw_uid,
                           group=entry.pw_gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while hog.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        note = watch.stop()
        assert hog.returncode == -9, "the user's processes were not killed at the limit"
        assert note and "were all killed" in note, note
        assert processes_of(entry.pw_uid) == []
    finally:
        watch.stop()
        kill_everything_of(entry.pw_uid)
        remove_user_files(entry.pw_uid, ("/dev/shm",))
