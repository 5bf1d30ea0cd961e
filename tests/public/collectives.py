"""Counted, late-finishing collectives for the tests (rank-side test code, not a task).

    from tests.public.collectives import use_counted_collectives

    def _body(rank, world_size):
        log = use_counted_collectives(late=True)   # every rank, first thing in the body
        ...adapters.fully_shard(...)...             # the code under test uses torch.distributed as usual
        before = log.mark()
        loss.backward()
        return log.since(before)                    # what backward communicated, call by call

``use_counted_collectives`` replaces the default process group by a Python ``ProcessGroup`` that wraps a
real gloo group of the same ranks. Every collective issued on it, however the code calls it
(``dist.all_gather_into_tensor`` or ``dist.all_gather_single``, imported by name or looked up at call time, on
the default group or on a group made with ``dist.new_group``), is recorded: its kind, the number of elements
and dtype of the tensor it moves per rank, and whether the caller asked for ``async_op``. Tests count these
records; they never depend on how an implementation is written.

With ``late=True`` the collectives also finish *late*, the way they do on a GPU: the caller's output (for
all-reduce, the in-place tensor) holds NaN until the work handle's ``wait()`` is called (or
``get_future()`` / ``is_completed()``), and only then receives the result. gloo on a CPU usually finishes
a collective before the caller looks at the output, so code that uses an asynchronous result without
waiting for its handle passes by luck there; here it computes with NaN and the test's numbers are wrong.
A synchronous call (``async_op=False``) is waited on by torch.distributed itself, so it is unaffected.
``log.unwaited()`` lists the late collectives whose handle nobody has waited on yet: when backward returns
there must be none (a buffer freed or reused while its collective may still write into it is, on a GPU, memory
corrupted at random; tests/public/invariants.py checks it).

Whatever a late collective reads must stay alive until its ``wait()``: on a GPU the collective reads its input
later, so an input freed (or its storage resized to 0) before the wait is a use-after-free that corrupts memory at
random. The handles here keep what gloo's own handles keep (an all-gather's and an all-reduce's tensors) and no
more: gloo's ``reduce_scatter_tensor(async_op=True)`` does not hold its input, and neither does this one.
``log.freed_before_wait()`` lists the late collectives whose input was freed before their wait.

Only gloo is wrapped (the autograder's backend). Under NCCL the default group is left alone and
``use_counted_collectives`` returns None: tests then skip their counting checks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

BACKEND_NAME = "fsdp_test_counted"

# The kinds a record may have. An all-gather (reduce-scatter) into a list of tensors is recorded as "all_gather"
# ("reduce_scatter") too: the tests count what moves, not how the call is spelled.
GATHERS = ("all_gather",)
REDUCTIONS = ("reduce_scatter", "all_reduce", "reduce")


@dataclass(frozen=True)
class Call:
    kind: str        # all_gather, reduce_scatter, all_reduce, broadcast, barrier, reduce, gather, ...
    numel: int       # elements of the tensor each rank contributes (all-gather: its input; reduce: its input)
    dtype: str       # that tensor's dtype, e.g. "torch.float32"
    async_op: bool   # did the caller ask for an asynchronous handle?
    group_size: int = 0  # ranks in the process group it ran on (HSDP: the shard or the replicate group)


class CallLog:
    """The records of one rank, in issue order. ``mark()``/``since(mark)`` cut out a window."""

    def __init__(self):
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # indices in calls of the late collectives not waited on yet
        self._freed: list[dict] = []     # late collectives whose input was gone at their wait (freed_before_wait)
        # Optional: called as listener(call, output, sent) when a call is issued: ``output`` is the tensor the
        # caller receives the result in, ``sent`` the tensor this rank contributes (the first, for the list forms;
        # each None for calls without one). Tests tell which unit an all-gather is for by what it sends (``gathered_unit``), never by the
        # buffer it writes into: gathering into a list of shards and copying is as correct as gathering in place.
        self.listener = None

    def add(self, call: Call, output: torch.Tensor | None = None, sent: torch.Tensor | None = None) -> None:
        with self._lock:
            self.calls.append(call)
        if self.listener is not None:
            self.listener(call, output, sent)

    def mark(self) -> int:
        return len(self.calls)

    def unwaited(self, since: int = 0) -> list[dict]:
        """The late collectives issued from ``mark`` ``since`` on and not yet waited on (handle dropped, or still
        in flight), oldest first."""
        with self._lock:
            picked = sorted(i for i in self._pending if i >= since)
        return [dict(kind=self.calls[i].kind, numel=self.calls[i].numel, dtype=self.calls[i].dtype, index=i)
                for i in picked]

    def freed_before_wait(self, since: int = 0) -> list[dict]:
        """The late collectives issued from ``mark`` ``since`` on whose input (what the collective reads) was freed,
        or its storage shrunk, before their handle was waited on: on a GPU the collective would have read freed
        memory. Each: kind, numel, dtype, index (in issue order) and ``how`` ("freed" or "storage resized")."""
        with self._lock:
            return [dict(f) for f in self._freed if f["index"] >= since]

    def since(self, mark: int = 0) -> list[dict]:
        """The records from ``mark`` on, as plain dicts (they travel back to the test)."""
        return [dict(kind=c.kind, numel=c.numel, dtype=c.dtype, async_op=c.async_op, group_size=c.group_size)
                for c in self.calls[mark:]]


def gathered_unit(sent: torch.Tensor | None, units: dict):
    """The key in ``units`` (name -> FSDPUnit) of the unit whose FlatParameter shard an all-gather sends: the
    one whose ``shard`` (in the tensor's dtype and device) equals ``sent``, element for element; None when no
    unit's does, or when several do (the test cannot tell them apart). This is what every correct unshard
    sends, whatever it gathers into; called from a listener, when the call is issued, before anything moves."""
    if sent is None:
        return None
    sent = sent.detach().reshape(-1)
    found = [name for name, unit in units.items() for fp in unit.flat_params
             if fp.shard.numel() == sent.numel()
             and torch.equal(fp.shard.detach().to(device=sent.device, dtype=sent.dtype), sent)]
    return found[0] if len(set(found)) == 1 else None


class _LateWork(dist._Work):
    """The handle of a collective whose result reaches the caller's tensors only when it is waited on."""

    def __init__(self, inner, finish, log: CallLog, reads=(), keep=()):
        super().__init__()
        self._inner, self._finish, self._done, self._log = inner, finish, False, log
        self._lock = threading.Lock()
        # What the collective reads, watched by a weak handle (StorageWeakRef: it keeps nothing alive), with the
        # bytes it needs; and what the handle holds on purpose (``keep``: what gloo's own handle of this kind holds).
        self._reads = [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in reads]
        self._keep = list(keep)
        with log._lock:
            self._index = len(log.calls) - 1  # the call recorded just before its handle is made: this one
            log._pending.add(self._index)

    def _check_reads(self) -> None:
        how = next(("freed" if ref.expired() else "storage resized"
                    for ref, nbytes in self._reads
                    if ref.expired() or torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes() < nbytes), None)
        if how is not None:
            call = self._log.calls[self._index]
            with self._log._lock:
                self._log._freed.append(dict(kind=call.kind, numel=call.numel, dtype=call.dtype, index=self._index,
                                             how=how))

    def _complete(self) -> None:
        with self._lock:
            if not self._done:
                self._check_reads()
                self._keep = []
                self._inner.wait()
                with _disable_current_modes(), torch.no_grad():
                    self._finish()
                self._done = True
                with self._log._lock:
                    self._log._pending.discard(self._index)

    def wait(self, timeout=None) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        self._complete()
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        self._complete()

    def get_future(self):
        self._complete()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class CountedProcessGroup(dist.ProcessGroup):
    """A Python process group over a real gloo group: records every call; with ``late``, delays results."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, log: CallLog, late: bool):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("counted-inner", store), rank, size, timeout)
        self.log, self.late = log, late

    # The trampoline of a Python ProcessGroup asks for these by name (DeviceMesh, hence torch's FSDP2, needs them).
    _group_name, _group_desc = "", ""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def name(self) -> str:
        return BACKEND_NAME

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _record(self, kind: str, tensor: torch.Tensor | None, opts, output: torch.Tensor | None = None,
                numel: int | None = None) -> None:
        numel = numel if numel is not None else int(tensor.numel()) if tensor is not None else 0
        dtype = str(tensor.dtype) if tensor is not None else ""
        self.log.add(Call(kind, numel, dtype, bool(getattr(opts, "asyncOp", True)), self.size()), output, tensor)

    def _late(self, outputs: list[torch.Tensor], run, reads=(), keep=()):
        """Run the real collective into private copies of ``outputs``; poison ``outputs`` until wait(). ``reads``:
        the tensors the collective reads, checked to be still alive at wait(); ``keep``: those the handle holds
        (what gloo's handle of that kind holds)."""
        if not self.late:
            return run(outputs)
        with _disable_current_modes(), torch.no_grad():
            private = [torch.empty_like(t) for t in outputs]
            work = run(private)
            for t in outputs:
                if t.is_floating_point() or t.is_complex():
                    t.fill_(float("nan"))
                else:
                    t.fill_(-(2 ** 30) if t.dtype not in (torch.uint8, torch.bool) else 0)

        def finish():
            for t, p in zip(outputs, private):
                t.copy_(p)
        return _LateWork(work, finish, self.log, reads, keep)

    @staticmethod
    def _snapshot(t: torch.Tensor) -> torch.Tensor:
        # The input is read before the output is poisoned: they may overlap (an in-place all-gather).
        with _disable_current_modes(), torch.no_grad():
            return t.detach().clone() if t.is_contiguous() else t.detach().contiguous().clone()

    # ---- collectives whose result arrives late ---------------------------------------------------------------
    def all_gather_single(self, output, input, opts):
        self._record("all_gather", input, opts, output)
        src = self._snapshot(input) if self.late else input
        return self._late([output], lambda outs: self.inner._allgather_base(outs[0], src, _ag_opts(opts)),
                          reads=[input], keep=[input])

    _allgather_base = all_gather_single

    def _reduce_scatter_wire(self, output: torch.Tensor, src: torch.Tensor, opts):
        """Reduce-scatter as a real one moves data: each rank sends every other rank only that rank's chunk
        ((W-1)/W of the input, the bytes the kernel counts on its sockets; tests/harness.py's Witness), then sums
        what it received, in rank order. gloo's own reduce-scatter all-reduces the whole input instead, twice
        those bytes, which would make an all-reduce and a reduce-scatter look the same on the wire."""
        op = _rs_opts(opts).reduceOp
        ops = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.AVG: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
               dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum}
        combine = next((fn for key, fn in ops.items() if op == key), None)
        if combine is None or src.numel() != output.numel() * self.size():
            return self.inner._reduce_scatter_base(output, src, _rs_opts(opts))
        with _disable_current_modes(), torch.no_grad():
            send = src.detach().reshape(-1).contiguous()
            received = torch.empty_like(send)
            self.inner.alltoall_base(received, send, [], [], _a2a_opts()).wait()
            parts = received.view(self.size(), -1)
            acc = parts[0].clone()
            for part in parts[1:]:
                acc = combine(acc, part)
            if op == dist.ReduceOp.AVG:
                acc = acc / self.size()
            output.copy_(acc.view_as(output))
        return _DoneWork()

    def reduce_scatter_single(self, output, input, opts):
        self._record("reduce_scatter", input, opts, output)
        src = self._snapshot(input) if self.late else input
        # gloo's handle does not hold a reduce-scatter's input: the caller keeps it alive until wait()
        return self._late([output], lambda outs: self._reduce_scatter_wire(outs[0], src, opts), reads=[input])

    _reduce_scatter_base = reduce_scatter_single

    def allreduce(self, tensors, opts):
        self._record("all_reduce", tensors[0] if tensors else None, opts)
        if not self.late:
            return self.inner.allreduce(tensors, opts)
        srcs = [self._snapshot(t) for t in tensors]

        def run(outs):
            for o, s in zip(outs, srcs):
                o.copy_(s)
            return self.inner.allreduce(outs, opts)
        return self._late(list(tensors), run, reads=list(tensors), keep=list(tensors))

    def allgather(self, output_lists, input_list, opts):
        # Recorded like an all-gather into one tensor (its output: the first output tensor, whose storage is the
        # buffer gathered into when the outputs are views of one buffer).
        first_out = output_lists[0][0] if output_lists and output_lists[0] else None
        self._record("all_gather", input_list[0] if input_list else None, opts, first_out)
        if not self.late:
            return self.inner.allgather(output_lists, input_list, opts)
        srcs = [self._snapshot(t) for t in input_list]
        flat = [t for lst in output_lists for t in lst]

        def run(outs):
            it = iter(outs)
            return self.inner.allgather([[next(it) for _ in lst] for lst in output_lists], srcs, opts)
        return self._late(flat, run, reads=list(input_list), keep=list(input_list))

    def reduce_scatter(self, outputs, input_lists, opts):
        # Recorded like a reduce-scatter of one tensor: the elements this rank contributes (all its chunks).
        first = input_lists[0] if input_lists and input_lists[0] else []
        self._record("reduce_scatter", first[0] if first else None, opts, numel=sum(int(t.numel()) for t in first))
        if len(outputs) != 1 or len(input_lists) != 1 or len(first) != self.size() or \
                any(t.shape != outputs[0].shape or t.dtype != outputs[0].dtype for t in first):
            srcs = [[self._snapshot(t) for t in lst] for lst in input_lists] if self.late else input_lists
            return self._late(list(outputs), lambda outs: self.inner.reduce_scatter(outs, srcs, opts),
                              reads=[t for lst in input_lists for t in lst])
        with _disable_current_modes(), torch.no_grad():
            src = torch.cat([t.detach().reshape(-1) for t in first])  # a copy: read before the output is poisoned
        return self._late(list(outputs), lambda outs: self._reduce_scatter_wire(outs[0], src, opts), reads=first)

    # ---- the rest: recorded, passed through ------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        self._record("broadcast", tensors[0] if tensors else None, opts)
        return self.inner.broadcast(tensors, opts)

    def barrier(self, opts):
        self._record("barrier", None, opts)
        return self.inner.barrier(opts)

    def reduce(self, tensors, opts):
        self._record("reduce", tensors[0] if tensors else None, opts)
        return self.inner.reduce(tensors, opts)

    def gather(self, output_lists, input_list, opts):
        self._record("gather", input_list[0] if input_list else None, opts)
        return self.inner.gather(output_lists, input_list, opts)

    def scatter(self, outputs, input_lists, opts):
        self._record("scatter", outputs[0] if outputs else None, opts)
        return self.inner.scatter(outputs, input_lists, opts)

    def alltoall(self, outputs, inputs, opts):
        self._record("all_to_all", inputs[0] if inputs else None, opts)
        return self.inner.alltoall(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._record("all_to_all", input, opts)
        return self.inner.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    all_to_all_single = alltoall_base

    def allreduce_coalesced(self, tensors, opts):
        self._record("all_reduce", tensors[0] if tensors else None, opts)
        return self.inner.allreduce_coalesced(tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts):
        self._record("all_gather", input_list[0] if input_list else None, opts)
        return self.inner.allgather_coalesced(output_lists, input_list, opts)

    def send(self, tensors, dst, tag):
        self._record("send", tensors[0] if tensors else None, None)
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._record("recv", tensors[0] if tensors else None, None)
        return self.inner.recv(tensors, src, tag)


class _DoneWork(dist._Work):
    """The handle of a collective that already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        pass

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _a2a_opts():
    return torch._C._distributed_c10d.AllToAllOptions()


def _ag_opts(opts):
    return torch._C._distributed_c10d.AllgatherOptions() if opts is None else opts


def _rs_opts(opts):
    out = torch._C._distributed_c10d.ReduceScatterOptions()
    if opts is not None:
        out.reduceOp = opts.reduceOp
    return out


_state: dict = {}


def _create(opts, _backend_options):
    pg = CountedProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, _state["log"],
                             _state["late"])
    pg._group_name = str(opts.group_id)  # DeviceMesh (torch's FSDP2) looks groups up by name
    return pg


def use_counted_collectives(late: bool = True) -> CallLog | None:
    """Replace this rank's default (gloo) process group by a counting one, on every rank (collective: call it
    first thing in the body, before any model is sharded). Returns the log of calls; None under NCCL."""
    if dist.get_backend() != "gloo":
        return None
    store = dist.distributed_c10d._get_default_store()
    timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    rank, size = dist.get_rank(), dist.get_world_size()
    generation = _state.get("generation", 0) + 1
    _state.update(log=CallLog(), late=late, generation=generation)
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    dist.barrier()  # nobody leaves the old group while a peer still uses it
    dist.destroy_process_group()
    dist.init_process_group(BACKEND_NAME, store=dist.PrefixStore(f"counted-{generation}", store), rank=rank,
                            world_size=size, timeout=timeout)
    return _state["log"]
