"""Starting the ranks: the body every rank runs, and the launchers that start W of them.

    local     (default) spawns W processes on this machine; they meet through a FileStore in a fresh temporary
              directory, so no port is ever fixed or even picked.
    torchrun  the script itself was started by torchrun, on one node or several
              (`torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...`):
              every process runs main(), the process group comes from the environment, and only the cases with
              W == WORLD_SIZE run (the others are listed as skipped). Global rank 0 writes the outputs.
    slurm     submitit jobs, one or more nodes each (benchmarks/slurm_launch.py).

Every launcher ends in ``run_rank``: pick the device from the LOCAL rank (GPU i of this node), initialise the
process group, call the worker ``fn(ctx, payload)``, and return its dict with the machine the rank ran on
({"result": ..., "machine": ...}; benchmarks/sweep.py separates them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.report import _T0, log


@dataclass
class RankContext:
    """What a worker gets: who it is, where it runs, and the shared settings."""
    rank: int
    world_size: int
    device: torch.device
    backend: str
    settings: dict = field(default_factory=dict)
    local_rank: int = 0

    def log(self, msg: str) -> None:
        """Progress from inside the ranks: rank 0 only."""
        if self.rank == 0 and not self.settings.get("quiet"):
            t = time.time() - self.settings.get("t0", time.time())
            print(f"[{t:6.1f}s]   rank 0 of {self.world_size}: {msg}", flush=True)


def rank_settings(args: argparse.Namespace) -> dict:
    """The plain (picklable) part of the flags that the ranks need."""
    return {"device": args.device, "threads": args.threads, "quiet": args.quiet, "timeout": args.timeout, "t0": _T0}


def resolve_device(kind: str, local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """This rank's device and backend. GPUs are per node: rank r of a node uses GPU r of that node (local rank),
    or GPU 0 when the scheduler already gave each task its own single GPU (CUDA_VISIBLE_DEVICES per task)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        kind = "cuda" if n >= local_world_size or (n == 1 and _one_gpu_per_task()) else "cpu"
    if kind == "cpu":
        return torch.device("cpu"), "gloo"
    if n == 0:
        raise RuntimeError("--device cuda but no GPU is visible to this rank "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if local_rank < n:
        return torch.device("cuda", local_rank), "nccl"
    if n == 1:
        return torch.device("cuda", 0), "nccl"
    raise RuntimeError(f"local rank {local_rank} but only {n} GPUs visible on this node: ask for as many GPUs per node "
                       f"as tasks per node (--slurm-gpus-per-node / torchrun --nproc-per-node)")


def _one_gpu_per_task() -> bool:
    return "SLURM_STEP_GPUS" in os.environ or "SLURM_JOB_GPUS" in os.environ


def run_rank(target: str, rank: int, world_size: int, local_rank: int, local_world_size: int, init: dict,
             payload: Any, settings: dict) -> Any:
    """Body of every rank under every launcher: set up, init the process group, call the worker.

    ``init`` says how the ranks meet: {"store_path": P} (local: a FileStore on this machine) or {} (torchrun and
    SLURM: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment, a TCP rendezvous at the first node)."""
    device, backend = resolve_device(settings["device"], local_rank, local_world_size)
    torch.set_num_threads(max(1, settings["threads"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(60, settings.get("timeout", 600)))
    if not dist.is_initialized():
        if "store_path" in init:
            store = dist.FileStore(init["store_path"], world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:  # env:// - the TCP store at MASTER_ADDR:MASTER_PORT
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    ctx = RankContext(rank, world_size, device, backend, settings, local_rank)
    result = fn(ctx, payload)
    dist.barrier()
    from benchmarks import machine

    return {"result": result, "machine": machine.describe(device)}
def _local_rank_entry(target, rank, world_size, store_path, payload, settings, result_path):
    try:
        result = run_rank(target, rank, world_size, rank, world_size, {"store_path": store_path}, payload, settings)
        ok = True
    except BaseException:  # noqa: BLE001 - the driver reports it
        result, ok = traceback.format_exc(), False
    with open(result_path, "wb") as f:
        pickle.dump((ok, result), f)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def _launch_local(target: str, world_size: int, payload: Any, settings: dict) -> list:
    import multiprocessing as mp

    # forkserver: every rank is forked from a clean server process that has imported torch once, so a launch
    # costs a fork, not an interpreter start plus `import torch` per rank (seconds on a small machine); and
    # nothing (threads, CUDA, patched functions) is inherited from the driver.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "benchmarks.launch"])
    tmp = Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
    try:
        procs = []
        for r in range(world_size):
            p = ctx.Process(target=_local_rank_entry, daemon=True,
                            args=(target, r, world_size, str(tmp / "store"), payload, settings, tmp / f"rank{r}.pkl"))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + settings.get("timeout", 600)
        failed = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {settings.get('timeout')} s"
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2)  # give the others a moment to fail too, so their errors can be shown
                failed = "a rank failed"
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = tmp / f"rank{r}.pkl"
            if path.exists():
                ok, res = pickle.loads(path.read_bytes())
                (results if ok else errors).append(res if ok else f"rank {r} raised:\n{res}")
            else:
                errors.append(f"rank {r} exited with code {p.exitcode} and no result ({failed or 'no reason'})")
        if errors or failed:
            raise RuntimeError(f"{target} at W={world_size} failed:\n" + "\n".join(errors))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def launch(args: argparse.Namespace, target: str, world_size: int, payload: Any) -> list | None:
    """Run ``target`` ("module:function") on ``world_size`` ranks here or under torchrun; return every rank's
    result, rank order. Under torchrun, only world_size == WORLD_SIZE can run: anything else returns None (skipped).
    SLURM runs go through benchmarks/sweep.py (submitted together, collected in order)."""
    settings = rank_settings(args)
    t0 = time.perf_counter()
    if args.launcher == "torchrun":
        ws = int(os.environ["WORLD_SIZE"])
        if world_size != ws:
            log(f"skipping W={world_size}: torchrun started {ws} processes", quiet=args.quiet)
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
        result = run_rank(target, rank, ws, local_rank, local_ws, {}, payload, settings)
        results: list = [None] * ws
        dist.all_gather_object(results, result)
    elif args.launcher == "local":
        results = _launch_local(target, world_size, payload, settings)
    else:
        raise ValueError(f"launch() runs local and torchrun launches, not {args.launcher!r}")
    log(f"{target.split(':')[0].split('.')[-1]} W={world_size}: done in {time.perf_counter() - t0:.1f} s",
        quiet=args.quiet)
    return results


def probe(ctx: RankContext, payload: Any) -> dict:
    """The smallest worker: where this rank runs. `sweep.run(args, "probe", "benchmarks.launch:probe", ...)` checks
    that a launcher's ranks meet (tests/test_slurm.py uses it for the queue cases)."""
    import socket

    return {"host": socket.gethostname(), "rank": ctx.rank, "local_rank": ctx.local_rank, "device": str(ctx.device),
            "world_size": dist.get_world_size()}
