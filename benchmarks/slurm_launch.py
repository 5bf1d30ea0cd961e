"""SLURM through submitit: one job per world size, on one node or several.

A job for world size W has ``nodes x tasks_per_node = W`` tasks, one rank each (``--slurm-nodes`` and/or
``--slurm-tasks-per-node``; by default one node). Its ranks meet over TCP at the first node of the allocation:
submitit's ``helpers.TorchDistributedEnvironment`` exports MASTER_ADDR (the first host name of the job), a
MASTER_PORT derived from the job id, RANK, WORLD_SIZE and LOCAL_RANK, and every rank takes the GPU of its local rank
on its node. No shared-folder FileStore: a cluster's shared file system need not support the locking it needs.

Waiting is queue-aware (``wait``): the run timeout (--timeout) starts when SLURM starts the job, not at submission;
while the job waits its state and SLURM's reason are printed whenever they change, up to --queue-timeout (past it
the driver stops waiting but leaves the job queued, for --collect). A request the cluster can never satisfy (sbatch
refuses it, or the job pends with a reason such as PartitionConfig or BadConstraints) fails at once with SLURM's
words and a hint built from `sinfo`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks import cli
from benchmarks.launch import run_rank
from benchmarks.report import ROOT, log

# Pending reasons that no amount of waiting fixes: the request exceeds what the partition, the QOS or the
# association allows, or names something that does not exist. (Resources, Priority, ReqNodeNotAvail... are
# waiting, not failing.)
NEVER = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
         "InvalidQOS", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob", "QOSMaxWallDurationPerJobLimit",
         "AssocMaxNodesPerJobLimit", "AssocMaxCpuPerJobLimit", "AssocMaxWallDurationPerJobLimit",
         "DependencyNeverSatisfied", "AccountNotAllowed", "QOSNotAllowed", "PartitionNotAvail"}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


class NeverRuns(RuntimeError):
    """SLURM will never start this request as asked."""


def job_shape(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """(nodes, tasks per node) for W ranks, from --slurm-nodes / --slurm-tasks-per-node."""
    nodes, per_node = args.slurm_nodes, args.slurm_tasks_per_node
    if nodes and per_node:
        if nodes * per_node != world_size:
            raise SystemExit(f"W={world_size} but --slurm-nodes {nodes} x --slurm-tasks-per-node {per_node} = "
                             f"{nodes * per_node}: give one of the two, or a W that matches")
    elif per_node:
        nodes = world_size // per_node
    else:
        nodes = nodes or 1
        per_node = world_size // nodes
    if nodes * per_node != world_size or nodes < 1:
        raise SystemExit(f"W={world_size} cannot be split evenly over {nodes} node(s) "
                         f"(--slurm-nodes / --slurm-tasks-per-node)")
    return nodes, per_node


def executor_for(args: argparse.Namespace, world_size: int, folder: Path, name: str):
    """A submitit executor for one W: the job's shape, resources and the cluster's own options."""
    import submitit

    s = cli.slurm_settings(args)
    nodes, per_node = job_shape(args, world_size)
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    # GPUs are requested only with --device cuda (or when asked for): one per task on each node by default
    gpus = s["gpus_per_node"] if s["gpus_per_node"] is not None else (per_node if args.device == "cuda" else 0)
    params: dict[str, Any] = dict(nodes=nodes, tasks_per_node=per_node, timeout_min=max(2, s["time_min"] or 10),
                                  name=f"fsdp-{name}-W{world_size}")
    if gpus:
        params["gpus_per_node"] = gpus
    if s["cpus_per_task"]:
        params["cpus_per_task"] = s["cpus_per_task"]
    for key in ("partition", "account", "qos", "constraint"):
        if s[key]:
            params[f"slurm_{key}"] = s[key]
    if s["mem"] is not None:
        params["slurm_mem"] = s["mem"]
    if s["exclusive"]:
        params["slurm_exclusive"] = True
    if s["additional"]:
        params["slurm_additional_parameters"] = s["additional"]
    executor.update_parameters(**params)
    return executor, params


def slurm_task(target: str, payload: Any, settings: dict) -> Any:
    """Runs as one SLURM task (one rank) of a submitit job: TCP rendezvous at the first node of the job."""
    from submitit.helpers import TorchDistributedEnvironment

    # overwrite: a job launched from inside another job (or from a torchrun shell) must not inherit its MASTER_*;
    # CUDA_VISIBLE_DEVICES is left alone: the rank picks GPU <local rank> of the node itself
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return run_rank(target, env.rank, env.world_size, env.local_rank, env.local_world_size, {}, payload, settings)


def submit(args: argparse.Namespace, target: str, world_size: int, payload: Any, settings: dict, folder: Path,
           name: str):
    """sbatch one job; a request SLURM refuses outright raises NeverRuns with sbatch's words and a hint."""
    executor, params = executor_for(args, world_size, folder, name)
    # the tasks unpickle benchmarks.*: make sure they can import them wherever sbatch starts them (sbatch exports
    # the submitting environment by default)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)])
    try:
        return executor.submit(slurm_task, target, payload, settings)
    except Exception as exc:  # submitit's FailedSubmissionError carries sbatch's stderr
        words = str(exc).strip().splitlines()
        said = next((w for w in words if "error" in w.lower()), words[-1] if words else repr(exc))
        raise NeverRuns(f"SLURM refused the W={world_size} job ({_shape(params)}): {said.strip()}\n"
                        f"{hint()}") from exc


def _shape(params: dict) -> str:
    keep = {k: v for k, v in params.items() if k not in ("name", "timeout_min")}
    return ", ".join(f"{k.replace('slurm_', '')}={v}" for k, v in keep.items())


def hint() -> str:
    """What the cluster offers, to compare with the request."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %D %c %m %G %f %l %a"], capture_output=True, text=True,
                             timeout=15).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    lines = "\n".join("    " + line for line in out.splitlines()) or "    (sinfo gave nothing)"
    return ("Hint: this cluster offers (partition, nodes, CPUs per node, memory MB per node, GPUs, features, "
            "time limit, state):\n" + lines + "\nAsk for at most that: --slurm-nodes, --slurm-tasks-per-node, "
            "--slurm-gpus-per-node, --slurm-partition, --slurm-constraint, --slurm-mem (or benchmarks/slurm/cluster.toml).")


def state_of(job_id: str) -> tuple[str, str]:
    """(state, reason) from squeue; ("", "") once the job has left the queue (finished)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except subprocess.TimeoutExpired:
        return "UNKNOWN", "squeue did not answer"
    if not out:
        return "", ""
    state, _, reason = out.splitlines()[0].partition("|")
    return state.strip(), reason.strip()


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)


def wait(job, world_size: int, settings: dict, queue_timeout: float, quiet: bool) -> list:
    """Wait for one submitted job and return every rank's result (rank order).

    The run timeout (settings["timeout"]) counts from the first time the job is seen RUNNING; a job that is still
    pending after ``queue_timeout`` is left in the queue (not cancelled) and TimeoutError says how to collect it.
    """
    job_id = str(job.job_id)
    t_submit = time.monotonic()
    t_run = None
    last = None
    while True:
        state, reason = state_of(job_id)
        if (state, reason) != last and state:
            log(f"SLURM job {job_id} (W={world_size}): {state}" + (f" (reason: {reason})" if reason and reason != "None" else ""),
                quiet=quiet)
            last = (state, reason)
        if state == "" or state in FINISHED:
            break
        if state == "PENDING":
            if reason in NEVER:
                cancel(job_id)  # ours, and it can never start
                raise NeverRuns(f"SLURM job {job_id} (W={world_size}) can never start: Reason={reason}. Cancelled.\n"
                                f"{hint()}")
            if time.monotonic() - t_submit > queue_timeout:
                raise TimeoutError(f"SLURM job {job_id} (W={world_size}) still pending after {queue_timeout:.0f} s "
                                   f"(reason: {reason}); NOT cancelled: it runs when SLURM starts it, and --collect "
                                   f"gathers its results afterwards")
        else:  # RUNNING, CONFIGURING, COMPLETING...: the run clock starts now
            t_run = t_run or time.monotonic()
            if time.monotonic() - t_run > settings.get("timeout", 600):
                cancel(job_id)
                raise TimeoutError(f"SLURM job {job_id} (W={world_size}) ran longer than --timeout "
                                   f"{settings.get('timeout')} s; cancelled (logs in {job.paths.folder})")
        time.sleep(0.5)
    return job.results()


def job_from_record(folder: Path, job_id: str, world_size: int):
    """A submitit handle for a job submitted by an earlier driver (--collect)."""
    import submitit

    return submitit.SlurmJob(folder=folder, job_id=str(job_id), tasks=tuple(range(world_size)))
