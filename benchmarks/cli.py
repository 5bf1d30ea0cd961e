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
import glob
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from benchmarks import sweep
from benchmarks.report import DEFAULT_OUT, under_torchrun
from benchmarks.slurm_launch import SLURM_KEYS, additional_params, job_shape

# the tiny model every --quick preset uses
QUICK_MODEL = ["--params", "2e5", "--layers", "2", "--block-size", "16", "--batch", "1"]



# ---- argument types: each turns a bad value into argparse's one-line "argument --x: ..." error ----------------
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not > 0")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not >= 0")
    return value


SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024 ** 2, "mb": 1024 ** 2, "mib": 1024 ** 2,
              "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}


def size_bytes(text: str) -> int:
    """'64MiB', '16KiB', '4096' (bytes) -> bytes. KB/MB/GB are read as KiB/MiB/GiB (powers of 2, as nccl-tests)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in SIZE_UNITS | {"": 1}:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number with an optional unit B, KiB, MiB or "
                                         f"GiB (e.g. 16KiB, 64MiB)")
    value = int(float(m.group(1)) * SIZE_UNITS.get(m.group(2).lower(), 1))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    return value


def bandwidth(text: str) -> str:
    """--sim-bandwidth: GB/s as a number >= 0 (0 = off) or 'auto'. Kept as text (the payload records it)."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a bandwidth in GB/s (a number, 0 = off) nor "
                                         f"'auto'") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} GB/s is negative")
    return text


def gpu_present() -> tuple[bool, str]:
    """Whether this machine has a GPU, read without importing torch: the NVIDIA driver's /proc entries or
    nvidia-smi (AMD: /dev/kfd). Returns (present, what was looked at)."""
    if glob.glob("/proc/driver/nvidia/gpus/*") or os.path.exists("/dev/kfd"):
        return True, "/proc/driver/nvidia/gpus"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        if "GPU" in out:
            return True, "nvidia-smi -L"
    return False, "no /proc/driver/nvidia/gpus, /dev/kfd or nvidia-smi GPU"


def base_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every benchmark shares; each script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="See the module docstring for the tables.",
                                usage="%(prog)s [flags]   (every flag and its default: --help)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("where and how to run")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for <name>.json/.md/.png")
    g.add_argument("--launcher", choices=["local", "torchrun", "slurm"], default=None,
                   help="default: torchrun when started by torchrun, local otherwise")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda (nccl) when there is a GPU per rank, cpu (gloo) otherwise")
    g.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads per rank on CPU (1 keeps ranks from fighting over cores)")
    g.add_argument("--timeout", type=positive_float, default=600,
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
    s.add_argument("--slurm-nodes", type=positive_int, default=None,
                   help="nodes per job; W must be a multiple (tasks per node = W / nodes). Default 1, or "
                        "W / --slurm-tasks-per-node")
    s.add_argument("--slurm-tasks-per-node", type=positive_int, default=None, help="ranks per node (default W / nodes)")
    s.add_argument("--slurm-gpus-per-node", type=positive_int, default=None,
                   help="default: tasks per node with --device cuda, else none requested")
    s.add_argument("--slurm-cpus-per-task", type=positive_int, default=None)
    s.add_argument("--slurm-partition", default=None)
    s.add_argument("--slurm-account", default=None)
    s.add_argument("--slurm-qos", default=None)
    s.add_argument("--slurm-constraint", default=None, help="node features, e.g. 'a100'")
    s.add_argument("--slurm-mem", default=None, help="memory per node, e.g. 64G (0 = all of it)")
    s.add_argument("--slurm-exclusive", action="store_true", default=None, help="whole nodes to this job")
    s.add_argument("--slurm-additional", action="append", default=None, metavar="KEY=VALUE",
                   help="any other sbatch option, repeatable: --slurm-additional reservation=course "
                        "(a bare KEY is a flag without value)")
    s.add_argument("--slurm-time-min", type=positive_int, default=None, help="the job's time limit in minutes (>= 2)")
    s.add_argument("--slurm-folder", type=Path, default=None,
                   help="submitit logs and results, visible from every node (default <out>/slurm)")
    s.add_argument("--queue-timeout", type=positive_float, default=6 * 3600,
                   help="seconds to wait for a job to START; past it the driver stops waiting but leaves the job "
                        "queued (pick it up later with --collect)")
    return p


def add_model_args(p: argparse.ArgumentParser, params: float, layers: int, block_size: int, batch: int) -> None:
    g = p.add_argument_group("model (GPT from fsdp_assignment/support/models.py) and batch per rank")
    g.add_argument("--params", type=positive_float, default=params, help="approximate parameter count")
    g.add_argument("--layers", type=positive_int, default=layers, help="transformer blocks (one FSDP unit each)")
    g.add_argument("--block-size", type=positive_int, default=block_size, help="sequence length")
    g.add_argument("--batch", type=positive_int, default=batch, help="sequences per rank per step")
    g.add_argument("--vocab", type=positive_int, default=1021)


def add_sim_args(p: argparse.ArgumentParser, default_bw: str = "0") -> None:
    g = p.add_argument_group("simulated interconnect (CPU runs; off unless asked for)")
    g.add_argument("--sim-bandwidth", type=bandwidth, default=default_bw,
                   help="link bandwidth in GB/s (bus bytes), 0 = off (real gloo only)"
                        + (", auto = chosen so that communication about equals compute" if default_bw == "auto" else ""))
    g.add_argument("--sim-latency-us", type=nonnegative_float, default=50.0, help="per-collective latency of the simulated link")


def world_sizes_arg(p: argparse.ArgumentParser, default: list[int]) -> None:
    p.add_argument("--world-sizes", type=positive_int, nargs="+", default=default, help="W values to run (each >= 1)")


def parse(p: argparse.ArgumentParser, argv: list[str] | None, name: str, quick: list[str] = ()) -> argparse.Namespace:
    """Parse the command line, apply --quick's preset and --collect's recorded command line, and resolve the
    defaults that depend on the environment (launcher, SLURM config file). Keeps the command line in args.argv so
    that a sweep can record it."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    collect = args.collect
    if collect is not None:
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
    try:
        return finish_args(args)
    except SystemExit as exc:  # one line, under the script's own name, like argparse's own errors
        if isinstance(exc.code, str):
            p.error(exc.code)
        raise


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve defaults that depend on the environment (launcher, SLURM config file) and check what argparse
    cannot: all of it before torch is imported, so that a bad request costs a fraction of a second."""
    if args.launcher is None:
        args.launcher = "torchrun" if under_torchrun() else "local"
    if args.launcher == "torchrun" and not under_torchrun():
        raise SystemExit("--launcher torchrun: start the script with torchrun, e.g. "
                         "`torchrun --nproc-per-node=2 benchmarks/bench_step.py`")
    if getattr(args, "slurm_config", None):
        try:
            cfg = tomllib.loads(Path(args.slurm_config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SystemExit(f"--slurm-config {args.slurm_config}: {exc}") from None
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
    if args.launcher == "slurm":  # every W's job shape, before anything is submitted (W=1 runs as 1 x 1)
        for w in getattr(args, "world_sizes", []):
            job_shape(args, w)
    elif getattr(args, "device", "auto") == "cuda" and args.collect is None:
        # under SLURM the GPUs are on the compute nodes, not here; locally and under torchrun they must be here
        present, looked = gpu_present()
        if not present:
            raise SystemExit(f"--device cuda but this machine has no GPU ({looked}); use --device cpu (or auto), "
                             f"or run where the GPUs are (--launcher slurm / torchrun on a GPU node)")
    return args


def leave_process_group_together() -> None:
    """Under torchrun, every rank waits for the others (rank 0 writes the tables after the last collective) and then
    leaves the process group, before any interpreter exits. Without it a rank whose peers had already exited was
    killed by SIGABRT in gloo's teardown (seen once in CI on the two-node cluster), and torchrun reported a finished
    run as failed after waiting 300 s at its exit barrier. Only under torchrun: the local launcher's ranks leave the
    group in benchmarks/launch.py."""
    if not under_torchrun():
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Then leave without running C++ static destructors: even after the group is destroyed, a rank on the second
    # namespace once died in teardown with "terminate called without an active exception" (SIGABRT: a std::thread of
    # the rendezvous store destroyed while joinable), and the other node's agent then waited out its 300 s exit
    # barrier (CI, 2026-11-26). Every result is written and flushed by now; exit code 0 is what torchrun records.
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_script(main) -> None:
    """A script's entry point: the exits a user causes end in one message, not a traceback. Ctrl-C says what keeps
    running (benchmarks/sweep.py words it); a sweep with failed launches lists them after its tables were written;
    SLURM refusing a request gives SLURM's words."""
    import sys

    from benchmarks.slurm_launch import NeverRuns

    try:
        main()
        leave_process_group_together()
    except KeyboardInterrupt:
        sys.exit("interrupted (before any launch started); no result was changed")
    except (sweep.SweepFailed, NeverRuns) as exc:
        sys.exit(f"error: {exc}")
