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

from benchmarks import bench_comm, bench_memory, bench_scaling, bench_step, gpt2_small  # noqa: E402
from benchmarks import report  # noqa: E402

BENCHMARKS = {"memory": bench_memory, "comm": bench_comm, "step": bench_step, "scaling": bench_scaling,
              "gpt2": gpt2_small}
DEFAULT = ["memory", "comm", "step", "scaling"]  # gpt2 (minutes on a CPU) only when asked: --only gpt2

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=DEFAULT)
    p.add_argument("--quick", action="store_true",
                   help="each benchmark's tiny preset: a smoke run, written to <out>/quick/ and labelled 'quick'")
    p.add_argument("--out", type=Path, default=None, help=f"default {report.DEFAULT_OUT} (--quick: .../quick)")
    args, rest = p.parse_known_args(argv)
    if args.out is None:  # a quick run never lands where the real tables are
        args.out = report.DEFAULT_OUT / "quick" if args.quick else report.DEFAULT_OUT
    t_all = time.perf_counter()
    sections, timings = [], {}
    for name in args.only:
        bench = BENCHMARKS[name]
        report.log(f"==== {name} ====")
        t0 = time.perf_counter()
        bench.main((["--quick"] if args.quick else []) + ["--out", str(args.out)] + rest)
        timings[name] = time.perf_counter() - t0
        md = Path(args.out) / f"{name}.md"
        if report.is_writer() and md.exists():
            sections.append(f"## {name} ({timings[name]:.0f} s)\n\n{md.read_text()}")
    total = time.perf_counter() - t_all
    if report.is_writer():
        summary = (f"# Benchmarks{' (quick run, --quick: sizes too small to mean anything)' if args.quick else ''}\n\n"
                   f"Total {total:.0f} s; {report.environment()}\n\n" + "\n".join(sections))
        (Path(args.out) / "summary.md").write_text(summary)
        report.log(f"all done in {total:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
              + f"; summary in {Path(args.out) / 'summary.md'}")
    return {"seconds": total, "per_benchmark_s": timings}


if __name__ == "__main__":
    main()
