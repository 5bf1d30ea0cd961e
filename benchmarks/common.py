"""Shared plumbing for the benchmarks: flags, launchers, the strategies compared, the communication meter with its
simulated interconnect, and the writers for JSON, markdown and PNG.

Every benchmark script has the same shape:

    main()          runs in the driver process: builds the list of cases, launches W rank processes per world
                    size, collects what the ranks return, writes <out>/<name>.json, .md and .png
    worker(ctx, p)  runs inside each rank, with the process group initialized; returns a dict

and the ranks are started by one of three launchers, chosen with --launcher:

    local     (default) spawns W processes on this machine; they meet through a FileStore in a fresh temporary
              directory, so no port is ever fixed or even picked.
    torchrun  the script itself was started by torchrun (`torchrun --nproc-per-node=W benchmarks/bench_step.py`):
              every process runs main(), the process group comes from the environment, and only the cases with
              W == WORLD_SIZE run (the others are listed as skipped). Rank 0 writes the outputs.
    slurm     submits one job per world size through submitit's AutoExecutor (one node, tasks_per_node=W); the
              tasks meet through a FileStore in the submitit folder. Partition, time limit, account, GPUs per
              node come from flags or from a small TOML file (--slurm-config, see benchmarks/slurm/cluster.toml).

Whatever ran them, the ranks' dicts come back to main() and fill the same tables.

Nothing here imports an FSDP implementation: the strategies call `adapters` (the project's one seam), torch's own
FSDP2 (`torch.distributed.fsdp.fully_shard`) and DDP.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `adapters` and `fsdp_assignment` live at the repo root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results"
MiB = 1024 * 1024


# ==========================================================================================================
# Flags
# ==========================================================================================================
def base_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every benchmark shares; each script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="See the module docstring for the tables.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("where and how to run")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for <name>.json/.md/.png")
    g.add_argument("--launcher", choices=["local", "torchrun", "slurm"], default=None,
                   help="default: torchrun when started by torchrun, local otherwise")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda (nccl) when there is a GPU per rank, cpu (gloo) otherwise")
    g.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per rank on CPU (1 keeps ranks from fighting over cores)")
    g.add_argument("--timeout", type=float, default=600, help="seconds one launch may take before it is killed")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    s = p.add_argument_group("SLURM (with --launcher slurm; flags override --slurm-config)")
    s.add_argument("--slurm-config", type=Path, default=None, help="TOML file with the keys below (no 'slurm-')")
    s.add_argument("--slurm-partition", default=None)
    s.add_argument("--slurm-time-min", type=int, default=None, help="time limit in minutes (submitit: >= 2)")
    s.add_argument("--slurm-account", default=None)
    s.add_argument("--slurm-gpus-per-node", type=int, default=None, help="default: W when --device cuda, else 0")
    s.add_argument("--slurm-cpus-per-task", type=int, default=None)
    s.add_argument("--slurm-folder", type=Path, default=None, help="submitit logs and results (default <out>/slurm)")
    return p


def add_model_args(p: argparse.ArgumentParser, params: float, layers: int, block_size: int, batch: int) -> None:
    g = p.add_argument_group("model (GPT from fsdp_assignment/support/models.py) and batch per rank")
    g.add_argument("--params", type=float, default=params, help="approximate parameter count")
    g.add_argument("--layers", type=int, default=layers, help="transformer blocks (one FSDP unit each)")
    g.add_argument("--block-size", type=int, default=block_size, help="sequence length")
    g.add_argument("--batch", type=int, default=batch, help="sequences per rank per step")
    g.add_argument("--vocab", type=int, default=1021)


def add_sim_args(p: argparse.ArgumentParser, default_bw: str = "0") -> None:
    g = p.add_argument_group("simulated interconnect (CPU runs; off unless asked for)")
    g.add_argument("--sim-bandwidth", default=default_bw,
                   help="link bandwidth in GB/s (bus bytes), 0 = off (real gloo only)"
                        + (", auto = chosen so that communication about equals compute" if default_bw == "auto" else ""))
    g.add_argument("--sim-latency-us", type=float, default=50.0, help="per-collective latency of the simulated link")


def world_sizes_arg(p: argparse.ArgumentParser, default: list[int]) -> None:
    p.add_argument("--world-sizes", type=int, nargs="+", default=default, help="W values to run")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve defaults that depend on the environment (launcher, SLURM config file)."""
    if args.launcher is None:
        args.launcher = "torchrun" if under_torchrun() else "local"
    if args.launcher == "torchrun" and not under_torchrun():
        raise SystemExit("--launcher torchrun: start the script with torchrun, e.g. "
                         "`torchrun --nproc-per-node=2 benchmarks/bench_step.py`")
    if getattr(args, "slurm_config", None):
        cfg = tomllib.loads(Path(args.slurm_config).read_text())
        for key, value in cfg.items():
            attr = "slurm_" + key.replace("-", "_")
            if not hasattr(args, attr):
                raise SystemExit(f"{args.slurm_config}: unknown key {key!r}")
            if getattr(args, attr) is None:
                setattr(args, attr, Path(value) if attr == "slurm_folder" else value)
    return args


# ==========================================================================================================
# Progress and output
# ==========================================================================================================
_T0 = time.time()  # progress lines count from the driver's start; the ranks get it through their settings


def log(msg: str, *, quiet: bool = False) -> None:
    """A progress line, flushed at once (runs take a while; show that they move)."""
    if not quiet and is_writer():
        print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def is_writer() -> bool:
    """Only one process writes outputs: the driver, or rank 0 under torchrun."""
    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, name: str, raw: dict, markdown: str, plot: Callable[[], Any] | None, *,
                  quiet: bool = False) -> dict:
    """<out>/<name>.json (everything measured, plus how), <name>.md (the table, also printed), <name>.png (the
    figure ``plot()`` returns)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    paths["json"].write_text(json.dumps(raw, indent=2, default=str) + "\n")
    paths["md"].write_text(markdown)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")  # no display on clusters and CI
        import matplotlib.pyplot as plt

        fig = plot()
        fig.savefig(paths["png"], dpi=110)
        plt.close(fig)
    print(markdown)
    log(f"wrote {paths['md']}, {paths['json']}, {paths['png']}", quiet=quiet)
    return {k: str(v) for k, v in paths.items()}


def environment() -> dict:
    """What the numbers depend on, stored in every JSON."""
    import platform

    return {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
            "cpus": os.cpu_count(), "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "fsdp_impl": adapters_implementation()}


def adapters_implementation() -> str:
    """Which implementation adapters.py forwards to (FSDP_IMPL, or its default)."""
    import adapters
    return adapters.implementation()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ==========================================================================================================
# Launchers
# ==========================================================================================================
def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


@dataclass
class RankContext:
    """What a worker gets: who it is, where it runs, and the shared settings."""
    rank: int
    world_size: int
    device: torch.device
    backend: str
    settings: dict = field(default_factory=dict)

    def log(self, msg: str) -> None:
        """Progress from inside the ranks: rank 0 only."""
        if self.rank == 0 and not self.settings.get("quiet"):
            t = time.time() - self.settings.get("t0", time.time())
            print(f"[{t:6.1f}s]   rank 0 of {self.world_size}: {msg}", flush=True)


def rank_settings(args: argparse.Namespace) -> dict:
    """The plain (picklable) part of the flags that the ranks need."""
    return {"device": args.device, "threads": args.threads, "quiet": args.quiet, "timeout": args.timeout, "t0": _T0}


def _resolve_device(kind: str, world_size: int) -> tuple[str, str]:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but no GPU is visible")
    return kind, ("nccl" if kind == "cuda" else "gloo")


def _run_rank(target: str, rank: int, world_size: int, local_rank: int, init: dict, payload: Any,
              settings: dict) -> Any:
    """Body of every rank under every launcher: set up, init the process group, call the worker, tear down."""
    kind, backend = _resolve_device(settings["device"], world_size)
    torch.set_num_threads(max(1, settings["threads"]))
    device = torch.device(kind, local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(60, settings.get("timeout", 600)))
    if not dist.is_initialized():
        if "store_path" in init:
            store = dist.FileStore(init["store_path"], world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:  # torchrun: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE from the environment
            dist.init_process_group(backend, timeout=timeout)
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    ctx = RankContext(rank, world_size, device, backend, settings)
    result = fn(ctx, payload)
    dist.barrier()
    return result


def _local_rank_entry(target, rank, world_size, store_path, payload, settings, result_path):
    try:
        result = _run_rank(target, rank, world_size, rank, {"store_path": store_path}, payload, settings)
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
    ctx.set_forkserver_preload(["torch", "torch.distributed", "benchmarks.common"])
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


def _slurm_task(target: str, payload: Any, settings: dict, store_dir: str) -> Any:
    """Runs as one SLURM task (one rank) of a submitit job."""
    import submitit

    env = submitit.JobEnvironment()
    store = os.path.join(store_dir, f"store_{env.job_id}")
    return _run_rank(target, env.global_rank, env.num_tasks, env.local_rank, {"store_path": store}, payload, settings)


def _launch_slurm(target: str, world_size: int, payload: Any, settings: dict, args: argparse.Namespace) -> list:
    import submitit

    folder = Path(args.slurm_folder or (Path(args.out) / "slurm")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    kind = "cuda" if args.device == "cuda" else "cpu"  # GPUs are requested only with --device cuda
    gpus = args.slurm_gpus_per_node if args.slurm_gpus_per_node is not None else (world_size if kind == "cuda" else 0)
    params = dict(nodes=1, tasks_per_node=world_size, timeout_min=max(2, args.slurm_time_min or 10),
                  name=f"fsdp-bench-{target.split(':')[0].split('.')[-1]}-W{world_size}")
    if gpus:
        params["gpus_per_node"] = gpus
    if args.slurm_cpus_per_task:
        params["cpus_per_task"] = args.slurm_cpus_per_task
    if args.slurm_partition:
        params["slurm_partition"] = args.slurm_partition
    if args.slurm_account:
        params["slurm_account"] = args.slurm_account
    executor.update_parameters(**params)
    # The tasks unpickle benchmarks.common: make sure they can import it wherever sbatch starts them.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    job = executor.submit(_slurm_task, target, payload, settings, str(folder))
    log(f"submitted SLURM job {job.job_id} ({world_size} tasks); logs in {folder}", quiet=args.quiet)
    deadline = time.monotonic() + settings.get("timeout", 600)
    last = ""
    while not job.done():
        state = job.state
        if state != last:
            log(f"SLURM job {job.job_id}: {state}", quiet=args.quiet)
            last = state
        if time.monotonic() > deadline:
            job.cancel()
            raise RuntimeError(f"SLURM job {job.job_id} did not finish in {settings.get('timeout')} s; cancelled")
        time.sleep(0.5)
    return job.results()


def launch(args: argparse.Namespace, target: str, world_size: int, payload: Any) -> list | None:
    """Run ``target`` ("module:function") on ``world_size`` ranks; return every rank's result, rank order.
    Under torchrun, only world_size == WORLD_SIZE can run here: anything else returns None (skipped)."""
    settings = rank_settings(args)
    t0 = time.perf_counter()
    if args.launcher == "torchrun":
        ws = int(os.environ["WORLD_SIZE"])
        if world_size != ws:
            log(f"skipping W={world_size}: torchrun started {ws} processes", quiet=args.quiet)
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        result = _run_rank(target, rank, ws, local_rank, {}, payload, settings)
        results: list = [None] * ws
        dist.all_gather_object(results, result)
    elif args.launcher == "slurm":
        results = _launch_slurm(target, world_size, payload, settings, args)
    else:
        results = _launch_local(target, world_size, payload, settings)
    log(f"{target.split(':')[0].split('.')[-1]} W={world_size}: done in {time.perf_counter() - t0:.1f} s",
        quiet=args.quiet)
    return results


# ==========================================================================================================
# Communication meter and simulated interconnect
# ==========================================================================================================
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

    def __init__(self, inner, done_at: float, kind: str):
        super().__init__()
        self._inner, self._done_at, self._kind = inner, done_at, kind

    def wait(self, timeout=None) -> bool:
        with torch.profiler.record_function(f"comm::wait:{self._kind}"):
            ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
            _sleep_until(self._done_at)
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
            payload = full.numel() * full.element_size()
            factor = 2 if kind == "all_reduce" else 1
            bus = factor * payload * (w - 1) / w
            async_op = bool(a.get("async_op", False))
            meter.records.append({"kind": kind, "payload_bytes": payload, "bus_bytes": bus, "async": async_op,
                                  "world_size": w})
            if meter.on_buffer is not None:
                meter.on_buffer(kind, full)
            done_at = meter.link.reserve(bus) if meter.link is not None and w > 1 else 0.0
            CommMeter._tls.inside = True
            try:
                if async_op:
                    work = orig(*args, **kwargs)
                    return MeteredWork(work, done_at, kind) if work is not None else work
                with torch.profiler.record_function(f"comm::{kind}"):
                    out = orig(*args, **kwargs)
                    _sleep_until(done_at)
                return out
            finally:
                CommMeter._tls.inside = False

        patched.__wrapped__ = orig
        return patched

    # -- reading
    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> dict:
        """Per kind: calls, payload bytes, bus bytes (since the last reset)."""
        out: dict[str, dict] = {}
        for r in self.records:
            s = out.setdefault(r["kind"], {"calls": 0, "payload_bytes": 0, "bus_bytes": 0.0, "async_calls": 0})
            s["calls"] += 1
            s["payload_bytes"] += r["payload_bytes"]
            s["bus_bytes"] += r["bus_bytes"]
            s["async_calls"] += int(r["async"])
        return out


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


# ==========================================================================================================
# Model, strategies, one training step
# ==========================================================================================================
def model_config(args_or_payload) -> "Any":
    from fsdp_assignment.support.models import gpt_config_for_params

    get = (lambda k: args_or_payload[k]) if isinstance(args_or_payload, dict) else (lambda k: getattr(args_or_payload, k))
    return gpt_config_for_params(int(get("params")), n_layer=get("layers"), block_size=get("block_size"),
                                 vocab_size=get("vocab"))


def model_payload(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("params", "layers", "block_size", "batch", "vocab")}


# name -> (family, options). The names are the row labels of the tables.
STRATEGIES = {
    "one process": ("single", {}),
    "DDP (torch)": ("ddp", {}),
    "FSDP": ("fsdp", {"reshard": True, "prefetch": False}),
    "FSDP no-reshard": ("fsdp", {"reshard": False, "prefetch": False}),
    "FSDP + prefetch": ("fsdp", {"reshard": True, "prefetch": True}),
    "FSDP2 (torch)": ("fsdp2", {"reshard": True}),
    "FSDP2 (torch) no-reshard": ("fsdp2", {"reshard": False}),
}


@dataclass
class Trainer:
    """A model ready to train with AdamW under one strategy, and its step."""
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    cfg: Any
    batch: int
    device: torch.device
    step_index: int = 0

    def batch_for(self, rank: int, step: int):
        from fsdp_assignment.support.models import gpt_batch

        return gpt_batch(self.cfg, self.batch, seed=1000 * step + rank, device=self.device)

    def step(self, rank: int, labels=None, probe: Callable[[str], None] | None = None) -> float:
        """forward, backward, AdamW step, zero_grad. ``labels`` (a LiveStorageTracker) attributes the memory;
        ``probe("forward")`` / ``probe("backward")`` is called when that phase has finished."""
        from fsdp_assignment.support.models import gpt_loss

        idx, tgt = self.batch_for(rank, self.step_index)
        self.step_index += 1
        lab = labels.label if labels is not None else (lambda _name: contextlib.nullcontext())
        with torch.profiler.record_function("bench::forward"), lab("activations"):
            loss = gpt_loss(self.model, idx, tgt)
        if probe is not None:
            probe("forward")
        with torch.profiler.record_function("bench::backward"), lab("activations"):
            loss.backward()
        if probe is not None:
            probe("backward")
        if labels is not None:  # what backward left in .grad is the gradient state, wherever it was allocated
            labels.relabel([p.grad for p in self.model.parameters() if p.grad is not None], "grads")
        with torch.profiler.record_function("bench::optimizer"), lab("optim"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def build_trainer(name: str, cfg, batch: int, device: torch.device, meter: CommMeter | None = None,
                  lr: float = 1e-3) -> Trainer:
    """Build the benchmark GPT under strategy ``name`` (a key of STRATEGIES) with the same seed everywhere."""
    from fsdp_assignment.support.models import GPT

    family, opt = STRATEGIES[name]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # gradient_as_bucket_view: .grad are views of DDP's buckets, so gradients are not held twice
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
        if meter is not None:
            model.register_comm_hook(None, ddp_comm_hook(meter))
    elif family == "fsdp":
        import adapters

        for block in model.blocks:
            adapters.fully_shard(block, reshard_after_forward=opt["reshard"])
        adapters.fully_shard(model, reshard_after_forward=opt["reshard"])
        adapters.set_prefetch(model, opt["prefetch"])
    elif family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=opt["reshard"])
        fully_shard(model, mesh=mesh, reshard_after_forward=opt["reshard"])
    if family == "fsdp":
        import adapters

        optimizer = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return Trainer(name, model, optimizer, cfg, batch, device)


def skipped(name: str, exc: BaseException, ctx: "RankContext") -> dict:
    """A strategy whose implementation raises NotImplementedError (a student's unfinished task) is skipped, not
    fatal: the other rows still get measured, and the table lists what was skipped. Every rank raises at the same
    point (the same code runs everywhere), so the ranks stay in step."""
    ctx.log(f"{name}: skipped, {type(exc).__name__}: {exc}")
    dist.barrier()
    return {"skipped": f"{type(exc).__name__}: {exc}"}


def param_count(cfg) -> int:
    """Ψ: parameters of the benchmark GPT, the tied head counted once."""
    from fsdp_assignment.support.models import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def unit_param_counts(cfg) -> dict:
    """Parameters per FSDP unit: the root (embeddings, ln_f, tied head) and one block."""
    from fsdp_assignment.support.models import GPT

    with torch.device("meta"):
        m = GPT(cfg)
    block = sum(p.numel() for p in m.blocks[0].parameters())
    return {"root": param_count(cfg) - block * cfg.n_layer, "block": block, "n_blocks": cfg.n_layer}


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
    return {"profiled_steps": steps, "profiled_step_ms": step_us / steps / 1e3,
            "exposed_comm_ms": exposed / steps / 1e3, "idle_gap_ms": gap_us / steps / 1e3,
            "exposed_comm_fraction": exposed / step_us if step_us else float("nan")}
