"""Run the four benchmarks one after the other and gather their tables into one summary.

    python benchmarks/run_all.py                             # defaults: all four, CPU, about 4 minutes on 2 cores
    python benchmarks/run_all.py --only memory step
    python benchmarks/run_all.py --quick                     # tiny sizes, W=2 only: a smoke run (~1 min)
    python benchmarks/run_all.py --launcher slurm --slurm-config benchmarks/slurm/cluster.toml --device cuda
    torchrun --nproc-per-node=2 benchmarks/run_all.py        # each benchmark runs its W=2 cases only

Flags other than --only/--quick are passed to every benchmark (so use the shared ones: --out, --launcher,
--device, --threads, --sim-*, --slurm-*; see `python benchmarks/bench_memory.py --help`).

Output: <out>/{memory,comm,step,scaling}.{json,md,png} and <out>/summary.md (all the tables, with the wall time of
each benchmark).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_comm, bench_memory, bench_scaling, bench_step  # noqa: E402
from benchmarks import common as C  # noqa: E402

BENCHMARKS = {"memory": bench_memory, "comm": bench_comm, "step": bench_step, "scaling": bench_scaling}

# --quick: tiny model, W=2, one round: checks that everything runs and writes its outputs, measures nothing useful
QUICK_MODEL = ["--params", "2e5", "--layers", "2", "--block-size", "16", "--batch", "1"]
QUICK = {
    "memory": ["--world-sizes", "2", "--repeat", "1", "--strategies", "one process", "FSDP", "FSDP2 (torch)"]
              + QUICK_MODEL,
    "comm": ["--world-sizes", "2", "--max-size", "16KiB", "--budget", "0.01", "--strategies", "FSDP", "DDP (torch)"]
            + QUICK_MODEL,
    "step": ["--world-sizes", "2", "--rounds", "1", "--steps", "1", "--memory-rounds", "1", "--profile-steps", "1"]
            + QUICK_MODEL,
    "scaling": ["--world-sizes", "1", "2", "--params-per-rank", "1e5", "--layers", "2", "--block-size", "16",
                "--batch", "1", "--steps", "1", "--strategies", "FSDP", "DDP (torch)"],
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="tiny sizes, W=2: a smoke run")
    p.add_argument("--out", type=Path, default=C.DEFAULT_OUT)
    args, rest = p.parse_known_args(argv)
    t_all = time.perf_counter()
    sections, timings = [], {}
    for name in args.only:
        bench = BENCHMARKS[name]
        C.log(f"==== {name} ====")
        t0 = time.perf_counter()
        bench.main((QUICK[name] if args.quick else []) + ["--out", str(args.out)] + rest)
        timings[name] = time.perf_counter() - t0
        md = Path(args.out) / f"{name}.md"
        if C.is_writer() and md.exists():
            sections.append(f"## {name} ({timings[name]:.0f} s)\n\n{md.read_text()}")
    total = time.perf_counter() - t_all
    if C.is_writer():
        summary = (f"# Benchmarks{' (--quick: sizes too small to mean anything)' if args.quick else ''}\n\n"
                   f"Total {total:.0f} s; {C.environment()}\n\n" + "\n".join(sections))
        (Path(args.out) / "summary.md").write_text(summary)
        C.log(f"all done in {total:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
              + f"; summary in {Path(args.out) / 'summary.md'}")
    return {"seconds": total, "per_benchmark_s": timings}


if __name__ == "__main__":
    main()
