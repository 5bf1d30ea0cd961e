"""Inside a rank: profiler traces, exposed communication, and the timeline of one step.

``profile`` runs torch.profiler with a schedule (wait 1, warm-up 1, then ``active`` recorded steps), labels every
step (``bench::step``), its phases (``bench::forward/backward/optimizer``, from trainers.Trainer.step) and every FSDP
unit's forward (``unit:<name>:forward``), saves the rank's Chrome/Perfetto trace, and measures, per recorded step,
the exposed communication under the writeup's one definition:

    exposed communication (per rank, per step): the time during the step when at least one collective is in flight
    on that rank and no compute op runs on it.

  * in flight: a collective issued through torch.distributed (benchmarks.comm_meter.CommMeter times it) from the
    call until it completed (synchronous) or until it was first waited for (asynchronous); with the simulated link,
    until the link has delivered it. On a GPU: an NCCL kernel running.
  * compute op: on a CPU, an operator on the training thread that is not part of a collective (the profiler's
    events, with the ones inside ``comm::`` ranges and c10d/gloo/nccl operators left out); on a GPU, a kernel that
    is not an NCCL kernel.
  * stock DDP all-reduces inside its C++ reducer, where no collective is visible to the meter: on a CPU its exposed
    communication is not measured (None), rather than guessed.

The total communication time (the union of the in-flight intervals) is reported beside it. Why no trace-analysis
library: HolisticTraceAnalysis computes the same overlap from GPU kernel streams only (a CPU trace has no kernels
for it to read) and brings pandas and plotly; the saved traces open in Perfetto (ui.perfetto.dev) and load in HTA
unchanged on a GPU run.

``timeline`` records one more step with timestamps (no profiler) and the memory tracker, for the timeline picture
(benchmarks/timeline.py): what the training thread did, every all-gather and reduce-scatter in flight with its unit,
and the live and unsharded bytes over the step.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

COMM_OP_WORDS = ("c10d", "gloo", "nccl", "record_param_comms")
LABELS = ("comm::", "bench::", "unit:", "ProfilerStep")


def units_of(model) -> list[tuple[str, torch.nn.Module]]:
    """The FSDP units of the benchmark GPT: every block, then the root (DDP's wrapper looked through)."""
    inner = getattr(model, "module", model)
    return [(f"block{i}", b) for i, b in enumerate(inner.blocks)] + [("root", inner)]


class UnitClock:
    """Forward and backward start/end of every unit (perf_counter seconds), and a ``unit:<name>:forward`` profiler
    range around each unit's forward. Backward ends are read from gradient hooks on each unit's input and output."""

    def __init__(self, model, label: bool = True, on_event=None):
        self.units, self.label, self.on_event = units_of(model), label, on_event
        self.events: list[tuple[float, str, str]] = []
        self._handles: list = []
        self._ranges: list = []

    def _add(self, unit: str, what: str) -> None:
        self.events.append((time.perf_counter(), unit, what))
        if self.on_event is not None:
            self.on_event()

    def _mark(self, unit: str, what: str):
        def hook(*_):
            self._add(unit, what)
        return hook

    def __enter__(self) -> "UnitClock":
        for name, module in self.units:
            def pre(mod, args, name=name):
                self._add(name, "forward start")
                if self.label:
                    rf = torch.profiler.record_function(f"unit:{name}:forward")
                    rf.__enter__()
                    self._ranges.append(rf)
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(self._mark(name, "backward end"))

            def post(mod, args, out, name=name):
                if self.label and self._ranges:
                    self._ranges.pop().__exit__(None, None, None)
                self._add(name, "forward end")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(self._mark(name, "backward start"))

            self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _union(intervals):
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a, b):
    """The parts of the (merged) intervals ``a`` not covered by the (merged) intervals ``b``."""
    out, j = [], 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def profile(trainer, rank: int, meter, active: int, trace_path: str | None) -> dict:
    """Profile ``active`` steps (after 1 wait and 1 warm-up step); return the exposed and total communication per
    step (ms) and their fraction of the profiled step, and save the Chrome trace (gzip) to ``trace_path``."""
    from torch.profiler import ProfilerActivity, schedule

    from benchmarks.measure import _quiet_stderr, sync

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    marks = []
    prof = torch.profiler.profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=active),
                                  on_trace_ready=lambda p: p.export_chrome_trace(tmp))
    with _quiet_stderr():  # Kineto prints "USDT: ... profiler_start/stop" lines straight to fd 2
        prof.__enter__()
    try:
        with UnitClock(trainer.model):
            for i in range(2 + active):
                sync(trainer.device)
                dist.barrier()
                n0 = len(meter.records)
                with torch.profiler.record_function("bench::step"):
                    t0 = time.perf_counter()
                    trainer.step(rank)
                    sync(trainer.device)
                    t1 = time.perf_counter()
                if i >= 2:
                    marks.append((t0, t1, n0, len(meter.records)))
                with _quiet_stderr():  # the schedule starts and stops Kineto here, which prints to fd 2
                    prof.step()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = prof.events()
    steps = sorted((e for e in events if e.name == "bench::step"), key=lambda e: e.time_range.start)[-len(marks):]
    main_tid = steps[0].thread
    main = [e for e in events if e.thread == main_tid and e.device_type == events[0].device_type]
    comm_ranges = _union((e.time_range.start, e.time_range.end) for e in main if e.name.startswith("comm::"))
    ops = _union((e.time_range.start, e.time_range.end) for e in main
                 if not e.name.startswith(LABELS) and not any(w in e.name.lower() for w in COMM_OP_WORDS))
    compute_cpu = _minus(ops, comm_ranges)
    if cuda:
        from torch.autograd import DeviceType

        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        gpu_comm = _union((e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower())
        gpu_compute = _union((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    per_step = []
    for ev, (t0, t1, n0, n1) in zip(steps, marks):
        lo, hi = ev.time_range.start, ev.time_range.end
        if cuda:
            flight, compute = _clip(gpu_comm, lo, hi), _clip(gpu_compute, lo, hi)
        else:
            offset = lo - t0 * 1e6  # the step's range began at t0: perf_counter seconds -> profiler microseconds
            recs = [r for r in meter.records[n0:n1] if "t_done" in r]
            if not recs:  # nothing visible in flight (stock DDP's C++ all-reduce): not measured
                per_step.append({"step_ms": (hi - lo) / 1e3, "comm_ms": None, "exposed_ms": None})
                continue
            flight = _clip(_union((r["t_issue"] * 1e6 + offset, r["t_done"] * 1e6 + offset) for r in recs), lo, hi)
            compute = _clip(compute_cpu, lo, hi)
        exposed = _length(_minus(flight, compute))
        per_step.append({"step_ms": (hi - lo) / 1e3, "comm_ms": _length(flight) / 1e3, "exposed_ms": exposed / 1e3})
    measured = [s for s in per_step if s["exposed_ms"] is not None]
    out = {"profiled_steps": len(per_step), "per_step": per_step,
           "profiled_step_ms": statistics.median(s["step_ms"] for s in per_step),
           "method": "GPU kernel timeline (NCCL kernels in flight, no other kernel running)" if cuda else
                     "CPU: collectives in flight (CommMeter) while no compute operator runs on the training thread"}
    if measured:
        out["exposed_comm_ms"] = statistics.median(s["exposed_ms"] for s in measured)
        out["comm_ms"] = statistics.median(s["comm_ms"] for s in measured)
        out["exposed_comm_fraction"] = statistics.median(s["exposed_ms"] / s["step_ms"] for s in measured)
    else:
        out["exposed_comm_ms"] = out["comm_ms"] = out["exposed_comm_fraction"] = None
    try:
        with open(tmp, "rb") as f:
            data = f.read()
        if trace_path is not None:
            out["trace_gz"] = gzip.compress(data)
    finally:
        os.unlink(tmp)
    return out


def timeline(trainer, rank: int, meter) -> dict:
    """One step with timestamps and the memory tracker: phases, what blocked the training thread, every collective
    in flight (kind, bytes), unit forward/backward marks, and live/unsharded bytes at each mark (seconds from the
    step's start)."""
    import gc

    from fsdp_assignment.support.memory import LiveStorageTracker

    from benchmarks.measure import sync

    gc.collect()
    sync(trainer.device)
    dist.barrier()
    samples: list[tuple[float, int, int]] = []
    phases: dict[str, float] = {}
    with LiveStorageTracker(device=trainer.device.type, resize_label="unsharded") as mem:
        mem.track(trainer.model, "params")
        mem.track(trainer.optimizer, "optim")

        def sample(*_):
            samples.append((time.perf_counter(), mem.current_bytes, mem.bytes_by_label().get("unsharded", 0)))

        clock = UnitClock(trainer.model, label=False, on_event=sample)
        n0 = len(meter.records)
        cuda = trainer.device.type == "cuda"
        if cuda:  # and the CUDA allocator's own history of this step (https://pytorch.org/memory_viz)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        with clock:
            t0 = time.perf_counter()
            sample()
            trainer.step(rank, probe=lambda phase: (phases.__setitem__(phase, time.perf_counter()), sample()))
            sync(trainer.device)
            t1 = time.perf_counter()
            sample()
    snapshot = None
    if cuda:
        path = tempfile.NamedTemporaryFile(suffix=".pickle", delete=False).name
        try:
            torch.cuda.memory._dump_snapshot(path)
            with open(path, "rb") as f:
                snapshot = f.read()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            os.unlink(path)
    recs = [r for r in meter.records[n0:] if "t_done" in r]
    return {"cuda_snapshot": snapshot,"t_end": t1 - t0, "phases": {k: v - t0 for k, v in phases.items()},
            "comm": [{"kind": r["kind"], "payload_bytes": r["payload_bytes"], "issue": r["t_issue"] - t0,
                      "done": r["t_done"] - t0, "blocked": [b - t0 for b in r.get("blocked", (r["t_done"], r["t_done"]))]}
                     for r in recs],
            "units": [(t - t0, unit, what) for t, unit, what in clock.events],
            "memory": [(t - t0, cur, unsh) for t, cur, unsh in samples]}
