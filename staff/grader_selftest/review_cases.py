"""Evasion cases for the staff review (issue 36): ways a submission could reach into the grader or around the
process group that the review of issue 32 did not see. Each is a small task file (line 1 is ``import torch``)
and the (line, kind) flags the review must give it, lines as Python numbers them. tests/staff/test_review.py
holds every case, through ``review_source`` and through ``python -m staff.autograder.review`` on a zip; the
review of issue 32 flagged none of the first 27 (``ISSUE_36``) as expected.

A source given as bytes is a file as submitted (its coding cookie applies); a str is its text."""

from __future__ import annotations

UTF7_LIE = (b"# -*- coding: utf-7 -*-\n"
            b"import torch\n"
            b"# keep the default sizes+AAo-import sys+AAo-_caller = sys._getframe(1)+AAo-"
            b"torch.UntypedStorage.size = lambda self: 0\n"
            b"SIZES = (1, 2)\n")

# Issue 36's unflagged spellings: the 22 it names, rebuilt from their descriptions, and 5 close variants of them
# (an alias used before its line, a local ``import ... as``, ``from torch.utils import cpp_extension``, a
# traceback from sys.exc_info, ``getattr(os, name)``); the review of issue 32 flagged none of these 27.
ISSUE_36 = {
    "getattr(sys, '_get' + 'frame')": (
        "import torch\nimport sys\n\ndef caller():\n    return getattr(sys, '_get' + 'frame')(2)\n",
        {(5, "frame")}),
    "getattr(frame, 'f_' + 'locals')": (
        "import torch\n\ndef peek(frame):\n    return getattr(frame, 'f_' + 'locals')\n", {(4, "frame")}),
    "a traceback's frame through getattr": (
        "import torch\n\ndef peek():\n    try:\n        raise ValueError\n    except ValueError as err:\n"
        "        tb = err.__traceback__\n        return getattr(tb, 'tb_' + 'frame')\n",
        {(7, "frame"), (8, "frame")}),
    "a traceback's frame through getattr, from sys.exc_info": (
        "import torch\nimport sys\n\ndef peek():\n    tb = sys.exc_info()[2]\n    name = 'tb_frame'\n"
        "    return getattr(tb, name)\n",
        {(5, "frame"), (6, "frame"), (7, "frame")}),
    "module-level alias patch": (
        "import torch\n\n_US = torch.UntypedStorage\n_US.size = lambda self: 0\n", {(4, "patch")}),
    "module-level alias used in a function": (
        "import torch\n\ndef lie():\n    _US.nbytes = lambda self: 0\n\n_US = torch.UntypedStorage\n",
        {(4, "patch")}),
    "function-local alias of torch.distributed": (
        "import torch\n\ndef quiet():\n    d = torch.distributed\n    d.all_reduce = lambda *a, **k: None\n",
        {(5, "patch")}),
    "function-local import as": (
        "import torch\n\ndef quiet():\n    import torch.distributed as zz\n    zz.all_gather_into_tensor = print\n",
        {(5, "patch")}),
    "dist.all_reduce.__globals__[...] = ...": (
        "import torch\nimport torch.distributed as dist\n\ndef swap(fake):\n"
        "    dist.all_reduce.__globals__['_get_default_group'] = fake\n", {(5, "introspection")}),
    "setattr(type(group), '_record', f)": (
        "import torch\n\ndef mute(group, f):\n    setattr(type(group), '_record', f)\n", {(4, "patch"), (4, "harness")}),
    "getattr(sys, 'modules')": (
        "import torch\nimport sys\n\nMODS = getattr(sys, 'modules')\n", {(4, "sys.modules")}),
    "pkgutil.resolve_name('ctypes:CDLL')": (
        "import torch\nimport pkgutil\n\nCDLL = pkgutil.resolve_name('ctypes:CDLL')\n",
        {(2, "dynamic"), (4, "dynamic"), (4, "ctypes")}),
    "().__class__.__base__.__subclasses__()": (
        "import torch\n\nEVERY_CLASS = ().__class__.__base__.__subclasses__()\n", {(3, "introspection")}),
    "marshal.loads + types.FunctionType": (
        "import torch\nimport marshal\nimport types\n\ndef build(blob):\n"
        "    return types.FunctionType(marshal.loads(blob), {})\n", {(2, "dynamic"), (6, "dynamic")}),
    "pickle.loads": (
        "import torch\nimport pickle\n\ndef thaw(blob):\n    return pickle.loads(blob)\n", {(5, "dynamic")}),
    "torch.utils.cpp_extension.load_inline": (
        "import torch\n\ndef native():\n    return torch.utils.cpp_extension.load_inline('m', cpp_sources='')\n",
        {(4, "native")}),
    "from torch.utils import cpp_extension; load_inline": (
        "import torch\nfrom torch.utils import cpp_extension as ce\n\nM = ce.load_inline('m', cpp_sources='')\n",
        {(2, "native"), (4, "native")}),
    "import _socket": ("import torch\nimport _socket\n", {(2, "socket")}),
    "torch.from_file(shared=True)": (
        "import torch\n\ndef mapped(path):\n    return torch.from_file(path, shared=True, size=1 << 20)\n",
        {(4, "mmap")}),
    "numpy.memmap": (
        "import torch\nimport numpy as np\n\ndef mapped(name):\n    return np.memmap(name, mode='w+', shape=(4,))\n",
        {(5, "mmap")}),
    "'/' + 'proc'": (
        "import torch\n\ndef status(pid):\n    return open('/' + 'proc' + f'/{pid}/status').read()\n",
        {(4, "path")}),
    "os.path.join('/', 'proc')": (
        "import torch\nimport os\n\nSTATUS = os.path.join('/', 'pr' + 'oc', 'self', 'status')\n", {(4, "path")}),
    "an os.environb edit": (
        "import torch\nimport os\n\nos.environb[b'FSDP_IMPL'] = b'reference'\n", {(4, "environment")}),
    "getattr(os, 'fork')": ("import torch\nimport os\n\nPID = getattr(os, 'fork')()\n", {(4, "process")}),
    "os.pidfd_open": (
        "import torch\nimport os\n\ndef watch(pid):\n    return os.pidfd_open(pid)\n", {(5, "signal")}),
    "getattr(os, name)": (
        "import torch\nimport os\n\ndef call(name):\n    return getattr(os, name)()\n", {(5, "dynamic")}),
    "the UTF-7 cookie": (
        UTF7_LIE, {(1, "encoding"), (4, "encoding"), (5, "encoding"), (5, "frame"), (6, "encoding"),
                   (6, "patch")}),
}

# More spellings of the same accesses (issue 36's "Build" list), each flagged with its line.
MORE = {
    "a name joined from pieces": (
        "import torch\nimport sys\n\nNAME = ''.join(['_get', 'frame'])\nFRAME = getattr(sys, NAME)\n",
        {(4, "frame"), (5, "frame")}),
    "a name built at run time on any object": (
        "import torch\n\ndef peek(obj, a, b):\n    return getattr(obj, a + b)\n", {(4, "dynamic")}),
    "setattr on a module with a computed name": (
        "import torch\nimport torch.distributed as dist\n\ndef swap(name, f):\n    setattr(dist, name, f)\n",
        {(5, "patch")}),
    "a dunder through hasattr": (
        "import torch\n\ndef has(f):\n    return hasattr(f, '__wrapped__')\n", {(4, "introspection")}),
    "chr-built path": (
        "import torch\n\ndef maps():\n    return open(chr(47) + 'proc/self/maps').read()\n", {(4, "path")}),
    "a reversed string": ("import torch\n\nP = '/' + 'corp'[::-1]\n", {(3, "path")}),
    "bytes decoded": ("import torch\n\nP = bytes([47, 112, 114, 111, 99]).decode()\n", {(3, "path")}),
    "an f-string path": ("import torch\n\nSHM = f'/dev/{\"shm\"}/x'\n", {(3, "path")}),
    "open of a path built at run time": (
        "import torch\nfrom pathlib import Path\n\ndef read(where):\n    return Path(where).read_text()\n",
        {(5, "path")}),
    "sys/fs/cgroup": ("import torch\n\nCG = 'sys/fs/cgroup/memory.max'\n", {(3, "path")}),
    "posix.fork": ("import torch\nimport posix\n\nposix.fork()\n", {(4, "process")}),
    "from os import fork as harmless": (
        "import torch\nfrom os import fork as harmless\n\nharmless()\n", {(2, "process"), (4, "process")}),
    "os.kill via an alias": (
        "import torch\nimport os\n\nk = os.kill\nk(os.getppid(), 9)\n", {(4, "signal"), (5, "signal")}),
    "os.register_at_fork": (
        "import torch\nimport os\n\nos.register_at_fork(after_in_child=print)\n", {(4, "process")}),
    "signal.pthread_kill": (
        "import torch\nimport signal\nimport threading\n\n"
        "signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)\n", {(2, "signal"), (5, "signal")}),
    "os.putenv": ("import torch\nimport os\n\nos.putenv('FSDP_IMPL', 'reference')\n", {(4, "environment")}),
    "sys.addaudithook": (
        "import torch\nimport sys\n\nsys.addaudithook(lambda event, args: None)\n", {(4, "audit")}),
    "sys.settrace through an alias": (
        "import torch\nimport sys\n\nt = sys.settrace\nt(print)\n", {(4, "frame"), (5, "frame")}),
    "threading.settrace": ("import torch\nimport threading\n\nthreading.settrace(print)\n", {(4, "frame")}),
    "sys._current_frames": (
        "import torch\nimport sys\n\nFRAMES = sys._current_frames()\n", {(4, "frame")}),
    "inspect frames": (
        "import torch\nimport inspect\n\ndef up():\n    return inspect.stack()[1].frame\n", {(5, "frame")}),
    "traceback frames": (
        "import torch\nimport traceback\n\nSTACK = traceback.extract_stack()\n", {(4, "frame")}),
    "gc introspection": (
        "import torch\nimport gc\n\ndef groups():\n    return gc.get_referrers(torch.distributed)\n", {(5, "gc")}),
    "vars()": ("import torch\n\nNAMES = vars()\n", {(3, "introspection")}),
    "globals() edited": ("import torch\n\nglobals()['torch'] = None\n", {(3, "introspection")}),
    "getattr of a builtin alias": (
        "import torch\nimport sys\n\ng = getattr\nF = g(sys, '_getframe')\n", {(5, "frame")}),
    "object.__setattr__ on a module": (
        "import torch\nimport torch.distributed as dist\n\nobject.__setattr__(dist, 'barrier', print)\n",
        {(4, "patch")}),
    "type(group)._record = f": (
        "import torch\n\ndef mute(group, f):\n    type(group)._record = f\n", {(4, "patch"), (4, "harness")}),
    "group.__class__._record = f": (
        "import torch\n\ndef mute(group, f):\n    group.__class__._record = f\n", {(4, "patch"), (4, "harness")}),
    "a module from sys.modules, patched": (
        "import torch\nimport sys\n\nd = sys.modules['torch.distributed']\nd.all_reduce = print\n",
        {(4, "sys.modules"), (5, "patch")}),
    "a module from importlib, patched": (
        "import torch\nimport importlib\n\nd = importlib.import_module('torch.distributed')\nd.barrier = print\n",
        {(2, "dynamic"), (4, "dynamic"), (5, "patch")}),
    "operator.attrgetter": (
        "import torch\nimport operator\n\nUP = operator.attrgetter('f_back.f_locals')\n", {(4, "frame")}),
    "the module's __dict__": (
        "import torch\n\ntorch.distributed.__dict__['all_reduce'] = print\n", {(3, "patch")}),
    "a function's __code__": (
        "import torch\n\ndef swap(f, g):\n    f.__code__ = g.__code__\n", {(4, "introspection")}),
    "torch.ops.load_library": ("import torch\n\ntorch.ops.load_library('/tmp/x.so')\n", {(3, "native"), (3, "path")}),
    "import _posixshmem": ("import torch\nimport _posixshmem\n", {(2, "mmap")}),
    "import copyreg": ("import torch\nimport copyreg\n", {(2, "dynamic")}),
    "UntypedStorage.from_file": (
        "import torch\n\ndef mapped(name):\n    return torch.UntypedStorage.from_file(name, True, 64)\n",
        {(4, "mmap")}),
    "a torch patch through a class walk": (
        "import torch\n\ndef lie(t):\n    type(t).__mro__[1].size = lambda self: 0\n",
        {(4, "patch")}),  # (issue 40: reading __mro__ is honest; what is assigned on a class it reaches is a patch)
    "fullwidth identifier": (
        "import torch\nimport sys\n\nF = \uff53\uff59\uff53._getframe(0)\n", {(4, "display"), (4, "frame")}),
    "a bidirectional control": (
        "import torch\n\nACCESS = 'user'  # \u202e \u2066// check admin\u2069 \u2066\n", {(3, "display")}),
    "a zero-width space in a name string": (
        "import torch\n\nX = 'all\u200breduce'\n", {(3, "display")}),
    "a lone carriage return hides a line": (
        b"import torch\nSIZE = 1  # the default\rimport ctypes\n", {(3, "display"), (3, "ctypes")}),
    "a form feed inside a line": (
        "import torch\nSIZE = 1 \x0c # page\n", {(2, "display")}),
    "a line separator in a comment": (
        "import torch\n# note\u2028import ctypes\n", {(2, "display")}),
    "a file Python cannot decode": (
        b"# -*- coding: utf-8 -*-\nimport torch\nX = '\xff'\n", {(3, "encoding")}),
    "an unknown coding cookie": (
        b"# coding: rot13\nimport torch\n", {(1, "encoding")}),
    "a latin-1 cookie": (
        b"# -*- coding: latin-1 -*-\nimport torch\nX = '\xe9'\n", {(1, "encoding")}),
}

MORE["breakpoint()"] = ("import torch\n\ndef stop():\n    breakpoint()\n", {(4, "frame")})
MORE["nn.Module.__setattr__ on a class of torch"] = (
    "import torch\nimport torch.nn as nn\n\nnn.Module.__setattr__(nn.Linear, 'forward', print)\n", {(4, "patch")})

MORE["CRLF line ends"] = (b"import torch\r\nimport sys\r\n\r\nF = sys._getframe()\r\n", {(4, "frame")})
MORE["a UTF-8 BOM"] = (b"\xef\xbb\xbfimport torch\nimport ctypes\n", {(2, "ctypes")})

MORE["a module held in an object's attribute"] = (
    "import torch\n\nclass Quiet:\n    def __init__(self):\n        self.d = torch.distributed\n\n"
    "    def mute(self):\n        self.d.all_reduce = print\n", {(8, "patch")})
MORE["a loop over modules"] = (
    "import torch\nimport torch.distributed as dist\n\nfor m in (dist, torch.Tensor):\n    m.x = print\n",
    {(5, "patch")})
MORE["a module picked out of a literal"] = (
    "import torch\nimport torch.distributed as dist\n\n(dist,)[0].barrier = print\n", {(4, "patch")})
MORE["setattr passed on"] = (
    "import torch\nimport functools\nimport torch.distributed as dist\n\n"
    "functools.partial(setattr, dist)('barrier', print)\n", {(5, "dynamic")})
MORE["setattr with unpacked arguments"] = (
    "import torch\nimport torch.distributed as dist\n\nARGS = [dist, 'barrier', print]\nsetattr(*ARGS)\n",
    {(5, "dynamic")})
MORE["a path in bytes"] = ("import torch\n\nFD = open(b'/proc/self/mem', 'rb')\n", {(3, "path")})

MORE["the audit's descriptor replaced"] = (
    "import torch\nimport os\n\nos.dup2(os.open(os.devnull, os.O_WRONLY), 3)\n", {(4, "audit"), (4, "path")})

MORE["builtins.setattr"] = (
    "import torch\nimport builtins\nimport torch.distributed as dist\n\nbuiltins.setattr(dist, 'barrier', print)\n",
    {(2, "patch"), (5, "patch")})
MORE["a path joined with /"] = (
    "import torch\nfrom pathlib import Path\n\nMEM = Path('/') / 'sys' / 'kernel' / 'mm'\n", {(4, "path")})
MORE["a report forged on a descriptor"] = (
    "import torch\n\ndef forge():\n    with open(3, 'w') as out:\n        out.write('passed')\n", {(4, "audit")})
MORE["an operator registration"] = (
    "import torch\n\nLIB = torch.library.Library('c10d', 'IMPL')\n", {(3, "patch")})
MORE["an exit hook"] = ("import torch\nimport atexit\n\natexit.register(print)\n", {(2, "process")})

MORE["a module returned by a function"] = (
    "import torch\nimport torch.distributed as dist\n\ndef m():\n    return dist\n\nm().barrier = print\n",
    {(7, "patch")})
MORE["a module held by a class"] = (
    "import torch\n\nclass C:\n    d = torch.distributed\n\nC.d.barrier = print\n", {(6, "patch")})
MORE["a module set with setattr, patched later"] = (
    "import torch\n\ndef keep(obj):\n    setattr(obj, 'd', torch.distributed)\n    obj.d.barrier = print\n",
    {(5, "patch")})
MORE["unittest.mock.patch"] = (
    "import torch\nfrom unittest import mock\n\nP = mock.patch('torch.distributed.all_reduce', print)\n",
    {(2, "patch")})
MORE["the grader's results by a relative path"] = (
    "import torch\n\nwith open('../../results/results.json', 'w') as f:\n    f.write('{}')\n", {(3, "path")})
MORE["an absolute path"] = ("import torch\n\nLOG = '/autograder/results/log'\n", {(3, "path")})

MORE["sys.path edited"] = (
    "import torch\nimport os\nimport sys\n\nsys.path.insert(0, os.getcwd())\nsys.path[:] = ['/tmp']\n",
    {(5, "dynamic"), (6, "dynamic"), (6, "path")})
MORE["an import hook"] = ("import torch\nimport sys\n\nsys.meta_path.insert(0, object())\n", {(4, "dynamic")})
MORE["terminal escapes in a message"] = (
    "import torch\n\ndef fail():\n    raise RuntimeError('x\\x1b[2K\\x1b[32m PASSED\\r1 passed')\n", {(4, "display")})

# Honest idioms from the reference, the stubs and the staff alternatives, and ones like them: none is flagged.
HONEST = '''\
"""Shards a module's parameters over the process group (the docs of torch.distributed.fsdp)."""
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import all_gather_into_tensor

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FSDP_CLASSES = {}


def set_params(module, views):
    for name, sub in module.named_modules():
        unit = getattr(sub, "_fsdp_unit", None)
        if not hasattr(sub, "reset_parameters"):
            raise TypeError(f"{type(sub).__name__} owns meta parameters; rank {dist.get_rank()} of the group")
        for attr in ("weight", "bias"):
            setattr(sub, attr, views[attr])
            getattr(sub, attr)


def swap_class(module):
    cls = type(module)
    module.__class__ = _FSDP_CLASSES.setdefault(cls, type(f"FSDP{cls.__name__}", (nn.Module, cls), {}))
    return cls.__bases__[-1].__name__


def f(module, dist_group, sub, attr, views, x):
    module.forward = lambda x: x
    setattr(sub, attr, views[attr])
    dist.all_reduce(torch.ones(1), group=dist_group)
    all_gather_into_tensor(torch.ones(2), torch.ones(1))
    return type(x)(v for v in x)


def g(dist):
    dist.x = 1  # a parameter named like the module: not the module


def own_dunder(module):
    return getattr(module, "__fsdp_state__", None)  # a name of the submission's own, spelt as a dunder


def h(module, name, tensor):
    nn.Module.__setattr__(module, name, tensor)  # past nn.Module's own __setattr__: a plain tensor attribute
    object.__setattr__(module, "_fsdp_state", None)
    if os.environ.get("FSDP_DEBUG"):
        print(f"rank {dist.get_rank()}: {name} of {module.__class__.__name__} in {os.getpid()}")


REF = weakref.WeakKeyDictionary()
'''

# Issue 40 (item 6): the review no longer flags honest FSDP idioms (``__dict__`` of the submission's own objects,
# ``__mro__`` read, ``getattr(torch.optim, name)``, a built name that cannot spell a flagged one, the tests'
# private names where the submission defines them). Each narrowing keeps what reaches the grader's objects flagged.
ISSUE_40 = {
    "a patch on each class of a walk": (
        "import torch\n\ndef lie(t):\n    for base in type(t).__mro__:\n        base.size = lambda self: 0\n",
        {(5, "patch")}),
    "a class's bases replaced": (
        "import torch\n\ndef rebase(cls):\n    cls.__bases__ = (object,)\n", {(4, "patch")}),
    "a module's namespace read": (
        "import torch\n\nNS = torch.distributed.__dict__\n", {(3, "patch")}),
    "vars() of a module": ("import torch\nimport torch.distributed as dist\n\nNS = vars(dist)\n", {(4, "patch")}),
    "the tests' counter through an object's __dict__": (
        "import torch\n\ndef mute(group, f):\n    group.__dict__['_record'] = f\n", {(4, "harness")}),
    "the tests' log through vars()": (
        "import torch\n\ndef peek(work):\n    return vars(work).get('_log')\n", {(4, "harness")}),
    "a private name set on someone else's object": (
        "import torch\n\ndef forge(work, fake):\n    work._log = fake\n    return work._log._pending\n",
        {(4, "harness"), (5, "harness")}),
    "a built name that can spell a frame's attribute": (
        "import torch\n\ndef peek(frame, which):\n    return getattr(frame, 'f_' + which)\n", {(4, "dynamic")}),
    "a built name that can spell the tests' private name": (
        "import torch\n\ndef peek(work, which):\n    return getattr(work, f'_{which}')\n", {(4, "dynamic")}),
    "getattr(torch, name)": ("import torch\n\ndef pick(name):\n    return getattr(torch, name)\n", {(4, "dynamic")}),
    "setattr(torch.optim, name, f)": (
        "import torch\n\ndef swap(name, f):\n    setattr(torch.optim, name, f)\n", {(4, "patch")}),
}
