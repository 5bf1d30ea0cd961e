"""Measuring a Trainer: step times (each step starts at a barrier), per-rank peak memory of one step, and the
exposed communication read off a torch.profiler trace."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.trainers import Trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainer: Trainer, rank: int, n: int) -> list[float]:
    """Seconds per step for ``n`` steps. A barrier before each step lines the ranks up, so one rank's head
    start does not show up as another's communication time."""
    times = []
    for _ in range(n):
        sync(trainer.device)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.step(rank)
        sync(trainer.device)
        times.append(time.perf_counter() - t0)
    return times


def peak_of_one_step(trainer: Trainer, rank: int) -> int:
    """Per-rank peak bytes of one step of an already built and warmed-up trainer (LiveStorageTracker; the
    parameters and optimizer state are counted from the start because they are tracked explicitly)."""
    import gc

    from fsdp_assignment.support.memory import LiveStorageTracker

    gc.collect()
    with LiveStorageTracker(device=trainer.device.type, resize_label="unsharded") as mem:
        mem.track(trainer.model, "params")
        mem.track(trainer.optimizer, "optim")
        mem.reset_peak()
        trainer.step(rank, mem)
        return mem.peak_bytes


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ logging included) for the duration of the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def exposed_comm(trainer: Trainer, rank: int, steps: int = 2, idle_gap_us: float = 500.0) -> dict:
    """Profile ``steps`` steps with torch.profiler; return the exposed (not overlapped) communication.

    Exposed communication is the time the training thread spends blocked on communication, read off the trace:
      * inside a synchronous collective (``comm::<kind>`` ranges) or waiting for an asynchronous one
        (``comm::wait:<kind>``): CommMeter adds these ranges, so they cover our FSDP and torch's FSDP2;
      * DDP waits for its bucket all-reduces in C++ (the reducer, at the end of backward), where no range can
        be added; there the trace shows the training thread idle. Idle gaps longer than ``idle_gap_us``
        between the operators inside backward are counted as exposed communication too (autograd's own gaps
        between operators are tens of microseconds).
    Communication that runs while the thread computes is overlapped, and not counted.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    dist.barrier()
    prof = profile(activities=activities)
    with _quiet_stderr():  # Kineto prints "USDT: ... profiler_start/stop" lines straight to fd 2
        prof.__enter__()
    try:
        for _ in range(steps):
            with torch.profiler.record_function("bench::step"):
                trainer.step(rank)
            sync(trainer.device)
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = prof.events()
    step_events = [e for e in events if e.name == "bench::step"]
    main_tid = step_events[0].thread
    step_us = sum(e.time_range.end - e.time_range.start for e in step_events)
    main = [e for e in events if e.thread == main_tid]
    # comm:: ranges, counted once even if nested
    comm = sorted((e.time_range.start, e.time_range.end) for e in main if e.name.startswith("comm::"))
    comm_us, reach = 0.0, -math.inf
    for start, end in comm:
        if end > reach:
            comm_us += end - max(start, reach)
            reach = end
    # idle gaps inside backward (DDP's hidden waits)
    gap_us = 0.0
    for bwd in (e for e in main if e.name == "bench::backward"):
        lo, hi = bwd.time_range.start, bwd.time_range.end
        ops = sorted((e.time_range.start, e.time_range.end) for e in main
                     if e is not bwd and lo <= e.time_range.start and e.time_range.end <= hi)
        cursor = lo
        for start, end in ops + [(hi, hi)]:
            if start - cursor > idle_gap_us:
                gap_us += start - cursor
            cursor = max(cursor, end)
    exposed = comm_us + gap_us
    out = {"profiled_steps": steps, "profiled_step_ms": step_us / steps / 1e3, "idle_gap_ms": gap_us / steps / 1e3,
           "cpu_timeline_exposed_ms": exposed / steps / 1e3}
    if trainer.device.type == "cuda":
        # on a GPU the CPU thread only launches kernels; what counts is the device: communication kernels (NCCL)
        # running while no compute kernel runs
        exposed = gpu_exposed_us(events)
        out["method"] = "GPU kernel timeline (NCCL kernel time not overlapped by any compute kernel)"
    else:
        out["method"] = "CPU timeline (training thread blocked in or waiting for collectives, plus idle gaps in backward)"
    out["exposed_comm_ms"] = exposed / steps / 1e3
    out["exposed_comm_fraction"] = exposed / step_us if step_us else float("nan")
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def gpu_exposed_us(events) -> float:
    """Microseconds during which a communication kernel (name contains 'nccl') runs on the device and no other
    kernel does: communication the computation did not hide. Read off the profiler's device (kernel) events."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    comm = _union([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()])
    compute = _union([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
    exposed, j = 0.0, 0
    for start, end in comm:
        covered = 0.0
        while j < len(compute) and compute[j][1] <= start:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < end:
            covered += min(end, compute[k][1]) - max(start, compute[k][0])
            k += 1
        exposed += (end - start) - covered
    return exposed
