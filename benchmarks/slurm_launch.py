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

from benchmarks.report import ROOT, log

# cluster.toml keys (also the flags, with "slurm-" in front); "additional" is a table of raw sbatch options
SLURM_KEYS = {"partition": str, "time-min": int, "account": str, "qos": str, "constraint": str, "mem": str,
              "exclusive": bool, "nodes": int, "tasks-per-node": int, "gpus-per-node": int, "cpus-per-task": int,
              "folder": Path, "additional": dict}

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


def owner() -> str:
    """Who submits: FSDP_SLURM_OWNER, or this checkout's path. Every job carries it as its comment, so that
    benchmarks/slurm/slurm_down.sh (same rule) cancels only the jobs of the checkout that calls it."""
    return os.environ.get("FSDP_SLURM_OWNER") or str(ROOT)


def additional_params(items: list[str]) -> dict:
    """--slurm-additional KEY=VALUE items -> submitit's slurm_additional_parameters ({key: value}; a bare KEY is a
    flag: {key: True})."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        out[key.strip().lstrip("-").replace("-", "_")] = value if sep else True
    return out


def slurm_settings(args: argparse.Namespace) -> dict:
    """The SLURM part of the flags, as plain data (recorded in the sweep's manifest)."""
    return {k.replace("-", "_"): getattr(args, "slurm_" + k.replace("-", "_"), None) for k in SLURM_KEYS} | {
        "additional": additional_params(getattr(args, "slurm_additional", None) or [])}


def job_shape(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """(nodes, tasks per node) for W ranks, from --slurm-nodes / --slurm-tasks-per-node. W=1 (the one-process
    baselines, which need no network) is always one task on one node, whatever shape the other W ask for."""
    if world_size == 1:
        return 1, 1
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

    s = slurm_settings(args)
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
    # the owner's mark (slurm_down.sh cancels only its caller's jobs); a comment the user gave is kept in front
    extra = dict(s["additional"] or {})
    extra["comment"] = (f"{extra['comment']} " if extra.get("comment") not in (None, True) else "") + f"fsdp-owner={owner()}"
    params["slurm_additional_parameters"] = extra
    executor.update_parameters(**params)
    return executor, params


def slurm_task(target: str, payload: Any, settings: dict) -> Any:
    """Runs as one SLURM task (one rank) of a submitit job: TCP rendezvous at the first node of the job."""
    from submitit.helpers import TorchDistributedEnvironment

    from benchmarks.launch import run_rank

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


def states_of(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} from one squeue call; a job that has left the queue (finished) is absent."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r"], capture_output=True,
                             text=True, timeout=30).stdout
    except subprocess.TimeoutExpired:
        return {j: ("UNKNOWN", "squeue did not answer") for j in job_ids}
    found = {}
    for line in out.splitlines():
        job_id, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        found[job_id.split("_")[0]] = (state.strip(), reason.strip())
    return found


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)


def wait_all(jobs: dict, settings: dict, queue_timeout: float, quiet: bool, on_done, on_fail) -> None:
    """Wait for every submitted job at once: ``jobs`` = {key: (submitit job, W)}. The state of all of them is
    polled together (one squeue call), so a job that can never start is noticed within a second of being queued,
    whatever runs before it. For each job, exactly one of
      on_done(key, every rank's result)           it finished and its results came back
      on_fail(key, why)                           it failed, ran past --timeout (cancelled), can never start
                                                  (cancelled, SLURM's reason and what the cluster offers), or is
                                                  still pending after ``queue_timeout`` (NOT cancelled: --collect)
    The run timeout (settings["timeout"]) counts from the first time the job is seen RUNNING."""
    t_submit = time.monotonic()
    started: dict[str, float] = {}
    last: dict[str, tuple[str, str]] = {}
    left = dict(jobs)
    while left:
        states = states_of([str(job.job_id) for job, _ in left.values()])
        for key, (job, w) in list(left.items()):
            job_id = str(job.job_id)
            state, reason = states.get(job_id, ("", ""))
            if state and (state, reason) != last.get(key):
                log(f"SLURM job {job_id} (W={w}): {state}"
                    + (f" (reason: {reason})" if reason and reason != "None" else ""), quiet=quiet)
                last[key] = (state, reason)
            why = None
            if state == "" or state in FINISHED:
                del left[key]
                try:
                    on_done(key, job.results())
                except Exception as exc:  # noqa: BLE001 - a failed rank: reported with the tables
                    on_fail(key, f"SLURM job {job_id}: {type(exc).__name__}: {exc}")
                continue
            if state == "PENDING":
                if reason in NEVER:
                    cancel(job_id)  # ours, and it can never start
                    why = f"SLURM job {job_id} (W={w}) can never start: Reason={reason}. Cancelled.\n{hint()}"
                elif time.monotonic() - t_submit > queue_timeout:
                    why = (f"SLURM job {job_id} (W={w}) still pending after {queue_timeout:.0f} s (reason: {reason}); "
                           f"NOT cancelled: it runs when SLURM starts it, and --collect gathers its results afterwards")
            elif state != "UNKNOWN":  # RUNNING, CONFIGURING, COMPLETING...: the run clock starts now
                started.setdefault(key, time.monotonic())
                if time.monotonic() - started[key] > settings.get("timeout", 600):
                    cancel(job_id)
                    why = (f"SLURM job {job_id} (W={w}) ran longer than --timeout {settings.get('timeout')} s; "
                           f"cancelled (logs in {job.paths.folder})")
            if why is not None:
                del left[key]
                on_fail(key, why)
        if left:
            time.sleep(0.5)


def job_from_record(folder: Path, job_id: str, world_size: int):
    """A submitit handle for a job submitted by an earlier driver (--collect)."""
    import submitit

    return submitit.SlurmJob(folder=folder, job_id=str(job_id), tasks=tuple(range(world_size)))
