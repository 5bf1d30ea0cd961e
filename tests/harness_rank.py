"""The rank side (tests/harness.py's room for steps 2-4 as a rank lives them): everything here runs in a rank
process, forked from the forkserver. ``_rank_main`` is the rank's whole life (its session, lifeline, output and
stack files, its report down the pipe, its exit); ``_run_body`` sets up the environment, joins the default process
group, applies the limits (tests/rank_isolation.py), runs the body and meets the others at the closing barrier.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.harness_report import _LENGTH_BYTES, _first_line
from tests import rank_audit
from tests.rank_isolation import (apply_limits, close_inherited_fds, create_private, drop_privileges,
                                   explain_refusal, limits_note, redirect_output, trace_task_calls, watch_lifeline)

_body_code = None  # the body's code object, once found: where a rank's traceback starts


def _rank_main(config: dict, conn, lifeline, ack=None) -> None:
    """A rank's whole life. It never returns: it ends with os._exit, so no atexit handler or leftover thread
    of the body can keep it alive or change its exit code."""
    audit = config.get("audit")  # the audit channel's write end (tests/rank_audit.py)
    close_inherited_fds(keep={conn.fileno(), lifeline.fileno()} | ({ack.fileno()} if ack is not None else set())
                        | ({audit.fileno()} if audit is not None else set()))
    os.setsid()  # own process group: the parent kills it, and everything it spawns, with one killpg
    threading.Thread(target=watch_lifeline, args=(lifeline,), name="harness-lifeline", daemon=True).start()
    # Both files are created here, in the parent's directory (the rank user cannot write there), before the
    # rank drops privileges: the body writes through the descriptors and cannot replace the files.
    redirect_output(config["out_path"])
    stack_file = os.fdopen(create_private(config["stack_path"]), "w")
    import faulthandler
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults, aborts: stacks into the output file
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    if audit is not None:  # before the test module, and so any submission code, is imported (_find_body)
        rank_audit.install(audit.fileno(), config["audit_token"], config["rank_dir"])
    # The report is data for the parent to check, not a verdict: nothing here needs protecting from the body
    # (see the module docstring, step 4).
    fd = conn.fileno()
    try:
        message = {"kind": "result", "result": _run_body(config, _sendable, fd, ack)}
    except (_BadResult, _PeerLost, _GroupDestroyed) as e:  # the harness's own words; no traceback needed
        status = {_BadResult: "bad-result", _PeerLost: "peer-lost", _GroupDestroyed: "group-destroyed"}[type(e)]
        message = {"kind": "error", "status": status, "type": type(e).__name__, "message": str(e), "traceback": ""}
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: only a return counts
        text, note = str(e), explain_refusal(e) or limits_note(str(e))  # a call the grader refuses, a limit it sets
        if note:  # on the first line, which the failure message shows
            first, newline, rest = text.partition("\n")
            text = f"{first} ({note}){newline}{rest}"
        message = {"kind": "error", "status": "raised", "type": type(e).__name__, "message": text,
                   "traceback": _format_traceback(e)}
    rank_audit.finish()  # the audit's closing line, before the report: a channel that ends without it was silenced
    try:
        buf = io.BytesIO()
        torch.save(message, buf)
        data = memoryview(len(buf.getvalue()).to_bytes(_LENGTH_BYTES, "big") + buf.getvalue())
        while data:
            data = data[os.write(fd, data):]
    except BaseException:
        traceback.print_exc()
        code = 3
    else:
        code = 0 if message["kind"] == "result" else 1
    sys.stdout.flush()
    sys.stderr.flush()
    if ack is not None and code in (0, 1):
        # After a result or an error report alike (a witnessed run that fails is read to its end too: evidence
        # fails closed), the parent reads our kernel counters one last time, then lets us go (a byte, or EOF).
        try:
            os.read(ack.fileno(), 1)
        except OSError:
            pass
    os._exit(code)


def _run_body(config: dict, sendable, report_fd: int | None = None, ack=None):
    rank, world_size, backend = config["rank"], config["world_size"], config["backend"]
    # The parent's environment at the time of the call, plus what a rank needs. TMPDIR and HOME: the body's own
    # directory, removed with the run (nothing the body writes there outlives the test).
    os.environ.clear()
    os.environ.update(config["env"])
    body_tmp = os.path.join(config["rank_dir"], "tmp")
    os.environ.update(FSDP_RANK_PROCESS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      TMPDIR=body_tmp, HOME=body_tmp)
    tempfile.tempdir = None  # tempfile caches the directory it found first: look again
    torch.set_num_threads(1)  # 2 cores and up to 4 ranks: more threads only fight
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    device_id = None
    if backend == "nccl":  # one GPU per rank; device_id also makes NCCL connect now, not at first use
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    store = dist.FileStore(os.path.join(config["rank_dir"], "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device_id,
                            timeout=timedelta(seconds=config["collective_timeout"]))
    # Every rank connected before any body runs: else a fast rank could finish and exit while a slow one is
    # still connecting to it, and the slow one would fail for no fault of the body.
    dist.barrier()
    body = _find_body(config["body_ref"])
    global _body_code
    _body_code = getattr(body, "__code__", None)
    args = pickle.loads(config["args_blob"])
    if config.get("witnessed"):  # before the limits: the harness's own first use of torch counts against none
        _malloc_returns_big_blocks()
        _warm_up(world_size, device_id)
    apply_limits(config["memory_limit_bytes"], config.get("limits") or {})
    if config.get("run_as") is not None:  # last: the harness and the test module were set up as ourselves
        drop_privileges(*config["run_as"])
    if os.environ.get("FSDP_TRACE_TASK_CALLS"):  # staff/grader_selftest/measure_times.py: which task functions run
        trace_task_calls(os.environ["FSDP_TRACE_TASK_CALLS"])
    if config.get("witnessed") and report_fd is not None:
        # "The body starts now" (the memory baseline). We wait until the parent has read our resident memory: the
        # baseline is then exactly the body's start, however late a loaded parent gets to it.
        _ask_for_reading(report_fd, ack)
    result = body(rank, world_size, *args)
    result = sendable(result, "result")
    if not dist.is_initialized():
        raise _GroupDestroyed("returned without the default process group: the body (or code it called) "
                              "destroyed it (dist.destroy_process_group()), so its peers' collectives with this "
                              "rank could not finish; leave the default group to the harness")
    if config.get("witnessed") and report_fd is not None:
        _ask_for_reading(report_fd, ack)  # "the body returned": the parent reads our sockets while they are open
    try:
        dist.barrier()  # no rank tears down its connections while a peer may still be reading from them
    except Exception as e:
        raise _PeerLost(f"returned, then lost its peers at the closing barrier (another rank failed?): "
                        f"{_first_line(str(e))}") from None
    dist.destroy_process_group()
    return result


def _malloc_returns_big_blocks() -> None:
    """Make glibc give every block of MALLOC_MMAP_THRESHOLD_BYTES or more its own mapping, unmapped when freed, so
    that the kernel's resident memory follows the tensors alive (the Witness's readings). By default glibc raises
    that threshold after the first large free (up to 32 MiB), and keeps later blocks of a unit's size in its heap,
    where a freed one stays resident: a correct FSDP run would then look as if it never freed anything. At 1 MiB
    (issue 35) a unit of the tests' small models (0.07-0.2 MiB) still stayed in the heap, freed or kept (four
    200 KiB tensors: +0.96 MiB either way); at 64 KiB freed gives +0.16 MiB and kept +0.96 MiB (issue 40)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, MALLOC_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD (fixed: no dynamic adjustment)
        libc.mallopt(-1, 2 * MALLOC_MMAP_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD: return a freed heap top to the kernel
    except (OSError, AttributeError):
        pass


# Blocks of this size or more are their own mappings in a witnessed rank (_malloc_returns_big_blocks). What it
# costs, measured on tests/public/test_task4_backward.py (the staff's implementation, both thresholds side by
# side): see the commit that set it.
MALLOC_MMAP_THRESHOLD_BYTES = 64 << 10


def witness_mark() -> None:
    """A moment the test's body marks (called from the body, e.g. after a warm-up step, or where every unit must
    be resharded): the parent reads this rank's memory now (what it holds, and its peak since the last reading)
    before the body goes on, and the test's Witness bounds those readings (``Witness(marks=..., mark_bytes=...)``).
    Nothing happens in a rank the kernel does not watch. The parent counts the marks: a rank that asks for more or
    fewer readings than the test's body makes fails its witness."""
    if _reading_channel is not None:
        _ask_for_reading(*_reading_channel)


_reading_channel = None  # (report_fd, ack) of a witnessed rank, once its body starts (_ask_for_reading)


def _ask_for_reading(report_fd: int, ack) -> None:
    """An empty frame on the report pipe, then wait for the parent's byte: it has read our kernel counters."""
    global _reading_channel
    _reading_channel = (report_fd, ack)
    os.write(report_fd, bytes(_LENGTH_BYTES))
    if ack is not None:
        try:
            os.read(ack.fileno(), 1)
        except OSError:
            pass


def _warm_up(world_size: int, device) -> None:
    """What any body's first step allocates once in a fresh process, done before the memory baseline: the
    autograd engine and its thread, the first use of the kernels a transformer step runs (embedding, layer norm,
    linear, GELU, attention, cross-entropy, and their backward), and the first collective of each kind. Measured
    on a 2-layer GPT step sharded by FSDP (W=2, 8 runs): the body's peak above its baseline fell from 27.0-27.6
    MiB to 3.6-4.4 MiB; an empty body's from 1.0 to 0.7 MiB. Only torch runs here, never the test's code."""
    import torch.nn as nn
    import torch.nn.functional as F
    emb, ln, attn, proj, fc = nn.Embedding(8, 16), nn.LayerNorm(16), nn.Linear(16, 48), nn.Linear(16, 16), \
        nn.Linear(16, 64)
    with torch.enable_grad():
        ids = torch.arange(8).view(2, 4)
        x = emb(ids) + emb(torch.arange(4))
        q, k, v = (t.view(2, 4, 2, 8).transpose(1, 2) for t in attn(ln(x)).split(16, dim=2))
        x = x + proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 4, 16))
        x = x + F.linear(F.gelu(fc(ln(x))), fc.weight.t())
        F.cross_entropy(F.linear(ln(x), emb.weight).float().view(-1, 8), ids.view(-1)).backward()
    t = torch.ones(64 * world_size, device=device)
    with warnings.catch_warnings():  # torch's deprecation notes belong to the student's own calls, not to ours
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(torch.empty(64 * world_size * world_size, device=device), t)
        dist.reduce_scatter_tensor(torch.empty(64, device=device), t)
    dist.all_reduce(t)
    dist.broadcast(t, 0)


def _format_traceback(e: BaseException) -> str:
    """The traceback from the body's frame on, when the body is in it: the harness frames above say nothing
    about the test. (An error while setting up, before the body ran, keeps its whole traceback.)"""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _body_code:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb if tb is not None else e.__traceback__))


def _find_body(ref: dict):
    try:
        module = importlib.import_module(ref["module"])
    except ImportError:
        if not ref["filename"]:
            raise
        # pytest's importlib mode: the module is not importable by name, so load it from its file.
        spec = importlib.util.spec_from_file_location(ref["module"], ref["filename"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[ref["module"]] = module
        spec.loader.exec_module(module)
    found = module
    for part in ref["qualname"].split("."):
        found = getattr(found, part)
    return found


class _BadResult(TypeError):
    """The body's result cannot travel to the parent."""


class _PeerLost(RuntimeError):
    """The body returned, but a peer never reached the end: the peer's failure is the story, not this."""


class _GroupDestroyed(RuntimeError):
    """The body returned, but destroyed the default process group on the way: its peers could not finish."""


def _sendable(value, where: str):
    """The result as the parent will receive it, or _BadResult saying what is wrong and where."""
    if value is None or isinstance(value, torch.dtype):
        return value
    for plain in (bool, int, float, str):  # exactly these: a subclass (numpy.float64, an enum) would not load
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, torch.Tensor):
        # Detached, on CPU (the parent does not touch CUDA), compact (a view of a big buffer sends only
        # itself), and a plain tensor (a subclass could not be loaded safely).
        return value.detach().to("cpu").clone().as_subclass(torch.Tensor)
    if isinstance(value, torch.Size):
        return torch.Size(value)
    if isinstance(value, (list, tuple)):
        items = [_sendable(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise _BadResult(f"returned a dict with a key of type {type(k).__qualname__} at {where}: "
                                 f"keys must be str or int")
            out[k] = _sendable(v, f"{where}[{k!r}]")
        return out
    raise _BadResult(f"returned an object of type {type(value).__module__}.{type(value).__qualname__} at "
                     f"{where}: a body may return tensors, bool, int, float, str, None, torch.dtype, "
                     f"torch.Size, and lists, tuples and dicts of these")
