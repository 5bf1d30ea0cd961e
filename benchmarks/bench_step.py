"""Step time: one process vs FSDP without and with prefetching vs torch's FSDP2 vs torch's DDP, with the exposed
(not overlapped) communication read from a torch.profiler trace, and the FSDP / FSDP2 ratios measured alternating.

    python benchmarks/bench_step.py                          # W = 2 on CPU, real gloo, then the simulated link
    python benchmarks/bench_step.py --sim-bandwidth 0        # real gloo only
    python benchmarks/bench_step.py --sim-bandwidth 0.5 --sim-latency-us 20
    torchrun --nproc-per-node=8 benchmarks/bench_step.py --sim-bandwidth 0   # NCCL on a GPU box

How it measures. One launch of W ranks builds every strategy's model (same GPT, same seed), warms each up, then
runs ``--rounds`` rounds; in each round every strategy runs ``--steps`` steps, in an order that rotates from
round to round, so slow drift of the machine (other processes, thermal) hits all strategies alike. A strategy's
time in a round is the median of its steps (each step starts at a barrier); its step time is the median over
rounds. A ratio (FSDP / FSDP2, prefetch / no prefetch) is computed round by round and its median reported, as the
issue asks: "the median of alternated runs". "one process" runs in its own launch with W=1: it is the time of
the same per-rank batch with no communication at all.

Exposed communication (the writeup's definition): the time during the step when at least one collective is in
flight on that rank and no compute op runs on it. After the rounds, each strategy runs under torch.profiler with a
schedule (1 wait step, 1 warm-up step, --profile-steps recorded steps; every step, phase and FSDP unit labelled);
per rank, the exposed time is the median over the recorded steps, shown as a fraction of the step with its
milliseconds and the total communication time beside it; the cell gives the median over ranks and the min-max over
ranks. See benchmarks/trace.py (how "in flight" and "compute" are read on a CPU and on a GPU; stock DDP's C++
all-reduce is not visible on a CPU: n/a). Each rank's Chrome/Perfetto trace is kept (gzip) in
<out>/step.sweep/traces/<interconnect>/<strategy>-W<W>-rank<r>.json.gz: open it at ui.perfetto.dev.

Timeline picture (<out>/step_timeline.png): one more step of "FSDP" and "FSDP + prefetch" (one above the other) on
the last interconnect, per rank: what the training thread did (computing or waiting on a collective), every
all-gather and reduce-scatter in flight labelled by its unit, and the live and unsharded memory over the step. On
GPUs the same step's CUDA memory snapshot is kept too (<out>/step.sweep/traces/memory_snapshot-<strategy>-W<W>-
rank<r>.pickle, for https://pytorch.org/memory_viz; written, like the whole GPU path, without a GPU to run it on).

Simulated interconnect (CPU): gloo over loopback on a busy CPU is neither a network nor a GPU interconnect, and
its transfers take CPU time away from compute, so prefetching can hardly overlap anything. With
``--sim-bandwidth`` every collective also waits (sleeping, CPU left to compute) until a simulated link of that
bandwidth and latency would have delivered it (benchmarks.comm_meter.SimLink). ``auto`` (the default) sets the
bandwidth so that communication about equals compute: bus bytes of one FSDP step / compute time of one step of the
same per-rank batch without communication, both measured in the same launch. The table says which interconnect
each row used, and the log says SIMULATED INTERCONNECT ON.

Memory ratio: FSDP's and FSDP2's per-rank peak of one step (LiveStorageTracker), measured alternately too.

Output: <out>/step.json, step.md (two tables), step.png, step_timeline.png, the traces (above).

Table headers (step.md; the writeup copies them):

| strategy | W | interconnect | step ms | vs one process | exposed comm | tokens/s |
| comparison | W | interconnect | ratio (median) | min | max | rounds |
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import cli, report, sweep, trainers  # noqa: E402  (none of these imports torch)
from benchmarks.cli import QUICK_MODEL  # noqa: E402

# imported on first use (inside the ranks, or after the flags were checked): see benchmarks/__init__.py
torch = lazy_import("torch")
dist = lazy_import("torch.distributed")
comm_meter, launch, measure, trace = (lazy_import(f"benchmarks.{m}")
                                      for m in ("comm_meter", "launch", "measure", "trace"))

NAME = "step"
# --quick: tiny sizes that check the plumbing (written to <out>/quick/, tables labelled "quick")
QUICK = ["--world-sizes", "2", "--rounds", "1", "--steps", "1", "--memory-rounds", "1", "--profile-steps", "1"] + QUICK_MODEL
HEADERS = ["strategy", "W", "interconnect", "step ms", "vs one process", "exposed comm", "tokens/s"]
HEADERS_RATIO = ["comparison", "W", "interconnect", "ratio (median)", "min", "max", "rounds"]
STRATEGIES = ["FSDP", "FSDP + prefetch", "FSDP + prefetch, 2 blocks/unit", "FSDP2 (torch)", "DDP (torch)"]
# (label, numerator, denominator, what)
RATIOS = [("FSDP / FSDP2 step time", "FSDP", "FSDP2 (torch)", "time"),
          ("FSDP + prefetch / FSDP2 step time", "FSDP + prefetch", "FSDP2 (torch)", "time"),
          ("FSDP + prefetch / FSDP step time", "FSDP + prefetch", "FSDP", "time"),
          ("2 blocks/unit / 1 block/unit step time (prefetch)", "FSDP + prefetch, 2 blocks/unit", "FSDP + prefetch",
           "time"),
          ("FSDP / FSDP2 peak memory", "FSDP", "FSDP2 (torch)", "memory")]


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def run_rounds(built: dict, ctx: launch.RankContext, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per strategy, one time per round (median of ``steps`` steps); the order rotates every round."""
    names = list(built)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            per_round[name].append(report.median(measure.timed_steps(built[name], ctx.rank, steps)))
        ctx.log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {per_round[n][-1] * 1e3:.0f} ms" for n in names))
    return per_round


def worker(ctx: launch.RankContext, payload: dict) -> dict:
    cfg = trainers.model_config(payload)
    names = payload["strategies"]
    out: dict = {"phases": []}
    with comm_meter.CommMeter() as meter:
        if names == ["one process"]:  # the W=1 baseline: time only
            trainer = trainers.build_trainer("one process", cfg, payload["batch"], ctx.device, meter)
            measure.timed_steps(trainer, ctx.rank, 2)
            times = run_rounds({"one process": trainer}, ctx, payload["rounds"], payload["steps"])
            out["phases"].append({"interconnect": payload["real_name"], "times": times, "exposed": {}})
            return out

        built, bus_per_step = {}, {}
        out["skipped"] = {}
        for n in names:  # build, warm up (lazy init, first-call allocations), count one step's bytes
            try:
                t = trainers.build_trainer(n, cfg, payload["batch"], ctx.device, meter)
                t.step(ctx.rank)
            except NotImplementedError as exc:
                out["skipped"][n] = trainers.skipped(n, exc, ctx)["skipped"]
                continue
            meter.reset()
            t.step(ctx.rank)
            bus_per_step[n] = sum(s["bus_bytes"] for s in meter.summary().values())
            built[n] = t
        out["bus_bytes_per_step"] = bus_per_step

        phases = [(payload["real_name"], None)]
        if payload["sim_bandwidth"] == "auto":
            # compute time of one step with no communication, measured here under the same CPU contention
            local = trainers.build_trainer("one process", cfg, payload["batch"], ctx.device)
            measure.timed_steps(local, ctx.rank, 2)
            compute = torch.tensor([report.median(measure.timed_steps(local, ctx.rank, 5))], dtype=torch.float64)
            dist.all_reduce(compute)
            compute = compute.item() / ctx.world_size
            del local
            fsdp_bytes = bus_per_step.get("FSDP", max(bus_per_step.values(), default=0.0)) or 1.0
            bandwidth = fsdp_bytes / compute / 1e9
            out["calibration"] = {"compute_s": compute, "fsdp_bus_bytes": fsdp_bytes, "bandwidth_gbps": bandwidth}
            phases.append(("sim", comm_meter.SimLink(bandwidth, payload["sim_latency_us"])))
        elif float(payload["sim_bandwidth"]) > 0:
            phases.append(("sim", comm_meter.SimLink(float(payload["sim_bandwidth"]), payload["sim_latency_us"])))

        for label, link in phases:
            meter.link = link
            if link is not None:
                label = f"simulated {link.bandwidth / 1e9:.3g} GB/s"
                ctx.log(link.describe())
            # stock DDP all-reduces inside its C++ reducer, where the simulated link cannot delay it: real link only
            runs = {n: t for n, t in built.items() if link is None or trainers.STRATEGIES[n][0] != "ddp"}
            times = run_rounds(runs, ctx, payload["rounds"], payload["steps"])
            exposed = {n: trace.profile(t, ctx.rank, meter, payload["profile_steps"], "keep") for n, t in runs.items()}
            out["phases"].append({"interconnect": label, "times": times, "exposed": exposed})
            # the timeline picture: one step of FSDP without and with prefetching, on the last interconnect
            out["timelines"] = {n: trace.timeline(built[n], ctx.rank, meter) for n in ("FSDP", "FSDP + prefetch")
                                if n in runs}
        meter.link = None

        # FSDP vs FSDP2 peak memory, alternately
        mem_names = [n for n in ("FSDP", "FSDP2 (torch)") if n in built]
        out["peak_bytes"] = {n: [] for n in mem_names}
        for _ in range(payload["memory_rounds"]):
            for n in mem_names:
                out["peak_bytes"][n].append(measure.peak_of_one_step(built[n], ctx.rank))
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def exposed_cell(per_rank: list[dict]) -> str:
    """The table cell: fraction (median over ranks, min-max over ranks), then ms exposed of ms in flight."""
    got = [e for e in per_rank if e.get("exposed_comm_fraction") is not None]
    if not got:
        return "n/a (not visible: C++ reducer)"
    fr = [e["exposed_comm_fraction"] for e in got]

    def ms(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    return (f"{statistics.median(fr):.0%} of the profiled step ({min(fr):.0%}-{max(fr):.0%} over ranks); "
            f"{ms(statistics.median(e['exposed_comm_ms'] for e in got))} of "
            f"{ms(statistics.median(e['comm_ms'] for e in got))} ms in flight")


def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [2])
    cli.add_model_args(p, params=4e6, layers=8, block_size=32, batch=8)
    cli.add_sim_args(p, default_bw="auto")
    p.add_argument("--rounds", type=cli.positive_int, default=5, help="alternated rounds")
    p.add_argument("--steps", type=cli.positive_int, default=2, help="timed steps per strategy per round")
    p.add_argument("--memory-rounds", type=cli.positive_int, default=2, help="alternated peak-memory measurements")
    p.add_argument("--profile-steps", type=cli.positive_int, default=4,
                   help="recorded profiler steps per strategy, after 1 wait and 1 warm-up step (exposed comm)")
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=[s for s in trainers.STRATEGIES if s != "one process"])
    p.add_argument("--no-one-process", action="store_true", help="skip the W=1 baseline launch")
    return p


def main(argv=None) -> dict:
    args = cli.parse(parser(), argv, NAME, QUICK)
    cfg = trainers.model_config(args)
    real_name = "nccl" if args.device == "cuda" else "gloo (real)"
    payload = {**trainers.model_payload(args), "strategies": args.strategies, "rounds": args.rounds, "steps": args.steps,
               "memory_rounds": args.memory_rounds, "profile_steps": args.profile_steps, "sim_bandwidth": args.sim_bandwidth,
               "sim_latency_us": args.sim_latency_us, "real_name": real_name}
    report.log(f"step: GPT {trainers.param_count(cfg) / 1e6:.2f}M params, batch {args.batch}x{args.block_size} per rank, "
          f"W in {args.world_sizes}, {args.rounds} rounds x {args.steps} steps", quiet=args.quiet)
    if args.sim_bandwidth != "0":
        report.log(f"SIMULATED INTERCONNECT ON for the second pass (--sim-bandwidth {args.sim_bandwidth}, "
              f"{args.sim_latency_us:g} us latency); the first pass is {real_name}", quiet=False)

    one = None
    launches = [] if args.no_one_process else [("one", 1, {**payload, "strategies": ["one process"]})]
    launches += [(f"W{w}", w, payload) for w in args.world_sizes]
    done = sweep.run(args, NAME, "benchmarks.bench_step:worker", launches)
    if "one" in done:
        one_rounds = done["one"][0]["phases"][0]["times"]["one process"]
        one = report.median(one_rounds)
    results = {w: done[f"W{w}"] for w in args.world_sizes if f"W{w}" in done}
    if not report.is_writer():
        return {}

    tokens = args.batch * args.block_size
    rows, ratio_rows, records, ratio_records = [], [], [], []
    if one is not None:
        rows.append(["one process", 1, "none", report.spread(one_rounds, 1e3), "1.00x", "0%", tokens / one])
        records.append({"strategy": "one process", "world_size": 1, "interconnect": "none", "step_s": one,
                        "per_round_s": one_rounds})  # the row's min-max, so a pasted row can be checked whole
    for w, ranks in results.items():
        r0 = ranks[0]  # every rank passed the same barriers: rank 0's times are the step times
        for phase in r0["phases"]:
            ic = phase["interconnect"]
            for name, per_round in phase["times"].items():
                step = report.median(per_round)
                exposed = [rk["phases"][r0["phases"].index(phase)]["exposed"][name] for rk in ranks]
                rows.append([name, w, ic, report.spread(per_round, 1e3), f"{step / one:.2f}x" if one else None,
                             exposed_cell(exposed), w * tokens / step])
                records.append({"strategy": name, "world_size": w, "interconnect": ic, "step_s": step,
                                "per_round_s": per_round, "exposed": exposed,
                                "vs_one_process": step / one if one else None,
                                "bus_bytes_per_step": r0.get("bus_bytes_per_step", {}).get(name)})
            for label, num, den, what in RATIOS:
                if what != "time" or num not in phase["times"] or den not in phase["times"]:
                    continue
                rs = [a / b for a, b in zip(phase["times"][num], phase["times"][den])]
                ratio_rows.append([label, w, ic, report.median(rs), min(rs), max(rs), len(rs)])
                ratio_records.append({"comparison": label, "world_size": w, "interconnect": ic, "median": report.median(rs),
                                      "per_round": rs})
        for label, num, den, what in RATIOS:
            if what == "memory" and num in r0.get("peak_bytes", {}) and den in r0["peak_bytes"]:
                # the worst rank's peak, per alternated measurement
                nums = [max(rk["peak_bytes"][num][i] for rk in ranks) for i in range(len(r0["peak_bytes"][num]))]
                dens = [max(rk["peak_bytes"][den][i] for rk in ranks) for i in range(len(r0["peak_bytes"][den]))]
                rs = [a / b for a, b in zip(nums, dens)]
                ratio_rows.append([label, w, "-", report.median(rs), min(rs), max(rs), len(rs)])
                ratio_records.append({"comparison": label, "world_size": w, "median": report.median(rs), "per_round": rs,
                                      "peak_bytes": {num: nums, den: dens}})

    calib = {w: rk[0].get("calibration") for w, rk in results.items() if rk[0].get("calibration")}
    md = (f"GPT {trainers.param_count(cfg) / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}), batch "
          f"{args.batch}x{args.block_size} tokens per rank, fp32, AdamW, {args.threads} thread(s) per rank; "
          f"step = median over {args.rounds} alternated rounds of the median of {args.steps} steps.\n")
    for w, c in calib.items():
        md += (f"Simulated interconnect (W={w}): {c['bandwidth_gbps']:.3g} GB/s = FSDP bus bytes per step "
               f"{c['fsdp_bus_bytes'] / report.MiB:.1f} MiB / compute per step {c['compute_s'] * 1e3:.0f} ms, "
               f"{args.sim_latency_us:g} us latency.\n")
    skipped = sorted({f"- {n} (W={w}): not measured ({msg})" for w, rk in results.items()
                      for n, msg in rk[0].get("skipped", {}).items()})
    methods = sorted({e["method"] for w, rk in results.items() for ph in rk[0]["phases"] for e in ph["exposed"].values()})
    md += ("step ms: median over rounds (min-max over rounds, n = rounds). exposed comm: the time during the step when "
           "at least one collective is in flight on a rank and no compute op runs on it, as a share of the profiled "
           "step: median over ranks (min-max over ranks) of each rank's median over its profiled steps, then its "
           "milliseconds and the total communication (in flight) time, median over ranks. Measured from the "
           + "; ".join(methods) + f". Per-rank traces: {args.out}/step.sweep/traces/.\n")
    if any(ph["interconnect"].startswith("simulated") for rk in results.values() for ph in rk[0]["phases"]):
        md += ("DDP (torch) is stock DistributedDataParallel: its all-reduce runs inside its C++ reducer, which the "
               "simulated link cannot slow down, so it appears under the real interconnect only.\n")
    md += "\n" + report.markdown_table(HEADERS, rows) + "\n" + report.markdown_table(HEADERS_RATIO, ratio_rows)
    md += ("\n" + "\n".join(skipped) + "\n") if skipped else ""
    raw = {"benchmark": NAME, "config": vars(args) | {"gpt": cfg.__dict__}, "environment": report.environment(),
           "one_process_step_s": one, "calibration": calib, "results": records, "ratios": ratio_records}

    def plot():
        import matplotlib.pyplot as plt

        ics = list(dict.fromkeys(r["interconnect"] for r in records if r["world_size"] > 1))
        fig, axes = plt.subplots(1, max(1, len(ics)), figsize=(5.8 * max(1, len(ics)), 4.8),
                                 squeeze=False, sharey=True)
        for ax, ic in zip(axes[0], ics):
            recs = [r for r in records if r["interconnect"] == ic]
            x = list(range(len(recs)))
            step = [r["step_s"] * 1e3 for r in recs]
            lo = [s - min(r["per_round_s"]) * 1e3 for s, r in zip(step, recs)]
            hi = [max(r["per_round_s"]) * 1e3 - s for s, r in zip(step, recs)]
            ax.bar([i - 0.27 for i in x], step, 0.27, yerr=[lo, hi], capsize=3, color="#4C72B0",
                   label="step (timed; min-max over rounds)")
            for offset, key, color, what in ((0.0, "comm_ms", "#999999", "communication in flight"),
                                             (0.27, "exposed_comm_ms", "#C44E52", "exposed communication")):
                vals = [[e[key] for e in r["exposed"] if e.get(key) is not None] for r in recs]
                mid = [statistics.median(v) if v else 0.0 for v in vals]
                err = [[m - min(v) if v else 0 for m, v in zip(mid, vals)], [max(v) - m if v else 0 for m, v in zip(mid, vals)]]
                ax.bar([i + offset for i in x], mid, 0.27, yerr=err, capsize=3, color=color,
                       label=f"{what} (profiled; min-max over ranks)")
            if one is not None:
                ax.axhline(one * 1e3, color="black", ls="--", lw=1, label="one process (W=1)")
            ax.set_xticks(x, [f"{r['strategy']}\nW={r['world_size']}" for r in recs], fontsize=8)
            ax.set_ylabel("ms per step")
            ax.set_title(ic, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        if axes[0][0].get_legend_handles_labels()[0]:  # nothing to label where no rank communicates (W=1)
            axes[0][0].legend(fontsize=7, loc="upper left", framealpha=0.9)
        fig.suptitle(f"Step time and communication, GPT {trainers.param_count(cfg) / 1e6:.1f}M params, batch "
                     f"{args.batch}x{args.block_size} per rank", fontsize=10)
        fig.tight_layout()
        return fig

    traces = Path(args.sweep_folder) / "traces"  # kept with the sweep: <out>/step.sweep/traces once complete
    timelines = {}
    for w, ranks in results.items():
        for ph_i, phase in enumerate(ranks[0]["phases"]):
            for name in phase["exposed"]:
                for r, rk in enumerate(ranks):
                    gz = rk["phases"][ph_i]["exposed"][name].pop("trace_gz", None)
                    if gz is not None and report.is_writer():
                        folder = traces / re.sub(r"[^A-Za-z0-9.+-]+", "_", phase["interconnect"]).strip("_")
                        folder.mkdir(parents=True, exist_ok=True)
                        (folder / f"{re.sub(r'[^A-Za-z0-9.+-]+', '_', name).strip('_')}-W{w}-rank{r}.json.gz").write_bytes(gz)
        for r, rk in enumerate(ranks):  # on GPUs: the CUDA memory snapshot of each timeline step
            for name, tl in (rk.get("timelines") or {}).items():
                snap = tl.pop("cuda_snapshot", None)
                if snap is not None and report.is_writer():
                    traces.mkdir(parents=True, exist_ok=True)
                    safe = re.sub(r"[^A-Za-z0-9.+-]+", "_", name).strip("_")
                    (traces / f"memory_snapshot-{safe}-W{w}-rank{r}.pickle").write_bytes(snap)
        if ranks[0].get("timelines"):
            timelines[w] = {"interconnect": ranks[0]["phases"][-1]["interconnect"],
                            "ranks": [rk["timelines"] for rk in ranks]}
    raw["timelines"] = timelines
    more = {}
    if timelines:
        from benchmarks import timeline

        w_max = max(timelines)
        more["timeline"] = lambda: timeline.draw(timelines[w_max], trainers.unit_param_counts(cfg), w_max,
                                                 f"GPT {trainers.param_count(cfg) / 1e6:.1f}M params")
    sweep.finish(args, NAME, raw, md, plot, more_plots=more)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
