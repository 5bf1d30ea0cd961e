"""Run the four benchmarks one after the other and gather their tables into one summary.

    python benchmarks/run_all.py                             # defaults: all four, CPU, 167-297 s on 2 quiet cores (README)
    python benchmarks/run_all.py --only memory step
    python benchmarks/run_all.py --quick                     # tiny sizes, W=2 only: a smoke run (~1 min)
    python benchmarks/run_all.py --launcher slurm --slurm-config benchmarks/slurm/cluster.toml --device cuda \\
        --slurm-nodes 2 --world-sizes 8 16                   # 8 = 2 nodes x 4 GPUs; the W=1 baselines: 1 task
    torchrun --nproc-per-node=2 benchmarks/run_all.py        # each benchmark runs its W=2 cases only

Every other flag goes to the benchmarks that have it (--out, --launcher, --device, --world-sizes, --slurm-* go to
all of them; --sim-bandwidth only to comm and step; see each script's --help). A flag that none of the chosen
benchmarks knows, or a value one of them refuses, stops run_all before anything runs, under its own name.

A benchmark that fails (a launch failed, SLURM refused a request) does not stop the others: its tables of what
finished are written (<name>.incomplete.*, see benchmarks/sweep.py), and run_all exits with an error at the end.

Output: <out>/{memory,comm,step,scaling}.{json,md,png} and <out>/summary.md (all the tables, with the wall time of
each benchmark).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_comm, bench_memory, bench_scaling, bench_step, gpt2_small  # noqa: E402
from benchmarks import cli, report, sweep  # noqa: E402

BENCHMARKS = {"memory": bench_memory, "comm": bench_comm, "step": bench_step, "scaling": bench_scaling,
              "gpt2": gpt2_small}
DEFAULT = ["memory", "comm", "step", "scaling"]  # gpt2 (minutes on a CPU) only when asked: --only gpt2


def split_flags(rest: list[str]) -> list[list[str]]:
    """['--a', '1', '2', '--b'] -> [['--a', '1', '2'], ['--b']]: each flag with its values."""
    groups: list[list[str]] = []
    for token in rest:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def route(p: argparse.ArgumentParser, names: list[str], rest: list[str]) -> dict[str, list[str]]:
    """Each benchmark's share of the flags: those its parser has. A flag no chosen benchmark has is an error."""
    known = {name: BENCHMARKS[name].parser()._option_string_actions for name in names}
    per: dict[str, list[str]] = {name: [] for name in names}
    for group in split_flags(rest):
        flag = group[0].split("=", 1)[0]
        takers = [name for name in names if flag in known[name]]
        if not takers:
            p.error(f"unrecognized argument {group[0]!r}: none of {', '.join(names)} has it "
                    f"(see `python benchmarks/bench_step.py --help`)")
        for name in takers:
            per[name] += group
    return per


def passed_on() -> str:
    """--help's list of the flags run_all passes on, each with the benchmarks that take it."""
    takers: dict[str, list[str]] = {}
    helps: dict[str, str] = {}
    for name, bench in BENCHMARKS.items():
        for action in bench.parser()._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--quick", "--out"):
                    takers.setdefault(flag, []).append(name)
                    helps.setdefault(flag, textwrap.shorten(re.sub(r"%\(\w+\)s|%", "", action.help or "").split(";")[0],
                                                           64, placeholder=" ..."))
    lines = ["flags passed on to the benchmarks that have them (each benchmark's own --help has the details):"]
    for flag in sorted(takers):
        who = "all" if len(takers[flag]) == len(BENCHMARKS) else ", ".join(takers[flag])
        lines.append(f"  {flag:<22} [{who}] {helps[flag]}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="run_all.py", description=__doc__.split("\n\n")[0], epilog=passed_on(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=DEFAULT)
    p.add_argument("--quick", action="store_true",
                   help="each benchmark's tiny preset: a smoke run, written to <out>/quick/ and labelled 'quick'")
    p.add_argument("--out", type=Path, default=None, help=f"default {report.DEFAULT_OUT} (--quick: .../quick)")
    args, rest = p.parse_known_args(argv)
    if args.out is None:  # a quick run never lands where the real tables are
        args.out = report.DEFAULT_OUT / "quick" if args.quick else report.DEFAULT_OUT
    per = route(p, args.only, rest)
    # Every benchmark run_all chains plots its tables: without matplotlib the sweep would run in full and then
    # trace back, so stop before anything runs. (The check lives here, not in cli.py, because cli.py is part of
    # the code fingerprinted by the staff results; the single scripts get it with the next staff run.)
    if importlib.util.find_spec("matplotlib") is None:
        p.error("matplotlib is not installed, and the benchmarks plot their tables: "
                "pip install -e \".[bench]\"   (or: pip install \"matplotlib>=3.8\")")
    argvs = {name: (["--quick"] if args.quick else []) + ["--out", str(args.out)] + per[name] for name in args.only}
    for name in args.only:  # every benchmark's flags are checked before the first one runs (and before torch)
        bench = BENCHMARKS[name]
        sub = bench.parser()
        sub.prog = f"{p.prog} ({name})"  # its errors come under run_all's name
        cli.parse(sub, argvs[name], bench.NAME, bench.QUICK)
    t_all = time.perf_counter()
    sections, timings, failed = [], {}, {}
    for name in args.only:
        bench = BENCHMARKS[name]
        report.log(f"==== {name} ====")
        t0 = time.perf_counter()
        try:
            bench.main(argvs[name])
        except sweep.SweepFailed as exc:  # its tables of what finished are written; the others still run
            failed[name] = str(exc)
            report.log(f"{name} FAILED (going on with the others): {str(exc).splitlines()[0]}", quiet=False)
        timings[name] = time.perf_counter() - t0
        md = Path(args.out) / (f"{name}.incomplete.md" if name in failed else f"{name}.md")
        if report.is_writer() and md.exists():
            sections.append(f"## {name} ({timings[name]:.0f} s){' INCOMPLETE' if name in failed else ''}\n\n"
                            f"{md.read_text()}")
    total = time.perf_counter() - t_all
    if report.is_writer():
        summary = (f"# Benchmarks{' (quick run, --quick: sizes too small to mean anything)' if args.quick else ''}\n\n"
                   f"Total {total:.0f} s; driver: {report.environment()}\n\n" + "\n".join(sections))
        name = "summary.incomplete.md" if failed else "summary.md"
        (Path(args.out) / name).write_text(summary)
        report.log(f"all done in {total:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
                   + f"; summary in {Path(args.out) / name}")
    if failed:
        raise sweep.SweepFailed(f"{len(failed)} benchmark(s) failed: {', '.join(failed)}\n"
                                + "\n".join(failed.values()))
    return {"seconds": total, "per_benchmark_s": timings}


if __name__ == "__main__":
    cli.run_script(main)
