"""Scaling: weak scaling (the work per rank is fixed) and strong scaling (the total work is fixed) of one model.

    python benchmarks/bench_scaling.py                       # W = 1, 2, 4 on CPU, a 4M-parameter GPT
    python benchmarks/bench_scaling.py --params 2e7 --batch 8 --world-sizes 1 2 4 8 --device cuda
    torchrun --nproc-per-node=8 benchmarks/bench_scaling.py  # one W per torchrun launch: the others are skipped

The model is the same at every W (--params, --layers). What changes is the batch:

    weak     every rank trains --batch sequences per step, so the global batch is W x --batch: the work per rank
             is fixed, and a perfectly scaling system keeps the step time constant.
                 weak efficiency   = t(W0) / t(W)
    strong   the global batch is fixed (--global-batch, default --batch x the largest W) and split over the ranks:
             each trains global/W sequences. A perfectly scaling system divides the step time by W.
                 strong efficiency = (W0 x t(W0)) / (W x t(W))

W0 is the smallest W measured (1 by default: one process, the same model, no communication). Communication per
rank per step does not shrink with W (FSDP moves about 3Ψ(W-1)/W per rank), so strong scaling is the harder test.

For each W one launch builds every strategy once; for each of the two batches it takes one warm-up step, times
--steps steps (each starts at a barrier) and measures the per-rank peak of one more (LiveStorageTracker on CPU,
worst rank). The step ms column is the median with its spread over the timed steps: "median (min-max, n=steps)".

On a CPU, W ranks share the machine's cores; once W exceeds the cores, ranks time-share them and the step times
say more about the CPU than about scaling (the table notes when this happens). On GPUs (one per rank) they are
the real thing.

Output: <out>/scaling.json, scaling.md, scaling.png.

Table header (scaling.md; the writeup copies it):

| scaling | strategy | W | global batch | batch per rank | step ms | efficiency | tokens/s | peak MiB per rank |
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import cli, report, sweep, trainers  # noqa: E402  (none of these imports torch)

# imported on first use (inside the ranks): see benchmarks/__init__.py
launch, measure = lazy_import("benchmarks.launch"), lazy_import("benchmarks.measure")

NAME = "scaling"
HEADERS = ["scaling", "strategy", "W", "global batch", "batch per rank", "step ms", "efficiency", "tokens/s",
           "peak MiB per rank"]
STRATEGIES = ["FSDP", "FSDP + prefetch", "FSDP2 (torch)", "DDP (torch)"]
QUICK = ["--world-sizes", "1", "2", "--params", "1e5", "--layers", "2", "--block-size", "16", "--batch", "1",
         "--steps", "1", "--strategies", "FSDP", "DDP (torch)"]


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def worker(ctx: launch.RankContext, payload: dict) -> dict:
    cfg = trainers.model_config(payload)
    out = {}
    for name in payload["strategies"]:
        try:
            trainer = trainers.build_trainer(name, cfg, payload["batch"], ctx.device)
            trainer.step(ctx.rank)  # lazy init, first allocations
        except NotImplementedError as exc:
            out[name] = trainers.skipped(name, exc, ctx)
            continue
        out[name] = {}
        for mode, per_rank in payload["batches"].items():
            trainer.batch = per_rank
            trainer.step(ctx.rank)  # warm-up at this batch size
            times = measure.timed_steps(trainer, ctx.rank, payload["steps"])
            peak = measure.peak_of_one_step(trainer, ctx.rank)
            out[name][mode] = {"times_s": times, "step_s": report.median(times), "peak_bytes": peak,
                               "batch_per_rank": per_rank}
            ctx.log(f"{name} {mode} (batch {per_rank}/rank): {report.median(times) * 1e3:.0f} ms/step, "
                    f"peak {peak / report.MiB:.1f} MiB")
        del trainer
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [1, 2, 4])
    cli.add_model_args(p, params=4e6, layers=8, block_size=32, batch=4)
    p.add_argument("--global-batch", type=cli.positive_int, default=None,
                   help="strong scaling's global batch (default --batch x the largest W); every W must divide it")
    p.add_argument("--steps", type=cli.positive_int, default=3, help="timed steps per strategy and batch (median and spread)")
    p.add_argument("--strategies", nargs="+", default=STRATEGIES,
                   choices=[s for s in trainers.STRATEGIES if s != "one process"])
    return p


def main(argv=None) -> dict:
    args = cli.parse(parser(), argv, NAME, QUICK)
    global_batch = args.global_batch or args.batch * max(args.world_sizes)
    bad = [w for w in args.world_sizes if global_batch % w]
    if bad:
        parser().error(f"--global-batch {global_batch} is not divisible by W = {bad}")
    cfg = trainers.model_config(args)
    psi = trainers.param_count(cfg)
    report.log(f"scaling: GPT {psi / 1e6:.2f}M params, W in {args.world_sizes}; weak: {args.batch} sequences per "
               f"rank; strong: {global_batch} sequences in all", quiet=args.quiet)
    launches = [(f"W{w}", w, {**trainers.model_payload(args), "strategies": args.strategies, "steps": args.steps,
                              "batches": {"weak": args.batch, "strong": global_batch // w}})
                for w in args.world_sizes]
    done = sweep.run(args, NAME, "benchmarks.bench_scaling:worker", launches)
    if not report.is_writer():
        return {}
    results = {w: done[f"W{w}"] for w in args.world_sizes if f"W{w}" in done}

    cores = os.cpu_count() or 1
    rows, records = [], []
    base_w = min(results) if results else None
    skipped = sorted({f"- {name}: not measured ({ranks[0][name]['skipped']})" for ranks in results.values()
                      for name in args.strategies if "skipped" in ranks[0][name]})
    for mode in ("weak", "strong"):
        for name in args.strategies:
            if any("skipped" in ranks[0][name] for ranks in results.values()):
                continue
            base = results[base_w]
            base_step = max(r[name][mode]["step_s"] for r in base)
            base_peak = max(r[name][mode]["peak_bytes"] for r in base)
            for w, ranks in results.items():
                per = [r[name][mode] for r in ranks]
                step = max(x["step_s"] for x in per)  # every rank passes the same barriers: about equal
                slowest = max(per, key=lambda x: x["step_s"])
                def efficiency(t):
                    return base_step / t if mode == "weak" else base_w * base_step / (w * t)

                eff = efficiency(step)
                eff_range = (efficiency(max(slowest["times_s"])), efficiency(min(slowest["times_s"])))
                batch = per[0]["batch_per_rank"]
                peak = max(x["peak_bytes"] for x in per)
                tokens = w * batch * args.block_size / step
                rows.append([mode, name, w, w * batch, batch, report.spread(slowest["times_s"], 1e3), f"{eff:.2f}",
                             tokens, peak / report.MiB])
                records.append({"scaling": mode, "strategy": name, "world_size": w, "global_batch": w * batch,
                                "batch_per_rank": batch, "step_s": step, "efficiency": eff, "tokens_per_s": tokens,
                                "efficiency_range": eff_range,
                                "peak_bytes": peak, "peak_vs_base": peak / base_peak, "psi_params": psi,
                                "per_rank": per})

    md = (f"GPT {psi / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}) at every W, sequences of "
          f"{args.block_size} tokens, fp32, AdamW. weak: {args.batch} sequences per rank (global batch grows with W), "
          f"efficiency t(W0)/t(W); strong: {global_batch} sequences in all, split over the ranks, efficiency "
          f"W0·t(W0)/(W·t(W)); W0 = {base_w}. step ms = median (min-max, n = timed steps) of the slowest rank; "
          f"peak = worst rank, LiveStorageTracker.\n")
    if args.device != "cuda" and results and max(results) > cores:
        md += (f"Note: this machine has {cores} CPU cores; at W > {cores} the ranks time-share cores, so step "
               f"times there measure the CPU, not scaling.\n")
    md += "\n" + report.markdown_table(HEADERS, rows) + ("\n" + "\n".join(skipped) + "\n" if skipped else "")
    raw = {"benchmark": NAME, "config": vars(args) | {"gpt": cfg.__dict__, "global_batch": global_batch},
           "environment": report.environment(), "results": records, "skipped": skipped}

    def plot():
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
        for ax, mode in zip(axes, ("weak", "strong")):
            for name in dict.fromkeys(r["strategy"] for r in records):
                recs = [r for r in records if r["strategy"] == name and r["scaling"] == mode]
                ax.errorbar([r["world_size"] for r in recs], [r["efficiency"] for r in recs], fmt="-o", capsize=3,
                            yerr=[[r["efficiency"] - r["efficiency_range"][0] for r in recs],
                                  [r["efficiency_range"][1] - r["efficiency"] for r in recs]], label=name)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xlabel("W")
            ax.set_xticks(sorted(results))
            ax.set_ylabel("efficiency (1 = perfect; bars: the W's fastest-slowest step)")
            ax.set_title(f"{mode} scaling", fontsize=10)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if args.device != "cuda" and results and max(results) > cores:
                ax.axvspan(cores + 0.5, max(results) + 0.5, color="grey", alpha=0.15, label=f"W > {cores} cores")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Scaling, GPT {psi / 1e6:.1f}M params", fontsize=11)
        fig.tight_layout()
        return fig

    sweep.finish(args, NAME, raw, md, plot)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
