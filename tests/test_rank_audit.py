"""The runtime audit (tests/rank_audit.py; issue 36 item 2): what submission code does in a rank is reported with its
file and line, however it is spelled; honest code (the idioms of the standard library that use frames or exec on
their caller's behalf, collectives) is reported for nothing; a rank that silences its channel is reported; the audit
never fails a test. (tests/staff/test_rank_audit_honest.py runs the staff's implementations with the audit on.)

A "submission" here is code compiled under the name of a graded task file (fsdp_assignment/task9_audit_probe.py in
this tree, a file that does not exist): the audit knows submission code by its frames' file names.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import ctypes
import dataclasses
import enum
import gc
import inspect
import json
import logging
import marshal
import mmap
import os
import pickle
import pkgutil
import socket
import sys
import threading
import typing
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

from tests import rank_audit
from tests.harness import run_ranks

PROBE_FILE = os.path.join(rank_audit._TREE, "fsdp_assignment", "task9_audit_probe.py")

# One reach per line; REACHES maps each function to the (event, line within the function) it must be reported for.
_REACHES = '''
def frame():
    return sys._getframe(1).f_locals
def frame_by_name():
    return getattr(sys, "_get" + "frame")(0)
def frame_through_inspect():
    return inspect.currentframe()
def frame_through_a_traceback():
    try:
        raise ValueError
    except ValueError as e:
        return getattr(e.__traceback__, "tb_" + "frame")
def every_object():
    return len(gc.get_objects())
def referrers():
    return len(gc.get_referrers(torch.nn.Module))
def native():
    return ctypes.CDLL(None).getpid()
def native_by_name():
    return pkgutil.resolve_name("ctypes:CDLL")(None)
def unmarshal():
    return marshal.loads(marshal.dumps(1))
def unpickle():
    return pickle.loads(pickle.dumps(collections.OrderedDict))
def evaluate():
    return eval("1 + 1")
def outside_import():
    return __import__("xdrlib" if sys.version_info < (3, 13) else "wave")
def proc():
    return open("/proc/self/status").read(10)
def outside_file():
    return open("/etc/passwd").read(10)
def proc_listing():
    return len(os.listdir("/" + "proc"))
def a_socket():
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
def signal():
    os.kill(os.getpid(), 0)
def trace():
    sys.settrace(None)
def profile():
    sys.setprofile(None)
def another_hook():
    sys.addaudithook(lambda event, args: None)
def new_code():
    def f():
        return 1
    f.__code__ = (lambda: 2).__code__
def disguise():
    m = torch.nn.Linear(1, 1)
    m.__class__ = torch.nn.ReLU
def environment():
    os.environ["FSDP_AUDIT_PROBE"] = "1"
def shared_memory():
    mmap.mmap(-1, 4096).close()
'''
REACHES = {  # function: (event, its line within the function: 1 is the def line)
    "frame": ("sys._getframe", 2), "frame_by_name": ("sys._getframe", 2), "frame_through_inspect": ("sys._getframe", 2),
    "frame_through_a_traceback": ("object.__getattr__", 5), "every_object": ("gc.get_objects", 2),
    "referrers": ("gc.get_referrers", 2), "native": ("ctypes.dlopen", 2), "native_by_name": ("ctypes.dlopen", 2),
    "unmarshal": ("marshal.loads", 2), "unpickle": ("pickle.find_class", 2), "evaluate": ("compile", 2),
    "outside_import": ("import", 2), "proc": ("open", 2), "outside_file": ("open", 2),
    "proc_listing": ("os.listdir", 2),
    "a_socket": ("socket.__new__", 2), "signal": ("os.kill", 2), "trace": ("sys.settrace", 2),
    "profile": ("sys.setprofile", 2), "another_hook": ("sys.addaudithook", 2), "new_code": ("object.__setattr__", 4),
    "disguise": ("object.__setattr__", 3), "environment": ("os.putenv", 2), "shared_memory": ("mmap.__new__", 2),
}

# What honest code does that raises events on the submission's behalf: none of it is reported.
_HONEST = '''
def honest(path_in_tmp):
    @dataclasses.dataclass
    class Spec:
        n: int = 1
    Pair = collections.namedtuple("Pair", "a b")
    Named = typing.NamedTuple("Named", [("a", int)])
    Kind = enum.Enum("Kind", "a b")
    logging.getLogger("fsdp-audit-probe").info("quiet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.warn("a warning")
    with open(path_in_tmp, "w") as f:
        f.write("rank-local")
    with open(__file__ if os.path.exists(__file__) else os.path.abspath("adapters.py")) as f:
        f.read(10)
    m = torch.nn.Linear(4, 4)
    m.__class__ = type("FSDPLinear", (torch.nn.Linear,), {})
    gc.collect()
    t = torch.ones(4)
    dist.all_reduce(t)
    import math, functools, itertools
    return Spec().n + Pair(1, 2).a + Named(1).a + Kind.a.value + int(t[0].item())
def honest_callbacks():
    m = torch.nn.Linear(2, 2)
    seen = []
    m.weight.register_hook(lambda g: seen.append(1) or g)  # autograd runs it
    weakref.finalize(m, seen.clear)  # registered: nothing audited when it runs
    m(torch.ones(2)).sum().backward()
    del m
    t = torch.ones(2)
    dist.all_reduce(t)  # gloo's threads
    return float(t.sum())
'''


# Work the submission starts whose code has no frame of the submission's (issue 40, item 5): a thread whose target
# is a builtin, a weakref.finalize callback that the harness's frame sets off, a pool's worker thread, an exit
# handler. STARTED maps each function to the (event, line within the function) reported for it.
_STARTED = '''
def udp_in_a_thread():
    out = []
    t = threading.Thread(target=out.extend, args=(map(socket.socket, [socket.AF_INET], [socket.SOCK_DGRAM]),))
    t.start()
    t.join()
    return [s.close() for s in out]
def environ_from_a_finalizer(box):
    weakref.finalize(box, open, "/proc/self/environ")
def proc_from_a_pool():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return len(pool.submit(os.listdir, "/proc").result())
def exit_handler():
    atexit.register(os.kill, os.getpid(), 0)
'''
STARTED = {
    "udp_in_a_thread": [("thread.start", 4), ("socket.__new__", 4)],
    "environ_from_a_finalizer": [("open", 2)],
    "proc_from_a_pool": [("thread.start", 3), ("os.listdir", 3)],
    "exit_handler": [("atexit.register", 2)],
}


def _probe_namespace() -> dict:
    """The probe code, compiled under a graded task file's name (from the test module: no submission frame)."""
    namespace = dict(sys=sys, os=os, gc=gc, inspect=inspect, ctypes=ctypes, marshal=marshal, pickle=pickle,
                     pkgutil=pkgutil, collections=collections, socket=socket, mmap=mmap, torch=torch, dist=dist,
                     dataclasses=dataclasses, typing=typing, enum=enum, logging=logging, warnings=warnings,
                     threading=threading, weakref=weakref, atexit=atexit, concurrent=concurrent,
                     __file__=PROBE_FILE, __name__=__name__)  # (dataclasses look the module up by name)
    exec(compile(_REACHES + _HONEST + _STARTED, PROBE_FILE, "exec"), namespace)
    return namespace


_PROBE = _probe_namespace()


def _line_of(name: str) -> int:
    return _PROBE[name].__code__.co_firstlineno


def _reach_everything(rank, world_size):
    for name in REACHES:
        try:
            _PROBE[name]()
        except Exception:
            pass  # (xdrlib may be gone, /etc/passwd unreadable: the attempt is what is reported)
    return True


def _honest(rank, world_size):
    return _PROBE["honest"](os.path.join(os.environ["TMPDIR"], "mine.txt"))


def _findings(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_reach_is_reported_with_its_line_and_the_test_passes(monkeypatch, tmp_path):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_reach_everything, 1) == [True]  # the audit reports; it never fails the run
    found = _findings(log)
    reported = {(f["line"], f["what"].split("(")[0]) for f in found}
    missing = [name for name, (event, offset) in REACHES.items()
               if (_line_of(name) + offset - 1, event) not in reported]
    assert not missing, f"not reported: {missing}; reported: {sorted(reported)}"
    for f in found:
        assert f["file"] == "fsdp_assignment/task9_audit_probe.py" and f["source"] == "runtime" and f["rank"] == 0
        assert f["test"].endswith("test_each_reach_is_reported_with_its_line_and_the_test_passes"), f
        assert set(f) == {"file", "line", "kind", "what", "code", "test", "rank", "source"}, f


class _Box:
    """An object of the test's that the harness's frame drops (weakref-able)."""


def _starts_work(rank, world_size):
    _PROBE["udp_in_a_thread"]()
    box = _Box()
    _PROBE["environ_from_a_finalizer"](box)
    del box  # the callback runs here, on the test's frame: no frame of the submission's on the stack
    _PROBE["proc_from_a_pool"]()
    _PROBE["exit_handler"]()
    return True


def test_work_the_submission_starts_is_audited_as_the_submissions(monkeypatch, tmp_path):
    """Issue 40's evasions: a UDP socket made in a thread whose target is a builtin (``out.extend`` over
    ``map(socket.socket, ...)``), ``open('/proc/self/environ')`` as a weakref.finalize callback set off by the
    harness's frame, ``os.listdir('/proc')`` in a pool's worker: each is reported at the submission's line that
    started the work, and starting a thread or registering an exit handler is itself a finding."""
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_starts_work, 1) == [True]
    found = _findings(log)
    reported = {(f["line"], f["what"].split("(")[0]) for f in found}
    missing = [(name, event) for name, events in STARTED.items() for event, offset in events
               if (_line_of(name) + offset - 1, event) not in reported]
    assert not missing, f"not reported: {missing}; reported: {sorted(reported)}"
    kinds = {f["what"].split("(")[0]: f["kind"] for f in found}
    assert kinds["thread.start"] == "thread" and kinds["socket.__new__"] == "socket" and kinds["open"] == "file"
    assert all(f["file"] == "fsdp_assignment/task9_audit_probe.py" for f in found), found
    assert any("in a weakref.finalize callback registered here" in f["what"] for f in found), found


def _threads_of_others(rank, world_size):
    """Threads and callbacks that are not the submission's: the test's own (a builtin target making a UDP socket),
    torch's (autograd, gloo), and a finalize callback the submission registers that does nothing audited."""
    out = []
    t = threading.Thread(target=out.extend, args=(map(socket.socket, [socket.AF_INET], [socket.SOCK_DGRAM]),))
    t.start()
    t.join()
    [s.close() for s in out]
    return _PROBE["honest_callbacks"]()


def test_threads_and_callbacks_of_others_are_reported_for_nothing(monkeypatch, tmp_path):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_threads_of_others, 2) == [4.0, 4.0]
    assert _findings(log) == []


def test_honest_code_is_reported_for_nothing(monkeypatch, tmp_path):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_honest, 2) == [6, 6]
    assert _findings(log) == []


def _silences_the_channel(rank, world_size, how):
    # A submission that finds the audit's descriptor (the write end of the one pipe with a 1 MiB buffer) and
    # silences it.
    import fcntl
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            flags, size = fcntl.fcntl(fd, fcntl.F_GETFL), fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ
        except OSError:
            continue
        if size == rank_audit.PIPE_BYTES and flags & os.O_ACCMODE == os.O_WRONLY:
            if how == "close":
                os.close(fd)
            else:
                os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    _PROBE["frame"]()  # unseen now
    return True


@pytest.mark.parametrize("how", ["close", "dup2"])
def test_a_rank_that_silences_its_channel_is_reported(monkeypatch, tmp_path, how):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_silences_the_channel, 1, how) == [True]
    whats = [f["what"] for f in _findings(log)]
    assert any("closed its audit channel before its report" in w for w in whats), whats


def _rebinds_what_the_hook_uses(rank, world_size):
    saved = os.write, json.dumps, os.fspath, os.getcwd
    os.write, json.dumps, os.fspath, os.getcwd = (lambda fd, data: len(data)), None, None, None
    try:
        _PROBE["frame_through_a_traceback"]()  # tb_frame: still reported, through what install() captured
        _PROBE["proc"]()
    finally:
        os.write, json.dumps, os.fspath, os.getcwd = saved  # (the harness's report needs os.write)
    return True


def test_rebinding_module_globals_does_not_blind_the_hook(monkeypatch, tmp_path):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_rebinds_what_the_hook_uses, 1) == [True]
    assert [f["what"].split("(")[0] for f in _findings(log)] == ["object.__getattr__", "open"], _findings(log)


_MANY = "def many():\n" + "".join(f"    sys._getframe()\n" for _ in range(rank_audit.MAX_FINDINGS + 50))


def _floods(rank, world_size):
    namespace = dict(sys=sys)
    exec(compile(_MANY, PROBE_FILE, "exec"), namespace)
    namespace["many"]()
    for _ in range(1000):  # repeats of one line are one finding
        _PROBE["frame"]()
    return True


def test_findings_are_capped_per_rank_and_the_cap_is_said(monkeypatch, tmp_path):
    log = tmp_path / "audit.jsonl"
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(log))
    assert run_ranks(_floods, 1) == [True]
    found = _findings(log)
    assert len(found) == rank_audit.MAX_FINDINGS + 1, len(found)
    assert found[-1]["kind"] == "channel" and "more findings past the cap of 200" in found[-1]["what"], found[-1]


def test_publish_writes_only_where_the_grader_asks(monkeypatch, tmp_path):
    monkeypatch.delenv("FSDP_AUDIT_LOG", raising=False)
    rank_audit.publish([{"file": "x", "line": 1}])  # nowhere: no error, no file
    monkeypatch.setenv("FSDP_AUDIT_LOG", str(tmp_path / "a.jsonl"))
    rank_audit.publish([{"file": "x", "line": 1}, {"file": "y", "line": 2}])
    assert [f["file"] for f in _findings(tmp_path / "a.jsonl")] == ["x", "y"]
