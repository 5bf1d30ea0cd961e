"""The flags every benchmark shares, the SLURM settings file, `--quick` and `--collect`.

Each script builds its parser from ``base_parser`` plus its own flags and calls ``parse``. Two flags change what a
run is rather than how it measures:

    --quick           the script's tiny preset (its QUICK list, given to ``parse``): a smoke run, written to
                      <out>/quick/ and labelled "quick" in every table, so it can never be mistaken for a measurement
    --collect FOLDER  no launch: re-read a sweep that was submitted earlier (its manifest in FOLDER records the
                      original command line) and rebuild the tables from the results its jobs left there
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from benchmarks.report import DEFAULT_OUT, under_torchrun

# the tiny model every --quick preset uses
QUICK_MODEL = ["--params", "2e5", "--layers", "2", "--block-size", "16", "--batch", "1"]

# cluster.toml keys (also the flags, with "slurm-" in front); "additional" is a table of raw sbatch options
SLURM_KEYS = {"partition": str, "time-min": int, "account": str, "qos": str, "constraint": str, "mem": str,
              "exclusive": bool, "nodes": int, "tasks-per-node": int, "gpus-per-node": int, "cpus-per-task": int,
              "folder": Path, "additional": dict}


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
    g.add_argument("--timeout", type=float, default=600,
                   help="seconds one launch may RUN before it is killed (under SLURM: counted from when the job "
                        "starts running, not from submission)")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    g.add_argument("--quick", action="store_true",
                   help="tiny sizes, a smoke run: written to <out>/quick/, every table labelled 'quick'")
    g.add_argument("--collect", type=Path, default=None, metavar="FOLDER",
                   help="launch nothing: rebuild the tables from the sweep recorded in FOLDER (the <out>/<name>.sweep "
                        "folder, or <out>) after the driver that submitted it died")
    s = p.add_argument_group("SLURM (with --launcher slurm; flags override --slurm-config)")
    s.add_argument("--slurm-config", type=Path, default=None,
                   help="TOML file with the keys below without 'slurm-' (see benchmarks/slurm/cluster.toml)")
    s.add_argument("--slurm-nodes", type=int, default=None,
                   help="nodes per job; W must be a multiple (tasks per node = W / nodes). Default 1, or "
                        "W / --slurm-tasks-per-node")
    s.add_argument("--slurm-tasks-per-node", type=int, default=None, help="ranks per node (default W / nodes)")
    s.add_argument("--slurm-gpus-per-node", type=int, default=None,
                   help="default: tasks per node with --device cuda, else none requested")
    s.add_argument("--slurm-cpus-per-task", type=int, default=None)
    s.add_argument("--slurm-partition", default=None)
    s.add_argument("--slurm-account", default=None)
    s.add_argument("--slurm-qos", default=None)
    s.add_argument("--slurm-constraint", default=None, help="node features, e.g. 'a100'")
    s.add_argument("--slurm-mem", default=None, help="memory per node, e.g. 64G (0 = all of it)")
    s.add_argument("--slurm-exclusive", action="store_true", default=None, help="whole nodes to this job")
    s.add_argument("--slurm-additional", action="append", default=None, metavar="KEY=VALUE",
                   help="any other sbatch option, repeatable: --slurm-additional reservation=course "
                        "(a bare KEY is a flag without value)")
    s.add_argument("--slurm-time-min", type=int, default=None, help="the job's time limit in minutes (>= 2)")
    s.add_argument("--slurm-folder", type=Path, default=None,
                   help="submitit logs and results, visible from every node (default <out>/slurm)")
    s.add_argument("--queue-timeout", type=float, default=6 * 3600,
                   help="seconds to wait for a job to START; past it the driver stops waiting but leaves the job "
                        "queued (pick it up later with --collect)")
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


def parse(p: argparse.ArgumentParser, argv: list[str] | None, name: str, quick: list[str] = ()) -> argparse.Namespace:
    """Parse the command line, apply --quick's preset and --collect's recorded command line, and resolve the
    defaults that depend on the environment (launcher, SLURM config file). Keeps the command line in args.argv so
    that a sweep can record it."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    collect = args.collect
    if collect is not None:
        from benchmarks import sweep

        recorded = sweep.load_manifest(collect, name)["argv"]
        if "--out" in argv:  # write the rebuilt tables elsewhere if asked to
            recorded = recorded + ["--out", str(args.out)]
        argv = recorded
        args = p.parse_args(argv)
    if args.quick:  # the preset first, so that flags given on the command line still win
        args = p.parse_args(list(quick) + argv)
        if "--out" not in argv:
            args.out = Path(args.out) / "quick"
    args.collect = collect
    args.argv = argv
    return finish_args(args)


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
            if key not in SLURM_KEYS:
                raise SystemExit(f"{args.slurm_config}: unknown key {key!r} (known: {', '.join(SLURM_KEYS)})")
            attr = "slurm_" + key.replace("-", "_")
            if key == "additional":  # merged: the flags add to (and override) the file's table
                extra = dict(value)
                extra.update(additional_params(args.slurm_additional or []))
                args.slurm_additional = [f"{k}={v}" if v is not True else k for k, v in extra.items()]
            elif getattr(args, attr) is None:
                setattr(args, attr, SLURM_KEYS[key](value))
    return args


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

