"""The communication meter and the simulated interconnect.

CommMeter counts the bytes of every all-gather / reduce-scatter / all-reduce that goes through
``torch.distributed`` and, given a SimLink, makes each one last as long as that link would. ``ddp_comm_hook``
routes DDP's bucket all-reduces through ``dist.all_reduce`` so that they are counted (and simulated) too.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist


class SimLink:
    """One simulated link per rank, used by one collective at a time.

    A collective of ``bus_bytes`` issued at time t occupies the link from max(t, when the link frees up) for
    latency + bus_bytes / bandwidth, and completes no earlier than that (nor earlier than gloo really finishes
    it: the simulation only ever adds waiting, as a slower network would). Waiting is a sleep, which leaves the
    CPU to computation, so overlap (prefetching, async reduce-scatter) shows up in the step time as on a GPU.
    """

    def __init__(self, bandwidth_gbps: float, latency_us: float):
        self.bandwidth = bandwidth_gbps * 1e9  # bytes per second
        self.latency = latency_us * 1e-6
        self.free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, bus_bytes: float) -> float:
        with self._lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + self.latency + bus_bytes / self.bandwidth
            return self.free_at

    def describe(self) -> str:
        return f"SIMULATED INTERCONNECT ON: {self.bandwidth / 1e9:.3g} GB/s, {self.latency * 1e6:.0f} us latency per collective"


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class MeteredWork(dist.distributed_c10d.Work):
    """Wraps the Work of an async collective: its wait() is visible to the profiler as ``comm::wait`` and
    lasts until the simulated link has delivered too. Subclasses Work because FSDP2 checks isinstance."""

    def __init__(self, inner, done_at: float, kind: str, record: dict | None = None):
        super().__init__()
        self._inner, self._done_at, self._kind, self._record = inner, done_at, kind, record

    def wait(self, timeout=None) -> bool:
        with torch.profiler.record_function(f"comm::wait:{self._kind}"):
            t0 = time.perf_counter()
            ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
            _sleep_until(self._done_at)
        if self._record is not None and "t_done" not in self._record:  # in flight until first waited for
            self._record["t_done"] = time.perf_counter()
            self._record["blocked"] = (t0, self._record["t_done"])
        return ok if ok is not None else True

    def is_completed(self) -> bool:
        return self._inner.is_completed() and time.perf_counter() >= self._done_at

    def is_success(self) -> bool:
        return self._inner.is_success()

    def get_future(self):
        return self._inner.get_future()


class CommMeter:
    """Counts the bytes of every all-gather / reduce-scatter / all-reduce issued through ``torch.distributed``
    and, given a SimLink, makes each one take as long as that link would.

    It patches the functions on the ``torch.distributed`` module, which is where the FSDP implementation (and torch's
    FSDP2) look them up at call time. A thread-local guard keeps a patched function that calls another one from
    being counted twice. Bytes are counted two ways:

        payload  the full (unsharded) tensor: the all-gather output, the reduce-scatter input, the all-reduce
                 tensor
        bus      what each rank sends (= receives) in a ring: payload * (W-1)/W for all-gather and
                 reduce-scatter, 2 * payload * (W-1)/W for all-reduce (NCCL's "bus bandwidth" convention)

    Synchronous collectives run inside a ``comm::<kind>`` profiler range, and waits on async ones inside
    ``comm::wait:<kind>``: the time the training thread is blocked on communication.
    """

    KINDS = {
        "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter", "all_reduce": "all_reduce",
    }
    _tls = threading.local()

    def __init__(self, link: SimLink | None = None, on_buffer: Callable[[str, torch.Tensor], None] | None = None):
        self.link = link
        self.on_buffer = on_buffer  # e.g. the memory tracker labelling all-gather outputs "unsharded"
        self.records: list[dict] = []
        self._saved: dict[str, Callable] = {}

    # -- patching
    def __enter__(self) -> "CommMeter":
        for name, kind in self.KINDS.items():
            orig = getattr(dist, name, None)
            if orig is not None:
                self._saved[name] = orig
                setattr(dist, name, self._wrap(orig, kind))
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        self._saved.clear()

    def _wrap(self, orig: Callable, kind: str) -> Callable:
        sig = inspect.signature(orig)
        meter = self

        def patched(*args, **kwargs):
            if getattr(CommMeter._tls, "inside", False):
                return orig(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            if kind == "all_gather":
                full = a.get("output_tensor", a.get("output"))
            elif kind == "reduce_scatter":
                full = a.get("input", a.get("input_tensor"))
            else:
                full = a["tensor"]
            group = a.get("group")
            w = dist.get_world_size(group)
            ranks = tuple(range(w)) if group is None else tuple(dist.get_process_group_ranks(group))
            payload = full.numel() * full.element_size()
            factor = 2 if kind == "all_reduce" else 1
            bus = factor * payload * (w - 1) / w
            async_op = bool(a.get("async_op", False))
            record = {"kind": kind, "payload_bytes": payload, "bus_bytes": bus, "async": async_op, "world_size": w,
                      "group_ranks": ranks,
                      "t_issue": time.perf_counter()}  # t_done: when it completed (sync) or was waited for (async)
            meter.records.append(record)
            if meter.on_buffer is not None:
                meter.on_buffer(kind, full)
            done_at = meter.link.reserve(bus) if meter.link is not None and w > 1 else 0.0
            CommMeter._tls.inside = True
            try:
                if async_op:
                    work = orig(*args, **kwargs)
                    return MeteredWork(work, done_at, kind, record) if work is not None else work
                with torch.profiler.record_function(f"comm::{kind}"):
                    out = orig(*args, **kwargs)
                    _sleep_until(done_at)
                record["t_done"] = time.perf_counter()
                record["blocked"] = (record["t_issue"], record["t_done"])
                return out
            finally:
                CommMeter._tls.inside = False

        patched.__wrapped__ = orig
        return patched

    # -- reading
    def reset(self) -> None:
        self.records.clear()

    def summary(self, records: list[dict] | None = None) -> dict:
        """Per kind: calls, payload bytes, bus bytes (since the last reset)."""
        out: dict[str, dict] = {}
        for r in self.records if records is None else records:
            s = out.setdefault(r["kind"], {"calls": 0, "payload_bytes": 0, "bus_bytes": 0.0, "async_calls": 0})
            s["calls"] += 1
            s["payload_bytes"] += r["payload_bytes"]
            s["bus_bytes"] += r["bus_bytes"]
            s["async_calls"] += int(r["async"])
        return out


    def summary_by_group(self) -> dict:
        """Per process group (this rank's groups, named by their global ranks, e.g. "ranks 0,1"): ``summary()`` of
        the collectives issued on it. HSDP's shard group and replicate group come out apart."""
        groups: dict[str, list[dict]] = {}
        for r in self.records:
            groups.setdefault("ranks " + ",".join(map(str, r["group_ranks"])), []).append(r)
        return {name: self.summary(records) for name, records in groups.items()}


def ddp_comm_hook(meter: CommMeter):
    """A DDP communication hook that all-reduces each bucket through ``dist.all_reduce`` (so the meter counts it
    and the simulated link applies), asynchronously as DDP's default hook does, then divides by W."""

    def hook(state, bucket):
        buf = bucket.buffer()
        work = dist.all_reduce(buf, async_op=True)
        w = dist.get_world_size()
        fut = torch.futures.Future()

        def finish():  # a helper thread, so waiting (and the simulated delay) overlaps backward's computation
            work.wait()
            fut.set_result(buf.div_(w))

        threading.Thread(target=finish, daemon=True).start()
        return fut

    return hook

