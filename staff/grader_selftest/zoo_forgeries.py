"""The code some zoo cases (zoo.py) append to a task file: forgeries of the grader's results and of a rank's
report, and the stubs forgery of issue 18 in three variants. Data only (each a string of Python source), kept
apart from the cases so that zoo.py reads as the list of cases.

Staff-only, like the zoo: never in the bundle or the release.
"""

ISSUE14_HELPERS = '''

def _zoo_forge_pass():
    """Zoo: the forgery of issue 14, item 3."""
    import io as _io, os as _os, sys as _sys
    frame = _sys._getframe()
    nonce = conn = None
    while frame is not None:
        config = frame.f_locals.get("config")
        if isinstance(config, dict) and "nonce" in config:
            nonce = config["nonce"]
        if hasattr(frame.f_locals.get("conn"), "send_bytes"):
            conn = frame.f_locals["conn"]
        frame = frame.f_back
    if conn is not None:
        buf = _io.BytesIO()
        torch.save({"nonce": nonce, "status": "ok", "result": None}, buf)
        try:
            conn.send_bytes(buf.getvalue())
        except OSError:
            pass
    _os._exit(0)


def _zoo_swap_output(how):
    """Zoo: point this rank's output at a hidden test module (or make it a FIFO), then fail, so that the grader
    reads the output back into a visible message."""
    import os as _os
    hidden = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", "tests", "hidden",
                           "test_task7_hidden.py")
    out = _os.readlink("/proc/self/fd/1")
    try:
        _os.unlink(out)
        if how == "fifo":
            _os.mkfifo(out)
        else:
            _os.symlink(_os.path.normpath(hidden), out)
    except OSError as err:
        print(f"zoo: could not swap the output: {err}")
    raise RuntimeError(f"zoo: swapped its output for a {how}")
'''

FORGE = '''

def _zoo_forge():
    """Zoo: overwrite the grader's results with full marks (where it can)."""
    import json as _json, os as _os
    path = _os.environ.get("FSDP_ZOO_RESULTS")
    if path:
        try:
            with open(path, "w") as f:
                _json.dump({"score": 1000.0, "output": "forged", "tests": []}, f)
        except OSError:
            pass
'''

# Issue 18: the stubs forgery. A stub submission that claims success with the single-process, data-parallel
# answer: it re-runs the test's body on an unsharded API and makes that the rank's report, three ways.
STUB_FORGERY = '''

# ---- zoo: the stubs forgery (issue 18 item 1) -------------------------------------------------------------
_ZOO_VARIANT = "{variant}"


def _zoo_single_process_api():
    """Point adapters' integration API at single-process, data-parallel code (nothing sharded)."""
    import sys as _sys
    import torch as _t
    import torch.distributed as _d
    adapters = _sys.modules["adapters"]

    def average(params):
        for p in params:
            if p.grad is not None and not getattr(p.grad, "_zoo_avg", False):
                _d.all_reduce(p.grad, op=_d.ReduceOp.AVG)
                p.grad._zoo_avg = True

    def get_sharded_optimizer(module, optimizer_cls, **kwargs):
        params = [p for p in module.parameters() if p.requires_grad]
        opt = optimizer_cls(params, **kwargs)
        step = opt.step

        def averaged_step(*a, **k):
            average(params)
            return step(*a, **k)
        opt.step = averaged_step
        return opt

    def clip_grad_norm_(module, max_norm):
        params = [p for p in module.parameters() if p.grad is not None]
        average(params)
        return _t.nn.utils.clip_grad_norm_(params, max_norm)

    adapters.fully_shard = lambda module, **kw: module
    adapters.gather_full_params = lambda module: {n: p.detach().clone()
                                                  for n, p in module.named_parameters(remove_duplicate=False)}
    adapters.get_sharded_optimizer = get_sharded_optimizer
    adapters.clip_grad_norm_ = clip_grad_norm_


def _zoo_run_body_single_process():
    """The body of the run this rank is in, re-run on the single-process API: (rank, result) or None."""
    import pickle as _pickle
    import sys as _sys
    f = _sys._getframe()
    while f is not None and not isinstance(f.f_locals.get("config"), dict):
        f = f.f_back
    if f is None:
        return None
    config = f.f_locals["config"]
    harness = _sys.modules.get("tests.harness") or _sys.modules.get("harness")
    _zoo_single_process_api()
    body = harness._find_body(config["body_ref"])
    return body(config["rank"], config["world_size"], *_pickle.loads(config["args_blob"]))


def _zoo_report(result):
    import io as _io
    import torch as _t
    buf = _io.BytesIO()
    _t.save({"kind": "result", "status": "ok", "result": result}, buf)
    return buf.getvalue()


def _zoo_result_fds():
    """The harness's result pipe: a local of its rank main (or, failing that, every write-only pipe)."""
    import os as _os
    import sys as _sys
    f = _sys._getframe()
    while f is not None:
        conn = f.f_locals.get("conn")
        if hasattr(conn, "fileno"):
            try:
                return [conn.fileno()]
            except (OSError, ValueError):
                pass
        f = f.f_back
    fds = []
    for name in _os.listdir("/proc/self/fd"):
        try:
            with open(f"/proc/self/fdinfo/{name}") as info:
                flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
            if _os.readlink(f"/proc/self/fd/{name}").startswith("pipe:") and flags & 3 == 1:
                fds.append(int(name))
        except (OSError, StopIteration, ValueError):
            pass
    return fds


def _zoo_install():
    import os as _os
    import sys as _sys
    if _sys.modules.get("_zoo_installed"):
        return
    _sys.modules["_zoo_installed"] = _sys
    if _ZOO_VARIANT == "save":
        # Variant 1: wrap torch.serialization._save, which the harness's own report goes through, and turn a
        # failed report into a success carrying the single-process answer.
        import torch.serialization as _ser
        real = _ser._save
        real_exit = _os._exit
        _os._exit = lambda code: real_exit(0)  # and the exit code the harness picks after a failure

        def _save(obj, *a, **k):
            if isinstance(obj, dict) and (obj.get("status") not in (None, "ok") or obj.get("kind") == "error"):
                try:
                    result = _zoo_run_body_single_process()
                    obj = {"kind": "result", "status": "ok", "result": result}
                except BaseException:
                    pass
            return real(obj, *a, **k)
        _ser._save = _save
        return
    # Variants 2 and 3: compute the answer now and write a report straight into the result pipe, then leave.
    # (Against the old harness they first had to read the guard's nonce from the heap: numpy's
    # __array_interface__, or ctypes in a subinterpreter, where the audit hook does not look.)
    length_prefixed = None
    try:
        payload = _zoo_report(_zoo_run_body_single_process())
        length_prefixed = len(payload).to_bytes(8, "big") + payload
    except BaseException:
        return
    for fd in _zoo_result_fds():
        if _ZOO_VARIANT == "pipe":
            try:
                _os.write(fd, length_prefixed)
            except OSError:
                pass
        else:  # "subinterpreter": ctypes' write(2), from a subinterpreter
            import _xxsubinterpreters as _interp
            interp = _interp.create()
            code = ("import ctypes\\n"
                    f"data = {length_prefixed!r}\\n"
                    f"ctypes.CDLL(None).write({fd}, data, len(data))\\n")
            try:
                _interp.run_string(interp, code)
            except Exception:
                pass
    _sys.stdout.flush()
    _os._exit(0)


_zoo_install()
'''


# Issue 25's red team: what the deep_tree, detached_daemon and hidden_shared_memory cases append (zoo.py).
RED_TEAM_HELPERS = '''

def _zoo_deep_tree():
    """Zoo (issue 25): a 1,500-deep folder tree under /tmp, once a process."""
    import os as _os
    if _os.environ.get("_ZOO_DEEP_TREE"):
        return
    _os.environ["_ZOO_DEEP_TREE"] = "1"
    fd = _os.open("/tmp", _os.O_RDONLY | _os.O_DIRECTORY)
    name = f"zoo-deep-{_os.getpid()}"
    for _ in range(1500):
        _os.mkdir(name, dir_fd=fd)
        child = _os.open(name, _os.O_RDONLY | _os.O_DIRECTORY, dir_fd=fd)
        _os.close(fd)
        fd, name = child, "d"
    _os.close(fd)


def _zoo_daemon():
    """Zoo (issue 25): rank 0 leaves a daemon that, once the rank has ended, SIGKILLs every process of its user
    for two minutes (kill(-1) as an unprivileged user: only that user's processes). Never as root."""
    import os as _os, signal as _signal, time as _time
    if _os.environ.get("_ZOO_DAEMON") or dist.get_rank() != 0 or _os.getuid() == 0:
        return
    _os.environ["_ZOO_DAEMON"] = "1"
    rank = _os.getpid()
    if _os.fork() == 0:
        _os.setsid()
        if _os.fork() == 0:
            try:
                while _os.path.exists(f"/proc/{rank}"):
                    _time.sleep(0.01)
                end = _time.monotonic() + 120
                while _time.monotonic() < end:
                    try:
                        _os.kill(-1, _signal.SIGKILL)
                    except OSError:
                        pass
                    _time.sleep(0.005)
            finally:
                _os._exit(0)
        _os._exit(0)
    _os.waitpid(-1, 0)


def _zoo_hidden_shm():
    """Zoo (issue 25): 1.2 GiB in files without a name (memfd, or /dev/shm files unlinked at once), held."""
    import os as _os, time as _time
    fds = []
    for i in range(6):
        try:
            fd = _os.memfd_create("zoo")
        except OSError:  # refused in a graded rank (seccomp)
            path = f"/dev/shm/zoo-{_os.getpid()}-{i}"
            fd = _os.open(path, _os.O_RDWR | _os.O_CREAT | _os.O_EXCL, 0o600)
            _os.unlink(path)
        for _ in range(20):
            _os.write(fd, b"x" * (10 << 20))
        fds.append(fd)
    _time.sleep(30)  # while the grader counts
'''
