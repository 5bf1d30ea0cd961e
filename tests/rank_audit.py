"""The runtime audit: what submission code does in a rank that a person grading should read (issue 36, item 2).

The kernel judges memory and bytes; it cannot judge a rank that reads the grader's frames, loads native code or
imports a socket module. Python's audit hooks (PEP 578) see those however they are spelled, so each rank installs
one (``install``) before the test module, and so any submission code, is imported. It reports an event only while
submission code is on the stack (a frame of ``fsdp_assignment/task<N>_*.py`` under the tree being graded, or of a
task file one folder below it), and
writes one JSON line per finding to a pipe whose other end the parent holds (``AuditChannel``). The parent reads
the lines after the run, notices a channel that ended before the rank's closing line (a rank that closed or
replaced its audit descriptor), and appends the findings to the file named by ``FSDP_AUDIT_LOG`` (``publish``),
which the staff review shows. The audit never fails a test: it reports for a person.

What is reported, and how close the submission must be to the event (rules below, ``_RULES``):
- anywhere on the stack ("deep": the event's effect is the submission's whoever spells the call): native code
  (``ctypes.*``, an extension module loaded), ``marshal.loads``, ``pickle.find_class``, building code or
  functions by hand (``code.__new__``, ``function.__new__``), the interpreter's frames and objects from outside
  (``sys._current_frames``, ``gc.get_objects``/``get_referrers``/``get_referents``), tracing (``sys.settrace``,
  ``sys.setprofile``, ``sys.addaudithook``), processes and signals (``os.fork``, ``os.exec``, ``os.posix_spawn``,
  ``os.system``, ``subprocess.Popen``, ``os.kill``...), sockets (``socket.*``: gloo's own sockets are C++ and raise
  nothing), ``mmap``, environment and limits (``os.putenv``, ``resource.setrlimit``), and files (``open``,
  ``os.listdir``, ``os.remove``...) outside the rank's folder, or anywhere in ``/proc``, ``/sys``, ``/dev/shm``
  (reading a ``.py`` file of the tree or of the Python installation is fine: tracebacks and warnings do);
- from the submission's own line ("direct": honest library code raises these on the caller's behalf, dataclasses
  and namedtuple ``exec``, typing and enum ``sys._getframe``): ``compile``, ``exec``, ``sys._getframe`` (also
  through ``inspect.currentframe``/``inspect.stack``/``logging.currentframe``/``traceback.walk_stack`` called from
  the submission's line), reading a frame or code object (``tb_frame``, ``gi_frame``, ``f_code``, ``__code__``),
  replacing a function's ``__code__``, a ``__class__`` assignment to a class that is not a subclass of the old one
  (FSDP2's swap to a subclass is honest), and ``import`` of a module outside ``ALLOWED_IMPORTS`` not loaded yet
  (an already loaded module raises no event: its use is what the other rules see).

Work the submission starts (issue 40, item 5) is audited as the submission's wherever it runs. Python 3.11 raises
no event when a thread starts, so ``install`` wraps what starts work: ``_thread.start_new_thread`` (and
``threading``'s alias of it, so ``threading.Thread``, ``Timer`` and thread pools), ``weakref.finalize`` and
``atexit.register``. When the first frame outside Python's own library that asks for it is the submission's, the
callable it passes is marked: while it runs, its thread carries the submission's line, and every event the rules
would report from submission code is reported at that line ("in a thread started here"), even with no frame of the
submission's on the stack (``Thread(target=out.extend, args=(map(socket.socket, ...),))``, a finalize callback
``open`` set off by the harness's frame). Starting a thread or registering an exit handler is itself a finding
(kinds ``thread``, ``callback``); registering a finalize callback is not (only what it does). Threads that torch
starts (autograd's engine, gloo: C++ threads) and those the harness or torch starts from their own frames are not
the submission's. Not followed: callables handed to torch that torch calls with no frame of the submission's
(a builtin as a tensor hook, ``Future.then``), ``weakref.ref`` callbacks, and work started through the real
functions if the submission reaches them past the wrappers (the static review flags ``__closure__`` and patches
of ``threading``/``_thread``).

What Python 3.11 raises no event for (the static review, staff/autograder/review.py, covers these): assigning an
attribute of a class or a module (``torch.UntypedStorage.size = f``, ``dist.all_reduce = f``), ``__dict__``,
``__globals__``, ``__subclasses__``, ``sys.modules``, ``f_back``/``f_locals``/``f_globals`` of a frame already
held, ``os.pidfd_open``, ``os.umask``, ``os.close``/``os.dup2`` (hence the closing line), and C++ code reached
through torch (``torch.from_file``; seccomp refuses the system calls that matter: tests/rank_isolation.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sys

MAX_FINDINGS = 200  # per rank; later ones are counted, not sent
ARG_CHARS = 200  # each finding's rendering of the event's arguments
PIPE_BYTES = 1 << 20  # the channel's buffer: 200 findings of under 1 KiB fit, so a rank never waits on the parent
_F_SETPIPE_SZ = 1031

# Top-level modules an FSDP implementation may import (a module already loaded raises no event whatever it is).
ALLOWED_IMPORTS = frozenset("""
    torch fsdp_assignment __future__ abc array bisect cmath collections contextlib copy copyreg dataclasses decimal
    enum fractions functools gc graphlib heapq inspect io itertools json logging math numbers operator os pathlib
    pprint queue random re reprlib statistics string struct sys tempfile textwrap threading time traceback types
    typing typing_extensions warnings weakref
""".split())
# Submodules of an allowed package that are native code or processes by other means.
DENIED_IMPORTS = ("torch.utils.cpp_extension",)

# event -> (kind, scope). "deep": reported when any frame on the stack is the submission's; "direct": when the
# frame that raised it is (see the module docstring). "file" events are reported only for paths outside the
# allowed places (_path_ok).
_RULES = {}
for _kind, _scope, _names in (
        ("frames", "deep", "sys._current_frames sys._current_exceptions gc.get_objects gc.get_referrers "
                           "gc.get_referents"),
        ("frames", "direct", "sys._getframe object.__getattr__"),
        ("native", "deep", "cpython._PySys_ClearAuditHooks"),
        ("code", "deep", "marshal.loads marshal.load pickle.find_class code.__new__ function.__new__"),
        ("code", "direct", "compile exec"),
        ("patch", "deep", "object.__setattr__ object.__delattr__"),
        ("import", "direct", "import"),
        ("process", "deep", "os.fork os.forkpty os.posix_spawn os.spawn os.exec os.system os.kill os.killpg "
                            "subprocess.Popen signal.pthread_kill os.startfile pty.spawn os.unshare os.setns"),
        ("tracing", "deep", "sys.settrace sys.setprofile sys.addaudithook sys.monitoring.register_callback"),
        ("environment", "deep", "os.putenv os.unsetenv resource.setrlimit resource.prlimit"),
        ("memory", "deep", "mmap.__new__"),
        ("file", "deep", "open os.listdir os.scandir os.remove os.rename os.link os.symlink os.truncate os.mkdir "
                         "os.rmdir os.chmod os.chown os.utime os.chdir shutil.copyfile shutil.copytree "
                         "shutil.rmtree shutil.move shutil.chown glob.glob tempfile.mkstemp tempfile.mkdtemp")):
    for _name in _names.split():
        _RULES[_name] = (_kind, _scope)
_PREFIX_RULES = {"ctypes": ("native", "deep"), "socket": ("socket", "deep")}
# Attributes whose read raises object.__getattr__ that hand out frames or code.
_FRAME_ATTRS = frozenset("tb_frame gi_frame cr_frame ag_frame f_code gi_code cr_code ag_code __code__".split())
# Library functions that hand their caller a frame: sys._getframe from one of them counts for the line that called it.
_FRAME_GETTERS = frozenset(("currentframe", "stack", "trace", "getouterframes", "getinnerframes", "walk_stack",
                            "walk_tb"))
_FRAME_GETTER_FILES = ("/inspect.py", "/logging/__init__.py", "/traceback.py")
# The import system's own frames: what they do while importing (read a .pyc, unmarshal it, run the module's body)
# is judged by the import event alone. And the frames that import for their caller: the importer is the first
# frame outside both.
_IMPORT_SYSTEM = ("<frozen importlib", "<frozen zipimport")
_IMPORTS_FOR_CALLER = ("/importlib/__init__.py", "/importlib/util.py", "/pkgutil.py", "/runpy.py")
_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/rank_audit.py -> the tree's root


def install(write_fd: int, token: str, rank_dir: str, tree: str = _TREE) -> None:
    """In the rank, before any submission code is imported: report what the submission does to ``write_fd``.

    Everything the hook uses is captured here, so a submission that rebinds ``os.write``, ``json`` or module
    globals later does not change what it reports. ``finish()`` writes the closing line the parent expects."""
    import _thread
    import re
    _write, _getframe, _ident, _getcwd = os.write, sys._getframe, _thread.get_ident, os.getcwd
    _fspath, _str_repr, _int_repr, _bytes_repr = os.fspath, str.__repr__, int.__repr__, bytes.__repr__
    _type_name = type.__dict__["__qualname__"].__get__
    _type_module = type.__dict__["__module__"].__get__
    _mro = type.__dict__["__mro__"].__get__
    sub_re = re.compile(r"fsdp_assignment/(?:\w+/)?task\d_\w+\.py")  # (a staff tree keeps its own under a folder)
    tree = tree.rstrip("/") + "/"
    rank_dir = rank_dir.rstrip("/") + "/"
    python_dirs = tuple(sorted({p.rstrip("/") + "/" for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))
    stdlib = os.path.dirname(os.__file__).rstrip("/") + "/"  # Python's own library, where threads start
    site_packages = stdlib + "site-packages/"
    escape = {i: f"\\u{i:04x}" for i in range(32)}
    escape.update({ord('"'): '\\"', ord("\\"): "\\\\"})
    os.set_blocking(write_fd, False)  # a full channel drops a finding (counted), never stalls the rank
    state = {"sent": 0, "over": 0, "dropped": 0}
    seen: set = set()
    busy: set = set()
    files: dict = {}

    def submission_file(code) -> str | None:  # the tree-relative path of a graded task file, else None
        name = code.co_filename
        rel = files.get(name, 0)
        if rel == 0:
            rel = name[len(tree):] if name.startswith(tree) and sub_re.fullmatch(name[len(tree):]) else None
            files[name] = rel
        return rel

    def js(text: str) -> str:
        return '"' + text.translate(escape) + '"'

    def render(x, depth=0) -> str:  # never runs the submission's code: no repr of its objects, no properties
        t = type(x)
        if t is str:
            return _str_repr(x)[:ARG_CHARS]
        if t is bytes or t is bytearray:
            return _bytes_repr(bytes(x[:ARG_CHARS]))
        if t is int or t is bool or x is None:
            return _int_repr(x) if t is int else ("None" if x is None else ("True" if x else "False"))
        if (t is tuple or t is list) and depth == 0:
            return "(" + ", ".join(render(v, 1) for v in x[:6]) + (", ...)" if len(x) > 6 else ")")
        if type in _mro(t):  # a class (its metaclass's properties are not consulted)
            return f"<class {_type_module(x)}.{_type_name(x)}>"
        return f"<{_type_module(t)}.{_type_name(t)}>"

    def send(line: str) -> bool:
        data = line.encode("utf-8", "backslashreplace")
        try:
            while data:
                data = data[_write(write_fd, data):]
            return True
        except OSError:  # full (the parent reads after the run) or closed by the submission: counted
            state["dropped"] += 1
            return False

    def report(event, args, kind, frame, note="") -> None:
        report_at(event, args, kind, submission_file(frame.f_code), frame.f_lineno, note)

    def report_at(event, args, kind, rel, line, note="") -> None:
        key = (event, rel, line)
        if key in seen:
            return
        seen.add(key)
        if state["sent"] >= MAX_FINDINGS:
            state["over"] += 1
            return
        what = f"{event}{render(args)}"[:ARG_CHARS] + (f" ({note})" if note else "")
        if send(f'{{"file": {js(rel)}, "line": {line}, "kind": {js(kind)}, "event": {js(event)}, '
                f'"what": {js(what)}}}\n'):
            state["sent"] += 1

    def innermost_submission(frame):
        while frame is not None:
            code = frame.f_code
            if submission_file(code) is not None:
                return frame
            if code.co_filename.startswith(_IMPORT_SYSTEM):
                return False  # the body of a module being imported: the import event judged that
            frame = frame.f_back
        return None

    # ---- work the submission started: threads, weakref.finalize callbacks, exit handlers ----------------------
    # What runs in a thread the submission started, or in a callback it registered, may have no frame of the
    # submission's on its stack (a builtin target: Thread(target=out.extend, args=(map(socket.socket, ...),))).
    # So the audit wraps what starts such work: the wrapped callable marks its thread, while it runs, with the
    # submission's line that started it, and what is reported there is reported at that line.
    started: dict = {}  # thread ident -> (file, line, how): running work the submission started

    def starter(frame):
        """(file, line) of the submission's line that called into Python's own library (threading, weakref,
        concurrent.futures, ...) to start work, or this thread's own mark when it runs such work; else None
        (torch or the provided support code starting work is not the submission's doing)."""
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith(stdlib) and not name.startswith(site_packages)) and \
                    not name.startswith("<frozen"):
                rel = submission_file(frame.f_code)
                if rel is not None:
                    return rel, frame.f_lineno
                break
            frame = frame.f_back
        mark = started.get(_ident())
        return mark[:2] if mark is not None else None

    def marked(func, where, how):
        def run(*args, **kwargs):
            me = _ident()
            before = started.get(me)
            started[me] = (where[0], where[1], how)
            try:
                return func(*args, **kwargs)
            finally:
                if before is None:
                    started.pop(me, None)
                else:
                    started[me] = before
        return run

    def starting(event, kind, how, note):
        """A wrapper of a function that takes a callable (_thread.start_new_thread's first argument,
        weakref.finalize.__init__'s third, atexit.register's first): the callable is marked when the submission
        passes it, and the start reported at the submission's line when ``note`` says why (a finalize callback
        registered is honest; what it does when it runs is what is reported)."""
        def wrap(real, position):
            def call(*args, **kwargs):
                me = _ident()
                where = None
                if me not in busy and len(args) > position:
                    busy.add(me)
                    try:
                        where = starter(_getframe(1))
                        if where is not None:
                            if note:
                                report_at(event, (args[position],), kind, where[0], where[1], note)
                            args = args[:position] + (marked(args[position], where, how),) + args[position + 1:]
                    finally:
                        busy.discard(me)
                return real(*args, **kwargs)
            return call
        return wrap

    def path_ok(path, writing: bool) -> bool:
        try:
            path = _fspath(path)
        except TypeError:
            return True  # a descriptor: opened earlier, by a path that was checked then
        if type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        if type(path) is not str:
            return True
        if not path.startswith("/"):
            path = _getcwd() + "/" + path
        parts: list = []
        for part in path.split("/"):  # normalised by hand: posixpath's globals are the submission's to rebind
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        path = "/" + "/".join(parts)
        if path.startswith(("/proc/", "/sys/", "/dev/shm/")) or path in ("/proc", "/sys", "/dev/shm"):
            return False
        if (path + "/").startswith(rank_dir) or path in ("/dev/null", "/dev/urandom"):
            return True
        if writing:
            return False
        if (path + "/").startswith(tree):
            return path.endswith(".py") or path + "/" == tree or "." not in path.rsplit("/", 1)[-1]
        return path.endswith(".py") and path.startswith(python_dirs)

    def file_event_ok(event, args) -> bool:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if type(mode) is str:
                writing = any(c in mode for c in "wax+")
            else:
                writing = type(flags) is int and (flags & 3 != 0 or flags & (os.O_CREAT | os.O_TRUNC) != 0)
            return path_ok(path, writing)
        if event in ("os.listdir", "os.scandir", "glob.glob"):
            return not args or path_ok(args[0] if args[0] is not None else ".", False)
        return all(path_ok(p, True) for p in tuple(args)[:2])  # (a mode or a descriptor there: not a path)

    rules = dict(_RULES)  # event -> rule, or None once an event is known to be of no interest (the hot path)

    def hook(event, args):
        rule = rules.get(event, 0)
        if rule is None:
            return
        if rule == 0:
            dot = event.find(".")
            rule = rules[event] = _PREFIX_RULES.get(event[:dot]) if dot > 0 else None
            if rule is None:
                return
        me = _ident()
        if me in busy:  # our own frame reads raise events too
            return
        busy.add(me)
        try:
            check(event, args, rule)
        except BaseException:  # the audit never breaks the call it watches
            pass
        finally:
            busy.discard(me)

    def check(event, args, rule):
        kind, scope = rule
        caller = _getframe(2)  # 0: check, 1: hook, 2: the frame that raised the event
        if caller is None:
            return
        top = caller.f_code.co_filename
        if event != "import" and top.startswith(_IMPORT_SYSTEM):
            return  # importing: the import event itself decides (a module's body, its .pyc, marshal)
        if scope == "deep":
            where = innermost_submission(caller)
            if where is False or (kind == "file" and file_event_ok(event, args)):
                return
            if where is None:
                mark = started.get(_ident())  # no submission frame: work the submission started?
                if mark is not None:
                    report_at(event, args, kind, *mark)
                return
            if kind == "patch":
                name = args[1] if len(args) > 1 else None
                if name == "__class__" and len(args) > 2:
                    old, new = type(args[0]), args[2]
                    if type in _mro(type(new)) and old in _mro(new):
                        return  # a swap to a subclass (FSDP2's fully_shard does it)
                elif name != "__code__":
                    return
            report(event, args, kind, where)
            return
        if event == "import":
            name = args[0] if args else ""
            frame = caller
            while frame is not None and (frame.f_code.co_filename.startswith(_IMPORT_SYSTEM)
                                         or frame.f_code.co_filename.endswith(_IMPORTS_FOR_CALLER)):
                frame = frame.f_back
            mark = started.get(_ident()) if frame is None or submission_file(frame.f_code) is None else None
            if (mark is None and (frame is None or submission_file(frame.f_code) is None)) or type(name) is not str:
                return
            native = len(args) > 1 and type(args[1]) is str and args[1].endswith((".so", ".pyd"))
            allowed = name.split(".")[0] in ALLOWED_IMPORTS and not name.startswith(DENIED_IMPORTS)
            if allowed and not native:
                return
            what = "a native extension" if native else "not among the modules an FSDP implementation needs"
            if mark is not None:
                report_at(event, (name,), "native" if native else "import", mark[0], mark[1], f"{what}; {mark[2]}")
            else:
                report(event, (name,) + ((args[1],) if native else ()), "native" if native else "import", frame, what)
            return
        if event == "object.__getattr__" and (len(args) < 2 or args[1] not in _FRAME_ATTRS):
            return
        where = caller if submission_file(caller.f_code) is not None else None
        if where is None and kind == "frames" and caller.f_code.co_name in _FRAME_GETTERS \
                and top.endswith(_FRAME_GETTER_FILES):
            above = caller.f_back  # a frame getter called from the submission's own line
            where = above if above is not None and submission_file(above.f_code) is not None else None
        if where is not None:
            report(event, args, kind, where)
        elif started:  # (empty unless the submission started work: the hot path stays one test)
            mark = started.get(_ident())
            if mark is not None and innermost_submission(caller) is None:
                report_at(event, args, kind, *mark)

    def finish() -> None:
        send(f'{{"end": {js(token)}, "sent": {state["sent"]}, "over_cap": {state["over"]}, '
             f'"dropped": {state["dropped"]}}}\n')

    import atexit
    import threading
    import weakref
    thread = starting("thread.start", "thread", "in a thread started here",
                      "a thread started by the submission: what it runs is reported at this line")
    for module, name in ((_thread, "start_new_thread"), (_thread, "start_new"), (_thread, "start_joinable_thread"),
                         (threading, "_start_new_thread"), (threading, "_start_joinable_thread")):
        real = getattr(module, name, None)
        if real is not None:  # (3.13 starts threads through start_joinable_thread)
            setattr(module, name, thread(real, 0))
    weakref.finalize.__init__ = starting("weakref.finalize", "callback", "in a weakref.finalize callback "
                                         "registered here", "")(weakref.finalize.__init__, 2)
    atexit.register = starting("atexit.register", "callback", "in an exit handler registered here",
                               "ranks end with os._exit: an exit handler never runs there")(atexit.register, 0)
    sys.addaudithook(hook)
    global _finish
    _finish = finish


_finish = None


def finish() -> None:
    """In the rank, right before its report: the closing line (a channel that ends without it was silenced)."""
    if _finish is not None:
        _finish()


# ---- the parent's side ------------------------------------------------------------------------------------------
class AuditChannel:
    """One rank's audit pipe: the parent keeps the read end and hands ``writer`` (a multiprocessing Connection, so
    the forkserver can pass it) and ``token`` to the rank."""

    def __init__(self, ctx):
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.token = secrets.token_hex(8)
        self.data = bytearray()
        try:
            fcntl.fcntl(self.reader.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB: a rank that fills it drops findings and says how many
        os.set_blocking(self.reader.fileno(), False)

    def started(self) -> None:
        """The rank holds the write end now: close ours, so its death (or its closing the descriptor) reads as EOF."""
        self.writer.close()

    def drain(self) -> bool:
        """Read what is there without waiting; True once the rank's end is closed."""
        while len(self.data) < 4 * PIPE_BYTES:
            try:
                chunk = os.read(self.reader.fileno(), 65536)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not chunk:
                return True
            self.data += chunk
        return True

    def findings(self, rank: int, reported: bool, tree: str = _TREE) -> list[dict]:
        """The rank's findings as staff-review flags. ``reported``: the rank sent its report, so its closing line
        must be there too (a rank killed or crashed mid-body has none, and that is the test's failure, not ours)."""
        self.drain()
        self.reader.close()
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        base = dict(test=test, rank=rank, source="runtime")
        out, end = [], None
        for raw in bytes(self.data).splitlines()[:MAX_FINDINGS + 1]:
            try:
                item = json.loads(raw)
            except ValueError:
                item = None
            if not isinstance(item, dict):
                out.append(dict(base, file="", line=0, kind="channel", code="",
                                what=f"a line on the audit channel that the audit did not write: {raw[:80]!r}"))
                continue
            if "end" in item:
                end = item
                continue
            rel, line = str(item.get("file", "")), int(item.get("line", 0) or 0)
            out.append(dict(base, file=rel, line=line, kind=str(item.get("kind", "")),
                            what=str(item.get("what", ""))[:2 * ARG_CHARS], code=_source_line(tree, rel, line)))
        if end is not None and end.get("end") != self.token:
            out.append(dict(base, file="", line=0, kind="channel", code="",
                            what="a closing line on the audit channel that the audit did not write"))
        elif end is None and reported:
            out.append(dict(base, file="", line=0, kind="channel", code="",
                            what="the rank closed its audit channel before its report (os.close or os.dup2 on "
                                 "the audit's descriptor): what it did after that was not seen"))
        if end is not None and end.get("over_cap"):
            out.append(dict(base, file="", line=0, kind="channel", code="",
                            what=f"{end['over_cap']} more findings past the cap of {MAX_FINDINGS} not shown"))
        if end is not None and end.get("dropped"):
            out.append(dict(base, file="", line=0, kind="channel", code="",
                            what=f"{end['dropped']} findings lost: the audit channel was full or closed"))
        return out


def _source_line(tree: str, rel: str, line: int) -> str:
    """The submission's line, read by the parent (a task file of the tree only)."""
    if not rel.startswith("fsdp_assignment/") or ".." in rel or line <= 0:
        return ""
    try:
        with open(os.path.join(tree, rel), encoding="utf-8", errors="replace") as f:
            for i, text in enumerate(f, 1):
                if i == line:
                    return text.strip()[:200]
    except OSError:
        pass
    return ""


def publish(findings: list[dict]) -> None:
    """Append ``findings`` (JSON lines) to the file named by FSDP_AUDIT_LOG; nothing when it is unset. Parent only."""
    path = os.environ.get("FSDP_AUDIT_LOG", "").strip()
    if not path or not findings:
        return
    with open(path, "a", encoding="utf-8") as f:
        for finding in findings:
            f.write(json.dumps(finding, sort_keys=True) + "\n")


def publish_run(channels: list[AuditChannel], ranks) -> None:
    """After a run, every rank ended: each rank's findings to FSDP_AUDIT_LOG. Never raises (a run's own failure, if
    any, is what the test reports); a log that cannot be written is said on stderr, for the staff."""
    for channel, r in zip(channels, ranks):
        try:
            publish(channel.findings(r.rank, reported=r.report is not None))
        except Exception as err:
            print(f"harness: rank {r.rank}'s runtime audit was not published: {type(err).__name__}: {err}",
                  file=sys.stderr)
