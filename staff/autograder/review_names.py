"""The staff review's tables: which modules, dotted names, attribute names and strings it flags, each with its
``kind`` (review.py's docstring lists the kinds). One table per way a name can be spelt, so that one rule reads
them all: ``os.fork``, ``getattr(os, 'fork')``, ``from os import fork`` and ``f = os.fork`` are the same name
once an alias is resolved (review_scopes.py), and the same name is flagged the same way."""

from __future__ import annotations

import re

# A module (or a module's prefix) whose import or any use is flagged. The longest matching prefix wins
# (multiprocessing.shared_memory is mmap, the rest of multiprocessing is process).
MODULE_KINDS = {
    "ctypes": "ctypes", "_ctypes": "ctypes", "cffi": "ctypes", "_cffi_backend": "ctypes",
    "mmap": "mmap", "_posixshmem": "mmap", "multiprocessing.shared_memory": "mmap",
    "signal": "signal", "_signal": "signal", "faulthandler": "signal",
    "subprocess": "process", "_posixsubprocess": "process", "multiprocessing": "process", "pty": "process",
    "torch.multiprocessing": "process", "concurrent.futures.process": "process",
    "socket": "socket", "_socket": "socket", "socketserver": "socket", "asyncio": "socket",
    "resource": "resource", "fcntl": "audit",
    "importlib": "dynamic", "_imp": "dynamic", "_frozen_importlib": "dynamic",
    "_frozen_importlib_external": "dynamic", "pkgutil": "dynamic", "runpy": "dynamic", "zipimport": "dynamic",
    "marshal": "dynamic", "_pickle": "dynamic", "copyreg": "dynamic", "code": "dynamic", "codeop": "dynamic",
    "torch.utils.cpp_extension": "native", "torch._C._dlopen": "native",
    # Operator registrations and dispatch modes change what torch runs for every caller, the tests included.
    "torch.library": "patch", "torch.utils._python_dispatch": "patch", "torch.overrides": "patch",
    "atexit": "process", "unittest.mock": "patch",
    "builtins": "patch",
    "tests": "harness", "pytest": "harness", "_pytest": "harness", "conftest": "harness", "staff": "harness",
    "adapters": "harness",
}
# The C modules behind os: ``import posix; posix.fork()`` is os.fork.
MODULE_SYNONYMS = {"posix": "os", "nt": "os", "_signal": "signal", "_thread": "threading"}

# A dotted name (module attribute) whose use is flagged; a key ending in "." is a prefix.
DOTTED_KINDS = {
    **dict.fromkeys((
        "sys._getframe", "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile",
        "sys.gettrace", "sys.getprofile", "sys.exc_info", "sys.last_traceback", "sys.last_exc", "sys.monitoring",
        "sys.call_tracing", "threading.settrace", "threading.setprofile", "threading.settrace_all_threads",
        "threading.setprofile_all_threads", "inspect.currentframe", "inspect.stack", "inspect.trace",
        "inspect.getouterframes", "inspect.getinnerframes", "inspect.getframeinfo", "inspect.getgeneratorlocals",
        "inspect.getcoroutinelocals", "inspect.getclosurevars", "traceback.walk_stack", "traceback.walk_tb",
        "traceback.extract_stack", "traceback.extract_tb", "traceback.format_stack", "traceback.print_stack",
        "traceback.StackSummary", "traceback.FrameSummary", "logging.currentframe", "sys._getframemodulename"),
        "frame"),
    # The rank audit's channel is a descriptor (tests/rank_audit.py): closing or replacing descriptors is audit.
    **dict.fromkeys(("sys.addaudithook", "sys.audit", "os.close", "os.closerange", "os.dup", "os.dup2",
                     "os.set_inheritable", "os.umask", "os.write", "os.writev", "os.pwrite", "os.fdopen",
                     "os.pipe", "os.pipe2"), "audit"),
    **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "gc.garbage", "gc.callbacks"), "gc"),
    **dict.fromkeys(("os.fork", "os.forkpty", "os.system", "os.popen", "os.posix_spawn", "os.posix_spawnp",
                     "os.register_at_fork", "os.openpty", "os.exec", "os.spawn", "os.setuid", "os.setgid",
                     "os.setreuid", "os.setresuid", "os.setresgid", "os.setgroups", "os.chroot", "os.unshare",
                     "os.setns", "sys.remote_exec", "concurrent.futures.ProcessPoolExecutor"), "process"),
    **dict.fromkeys(("os.kill", "os.killpg", "os.getppid", "os.setsid", "os.setpgid", "os.setpgrp", "os.abort",
                     "os.pidfd_open", "signal.pidfd_send_signal", "signal.pthread_kill"), "signal"),
    "os.memfd_create": "mmap", "torch.from_file": "mmap", "numpy.memmap": "mmap",
    "numpy.lib.format.open_memmap": "mmap",
    "torch.ops.load_library": "native", "torch.classes.load_library": "native",
    "os.putenv": "environment", "os.unsetenv": "environment", "os.environb": "environment",
    "sys.modules": "sys.modules",
    # The import machinery: what a later import (a test's, the harness's) finds.
    "sys.meta_path": "dynamic", "sys.path_hooks": "dynamic", "sys.path_importer_cache": "dynamic",
    "os.chdir": "path", "os.fchdir": "path",
    "pickle.loads": "dynamic", "pickle.load": "dynamic", "pickle.Unpickler": "dynamic",
    "marshal.loads": "dynamic", "marshal.load": "dynamic", "types.FunctionType": "dynamic",
    "types.LambdaType": "dynamic", "types.CodeType": "dynamic", "pkgutil.resolve_name": "dynamic",
}
PREFIX_KINDS = {"os.exec": "process", "os.spawn": "process",  # os.execv, os.spawnlp, ...
                "importlib.": "dynamic"}  # every use of importlib loads code the review does not read

# An attribute name flagged on whatever object it is read from (the object may be reached in ways the review
# cannot follow: a storage, a module held in a container).
FRAME_ATTRIBUTES = {"f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next",
                    "gi_frame", "cr_frame", "ag_frame", "__traceback__"}
ATTRIBUTE_KINDS = {
    **dict.fromkeys(FRAME_ATTRIBUTES, "frame"), "_getframe": "frame", "_current_frames": "frame",
    "_getframemodulename": "frame",
    "addaudithook": "audit",
    "from_file": "mmap", "memmap": "mmap", "open_memmap": "mmap", "memfd_create": "mmap",
    "share_memory_": "mmap", "_share_filename_cpu_": "mmap", "_share_fd_cpu_": "mmap",
    "_new_shared_filename_cpu": "mmap", "_new_shared_fd_cpu": "mmap", "_new_using_filename_cpu": "mmap",
    "_new_using_fd_cpu": "mmap",
    "load_library": "native", "load_inline": "native",
    "get_referrers": "gc", "get_referents": "gc", "get_objects": "gc",
    "pidfd_open": "signal", "pthread_kill": "signal", "forkpty": "process",
    "environb": "environment",
}
# Dunders that walk from an object to its code, namespace or class graph. __bases__/__base__/__mro__ are
# exempt when only a name is read from them (review_rules.py: ``cls.__bases__[-1].__name__``).
INTROSPECTION = {"__dict__", "__globals__", "__builtins__", "__subclasses__", "__base__", "__bases__", "__mro__",
                 "__code__", "__closure__", "__reduce__", "__reduce_ex__", "__loader__", "__spec__"}
CLASS_WALKS = {"__base__", "__bases__", "__mro__"}
NAME_READS = {"__name__", "__qualname__", "__module__", "__doc__"}

# Builtins whose use is flagged wherever it appears (called or passed on), and the getattr family.
BUILTIN_KINDS = {"exec": "dynamic", "eval": "dynamic", "compile": "dynamic", "__import__": "dynamic",
                 "breakpoint": "frame", "globals": "introspection", "vars": "introspection",
                 "__builtins__": "patch", "__loader__": "dynamic", "__spec__": "dynamic"}
GETATTR_FAMILY = {"getattr": "get", "hasattr": "get", "setattr": "set", "delattr": "del",
                  "inspect.getattr_static": "get", "operator.attrgetter": "attrgetter"}
DUNDER_ACCESS = {"__getattribute__": "get", "__getattr__": "get", "__setattr__": "set", "__delattr__": "del"}
# Namespaces whose attributes may be read by a name held in a variable (``getattr(torch.optim, name)``: an
# optimizer chosen by its name): they hold classes and functions of the model's maths, nothing of the grader's.
READ_BY_NAME = {"torch.optim", "torch.optim.lr_scheduler", "torch.nn", "torch.nn.init", "torch.nn.functional"}
OPEN_CALLS = {"open", "io.open", "os.open", "codecs.open", "pathlib.Path", "pathlib.PosixPath", "os.listdir",
              "os.scandir", "os.readlink", "os.walk", "os.stat", "os.lstat", "glob.glob", "glob.iglob",
              "os.fdopen", "io.FileIO", "pathlib.PurePath", "os.path.realpath", "os.path.exists"}
ENVIRON_EDITS = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}

# Strings. A plain string literal that is exactly one of these names is flagged: nothing honest spells them as
# data. A string built by operations (concatenation, an f-string, join, ...) is flagged when it comes out as any
# name the tables hold (the last part of a dotted name, an attribute name): honest code builds no such name.
DISTINCTIVE_STRINGS = (set(ATTRIBUTE_KINDS) | INTROSPECTION | {"_getframe", "settrace", "setprofile", "environb",
                                                                "pidfd_open", "forkpty", "CDLL", "PyDLL",
                                                                "pythonapi", "dlopen", "resolve_name"}) - \
    CLASS_WALKS - {"__dict__", "__reduce__", "__reduce_ex__", "__loader__", "__spec__"}  # a class's own dict keys


def _python_dunders() -> frozenset[str]:
    """The dunders Python itself defines on objects, classes, functions, modules, frames, code, exceptions and
    generators: a getattr of one of them is flagged; a submission's own ``__fsdp_state__`` is its own name."""
    import sys
    import types

    def gen():
        yield

    samples = [object(), object, type, len, gen, gen(), sys, gen.__code__, ValueError(),
               types.SimpleNamespace(), property(), staticmethod(len), classmethod(len), 1, "", [], {}]
    names = {n for sample in samples for n in dir(sample) if n.startswith("__") and n.endswith("__")}
    return frozenset(names | {"__wrapped__", "__traceback__", "__cause__", "__context__", "__all__", "__path__",
                              "__file__", "__loader__", "__spec__", "__package__", "__builtins__", "__globals__",
                              "__closure__", "__code__", "__defaults__", "__kwdefaults__", "__self__", "__func__",
                              "__mro__", "__bases__", "__base__", "__subclasses__", "__weakref__", "__slots__",
                              "__torch_function__", "__torch_dispatch__"})


PYTHON_DUNDERS = _python_dunders()


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


BUILT_NAME_KINDS = {**{_last(k): v for k, v in DOTTED_KINDS.items()}, **ATTRIBUTE_KINDS,
                    **dict.fromkeys(INTROSPECTION, "introspection"), "modules": "sys.modules",
                    "environ": "environment", "CDLL": "ctypes", "PyDLL": "ctypes", "pythonapi": "ctypes",
                    "dlopen": "ctypes", "getattr": "dynamic", "setattr": "dynamic", "__import__": "dynamic",
                    "import_module": "dynamic", "exec": "dynamic", "eval": "dynamic", "compile": "dynamic"}
# A path into the machine's shared places, as a string, however it was built: /proc, /sys (cgroups), /dev
# (shm, mem), /tmp, or a bare "proc"/"shm" to be joined to one.
# Also any absolute path or ".." (the rank's own folder is its working directory and TMPDIR), and the grader's
# own files by name.
PATH_WORDS = ("proc", "shm", "dev", "sys", "tmp", "cgroup", "/", "results.json", "audit.jsonl")
PATH_PATTERN = re.compile(r"(^|/)(proc|shm)(/|$)|(^|/)dev/|/dev$|/sys(/|$)|^sys/|/tmp(/|$)|^tmp/|cgroup|"
                          r"^/[\w.~-]|(^|/)\.\.(/|$)|results\.json|audit\.jsonl")


def name_kind(dotted: str) -> str | None:
    """The kind of a fully resolved dotted name (``os.fork``), or None."""
    if not dotted or dotted.startswith("<"):
        return None
    head, _, rest = dotted.partition(".")
    dotted = MODULE_SYNONYMS.get(head, head) + ("." + rest if rest else "")
    if dotted in DOTTED_KINDS:
        return DOTTED_KINDS[dotted]
    for prefix, kind in PREFIX_KINDS.items():
        if dotted.startswith(prefix):
            return kind
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        kind = MODULE_KINDS.get(".".join(parts[:n]))
        if kind:
            return kind
    return None


def string_kind(text: str, built: bool) -> str | None:
    """The kind of a string's content: a path into a shared place, a module or name the tables flag
    (``'ctypes:CDLL'`` for pkgutil.resolve_name), or for a built string any flagged name."""
    if any(word in text for word in PATH_WORDS) and PATH_PATTERN.search(text):
        return "path"
    if len(text) > 80:
        return None
    if text in DISTINCTIVE_STRINGS:
        return BUILT_NAME_KINDS.get(text, "introspection")
    if built and text in BUILT_NAME_KINDS:
        return BUILT_NAME_KINDS[text]
    if re.fullmatch(r"[A-Za-z_][\w.]*(:[\w.]+)?", text) and ("." in text or ":" in text or built):
        return name_kind(text.replace(":", "."))
    return None
