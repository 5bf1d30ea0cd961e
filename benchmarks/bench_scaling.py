"""Scaling: weak scaling, the model grows with W; per-rank memory and time per step.

    python benchmarks/bench_scaling.py                       # W = 1, 2, 4 on CPU, 1M params per rank
    python benchmarks/bench_scaling.py --params-per-rank 2e6 --world-sizes 1 2 4 8
    torchrun --nproc-per-node=8 benchmarks/bench_scaling.py  # one W per torchrun launch: the others are skipped

Weak scaling keeps the work per rank fixed while the job grows: at world size W the GPT has about
W x --params-per-rank parameters (more width, same depth; gpt_config_for_params), and every rank trains on the same
per-rank batch. Under full sharding the per-rank model state stays about constant (16Ψ/W with Ψ ∝ W), while
DDP's grows with W. Per-step time grows with the communication, which moves (W-1)/W of a model that is W times
larger.

For each W and strategy the ranks build the model, take a warm-up step, time ``--steps`` steps (median; each
step starts at a barrier) and measure the per-rank peak of one more step with LiveStorageTracker (worst rank).

    weak-scaling efficiency = step time at the smallest W / step time at W   (1.0 = perfect)

On a CPU, W ranks share the machine's cores; once W exceeds the cores, ranks time-share them and the step times
say more about the CPU than about scaling (the table notes when this happens). On GPUs (one per rank) they are
the real thing.

Output: <out>/scaling.json, scaling.md, scaling.png.

Table header (scaling.md; the writeup copies it):

| strategy | W | params M | step ms | weak-scaling efficiency | peak MiB per rank | peak vs smallest W |
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cli, launch, measure, report, sweep, trainers  # noqa: E402

NAME = "scaling"
# --quick: tiny sizes that check the plumbing (written to <out>/quick/, tables labelled "quick")
QUICK = ["--world-sizes", "1", "2", "--params-per-rank", "1e5", "--layers", "2", "--block-size", "16", "--batch", "1", "--steps", "1", "--strategies", "FSDP", "DDP (torch)"]
HEADERS = ["strategy", "W", "params M", "step ms", "weak-scaling efficiency", "peak MiB per rank",
           "peak vs smallest W"]
STRATEGIES = ["FSDP", "FSDP + prefetch", "FSDP2 (torch)", "DDP (torch)"]


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def worker(ctx: launch.RankContext, payload: dict) -> dict:
    cfg = trainers.model_config(payload)
    out = {}
    for name in payload["strategies"]:
        try:
            trainer = trainers.build_trainer(name, cfg, payload["batch"], ctx.device)
            trainer.step(ctx.rank)  # warm-up
        except NotImplementedError as exc:
            out[name] = trainers.skipped(name, exc, ctx)
            continue
        times = measure.timed_steps(trainer, ctx.rank, payload["steps"])
        peak = measure.peak_of_one_step(trainer, ctx.rank)
        out[name] = {"step_s": report.median(times), "times_s": times, "peak_bytes": peak}
        ctx.log(f"{name}: {report.median(times) * 1e3:.0f} ms/step, peak {peak / report.MiB:.1f} MiB")
        del trainer
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [1, 2, 4])
    cli.add_model_args(p, params=0, layers=8, block_size=32, batch=4)
    p.add_argument("--params-per-rank", type=float, default=1e6, help="the model has about W x this many params")
    p.add_argument("--steps", type=int, default=3, help="timed steps per strategy (median)")
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=[s for s in trainers.STRATEGIES if s != "one process"])
    args = cli.parse(p, argv, NAME, QUICK)
    report.log(f"scaling: weak, {args.params_per_rank / 1e6:g}M params per rank, W in {args.world_sizes}, "
          f"batch {args.batch}x{args.block_size} per rank", quiet=args.quiet)

    results: dict[int, dict] = {}
    configs = {}
    launches = []
    for w in args.world_sizes:
        payload = {**trainers.model_payload(args), "params": args.params_per_rank * w, "strategies": args.strategies,
                   "steps": args.steps}
        configs[w] = trainers.model_config(payload)
        launches.append((f"W{w}", w, payload))
    done = sweep.run(args, NAME, "benchmarks.bench_scaling:worker", launches)
    for w in args.world_sizes:
        if f"W{w}" in done:
            results[w] = {"ranks": done[f"W{w}"], "psi": trainers.param_count(configs[w])}
    if not report.is_writer():
        return {}

    cores = os.cpu_count() or 1
    rows, records = [], []
    base_w = min(results) if results else None
    skipped = sorted({f"- {name}: not measured ({res['ranks'][0][name]['skipped']})" for res in results.values()
                      for name in args.strategies if "skipped" in res["ranks"][0][name]})
    for name in args.strategies:
        if any("skipped" in res["ranks"][0][name] for res in results.values()):
            continue
        for w, res in results.items():
            step = max(r[name]["step_s"] for r in res["ranks"])  # all ranks pass the same barriers: ~equal
            peak = max(r[name]["peak_bytes"] for r in res["ranks"])
            base = results[base_w]["ranks"]
            base_step = max(r[name]["step_s"] for r in base)
            base_peak = max(r[name]["peak_bytes"] for r in base)
            eff = base_step / step
            rows.append([name, w, res["psi"] / 1e6, step * 1e3, f"{eff:.2f}", peak / report.MiB, f"{peak / base_peak:.2f}x"])
            records.append({"strategy": name, "world_size": w, "psi_params": res["psi"], "gpt": configs[w].__dict__,
                            "step_s": step, "efficiency": eff, "peak_bytes": peak, "peak_vs_base": peak / base_peak,
                            "per_rank": [r[name] for r in res["ranks"]]})

    md = (f"Weak scaling: about {args.params_per_rank / 1e6:g}M params per rank (n_layer={args.layers}, width grows "
          f"with W), batch {args.batch}x{args.block_size} tokens per rank, fp32, AdamW; step = median of "
          f"{args.steps} steps; peak = worst rank, LiveStorageTracker.\n")
    if args.device != "cuda" and results and max(results) > cores:
        md += (f"Note: this machine has {cores} CPU cores; at W > {cores} the ranks time-share cores, so step "
               f"times there measure the CPU, not scaling.\n")
    md += "\n" + report.markdown_table(HEADERS, rows) + ("\n" + "\n".join(skipped) + "\n" if skipped else "")
    raw = {"benchmark": NAME, "config": vars(args), "environment": report.environment(), "results": records,
           "skipped": skipped}

    def plot():
        import matplotlib.pyplot as plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
        for name in dict.fromkeys(r["strategy"] for r in records):
            recs = [r for r in records if r["strategy"] == name]
            ws = [r["world_size"] for r in recs]
            ax.plot(ws, [r["step_s"] * 1e3 for r in recs], "-o", label=name)
            bx.plot(ws, [r["peak_bytes"] / report.MiB for r in recs], "-o", label=name)
        for a, title, ylabel in ((ax, "Time per step", "ms"), (bx, "Per-rank peak memory", "MiB")):
            a.set_xlabel("W (model ≈ W x %gM params)" % (args.params_per_rank / 1e6))
            a.set_xticks(sorted(results))
            a.set_ylabel(ylabel)
            a.set_title(title, fontsize=10)
            a.set_ylim(bottom=0)
            a.grid(alpha=0.3)
        if args.device != "cuda" and results and max(results) > cores:
            ax.axvspan(cores + 0.5, max(results) + 0.5, color="grey", alpha=0.15, label=f"W > {cores} cores")
        ax.legend(fontsize=8)
        fig.suptitle("Weak scaling", fontsize=11)
        fig.tight_layout()
        return fig

    report.write_outputs(args.out, NAME, raw, md + sweep.failures_note(args), plot, quiet=args.quiet,
                         quick=args.quick)
    sweep.raise_failures(args)
    return raw


if __name__ == "__main__":
    main()
