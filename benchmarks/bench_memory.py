"""Memory: per-rank peak of one training step and what it is made of, measured next to an analytic model.

    python benchmarks/bench_memory.py                      # W = 1, 2, 4 on CPU (gloo), about a minute
    python benchmarks/bench_memory.py --world-sizes 2 --params 2e6
    torchrun --nproc-per-node=4 benchmarks/bench_memory.py # on a GPU box (CUDA allocator statistics)

For each W and strategy (one process, torch's DDP, the implementation's FSDP with reshard after forward on and off
and with prefetching, torch's FSDP2) every rank builds the benchmark GPT, takes one AdamW step (so the optimizer
state exists, as in every later step), then measures the peak of each of the next --repeat steps (3) and reports
the median one (gloo's threads free finished collectives' tensors on their own schedule, so a step's peak can
differ by a few percent from run to run):

  * on CPU with fsdp_assignment/support/memory.py's LiveStorageTracker (live tensor storages, FSDP's storage
    resizes included), which also gives the breakdown below;
  * on GPU with torch.cuda.max_memory_allocated (the breakdown still comes from the tracker).

The breakdown is of the storages alive at the peak, by what they are once the step is over: params (this rank's
parameters: shards under FSDP), grads (.grad), optim (AdamW's two moments), unsharded (FSDP's temporary full
parameters and gradients: storages it resizes, all-gather outputs, reduce-scatter inputs; DDP's flat bucket
copies), activations (everything else that forward and backward allocate: saved activations and temporaries).
A rank's number is the worst rank's.

The analytic model (per rank, fp32 parameters, AdamW), printed beside each measurement:

    S          = this rank's parameter count: Ψ without sharding, sum over units of ceil(n_unit / W) with it
    states     = 4·S params + 4·S grads + 8·S AdamW  (= 16Ψ/W bytes under full sharding)
    A          = activations of the forward, measured once in the one-process run (the batch per rank is the same)
    peak model = max(start of backward, end of backward), in bytes:
      start of backward = 12·S + A + 4·U_p + 4·U_g    (sharded gradients do not exist yet: zero_grad frees them)
      end of backward   = 16·S + 4·U_end
    U_p        = unsharded parameters: under FSDP the root unit (embeddings, tied head) and the block unit being
                 computed, plus one more block unit with prefetching (when there is one); all Ψ without reshard
                 after forward; 0 without sharding
    U_g        = unsharded gradients in flight: a block's gradient twice (autograd's per-parameter gradients and
                 the flat buffer the reduce-scatter reads) and the tied head's gradient (vocab x n_embd); with
                 prefetching once more: the reduce-scatter is asynchronous, and the previous block unit's flat
                 gradient stays referenced until its reduce-scatter is finished, during this unit's backward
    U_end      = at the end of backward: the tied weight's dense embedding gradient and the sum accumulating it
                 (2·vocab·n_embd), plus under FSDP the root unit's full parameters and full gradient (every unit
                 is resharded after its own backward, with or without reshard after forward: the same U_end)
    A "block unit" is one block, or two with the "2 blocks/unit" strategy (the unit-size experiment).
    Each term's element count is in memory.json (results[i].model: S, U_p, U_g, U_end, n_root, n_block_unit).
    DDP        = 16·S + A + 4·vocab·n_embd: its gradient buckets (which .grad are views of) live all the time

Output: <out>/memory.json (every rank's numbers and the model's terms), memory.md, memory.png.

Table header (memory.md; the writeup copies it):

| strategy | W | peak MiB | model MiB | model error | vs one process | params MiB | grads MiB | optim MiB | unsharded MiB | activations MiB |
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import cli, report, sweep, trainers  # noqa: E402  (none of these imports torch)
from benchmarks.cli import QUICK_MODEL  # noqa: E402

# imported on first use (inside the ranks, or after the flags were checked): see benchmarks/__init__.py
torch = lazy_import("torch")
dist = lazy_import("torch.distributed")
comm_meter, launch, measure = (lazy_import(f"benchmarks.{m}") for m in ("comm_meter", "launch", "measure"))

NAME = "memory"
# --quick: tiny sizes that check the plumbing (written to <out>/quick/, tables labelled "quick")
QUICK = ["--world-sizes", "2", "--repeat", "1", "--strategies", "one process", "FSDP", "FSDP2 (torch)"] + QUICK_MODEL
HEADERS = ["strategy", "W", "peak MiB", "model MiB", "model error", "vs one process", "params MiB", "grads MiB",
           "optim MiB", "unsharded MiB", "activations MiB"]
STRATEGIES = ["one process", "DDP (torch)", "FSDP", "FSDP no-reshard", "FSDP + prefetch",
              "FSDP + prefetch, 2 blocks/unit", "FSDP2 (torch)"]
CATEGORIES = ["params", "grads", "optim", "unsharded", "activations"]


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def worker(ctx: launch.RankContext, payload: dict) -> dict:
    from fsdp_assignment.support.memory import LiveStorageTracker

    cfg = trainers.model_config(payload)
    out = {}
    for name in payload["strategies"]:
        ctx.log(f"{name}: measuring one step")
        gc.collect()
        cuda = ctx.device.type == "cuda"
        with LiveStorageTracker(device=ctx.device.type, resize_label="unsharded") as mem, \
                comm_meter.CommMeter(on_buffer=lambda kind, t: mem.relabel(t, "unsharded")):
            try:
                with mem.label("params"):
                    # foreach=False: no optimizer temporary as large as the moments (the model counts none)
                    trainer = trainers.build_trainer(name, cfg, payload["batch"], ctx.device, foreach=False)
                trainer.step(ctx.rank, mem)  # warm-up: AdamW's state exists from here on
            except NotImplementedError as exc:
                out[name] = trainers.skipped(name, exc, ctx)
                continue
            mem.relabel(trainer.model, "params")  # the parameters (shards under FSDP) as the step starts
            mem.relabel(trainer.optimizer, "optim")
            steps = []
            for _ in range(payload["repeat"]):
                # The same step can peak a little higher or lower from run to run: gloo's threads release the
                # tensors of finished collectives on their own schedule. So: several steps, the median one.
                gc.collect()
                measure.sync(ctx.device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                mem.reset_peak()
                start = mem.current_bytes
                # What CUDA's allocator holds outside any tensor (cuBLAS's workspaces, made by the warm-up step and
                # kept): in max_memory_allocated, in no model term, and the same for every strategy.
                untracked = torch.cuda.memory_allocated(ctx.device) - start if cuda else 0
                after = {}
                trainer.step(ctx.rank, mem, probe=lambda phase: after.__setitem__(phase, mem.current_bytes))
                measure.sync(ctx.device)
                steps.append({
                    "peak_bytes": mem.peak_bytes,
                    "start_bytes": start,
                    "forward_growth_bytes": after["forward"] - start,  # activations (+ unsharded kept) after forward
                    "breakdown_at_peak": mem.peak_breakdown(),
                    "tracker": "LiveStorageTracker",
                })
                if cuda:
                    steps[-1]["peak_bytes_tracker"] = steps[-1]["peak_bytes"]
                    steps[-1]["peak_bytes_allocated"] = torch.cuda.max_memory_allocated(ctx.device)
                    steps[-1]["untracked_bytes"] = untracked
                    steps[-1]["peak_bytes"] = steps[-1]["peak_bytes_allocated"] - untracked
                    steps[-1]["tracker"] = ("torch.cuda.max_memory_allocated less what the allocator held outside "
                                            "tensors as the step began (cuBLAS's workspaces)")
            result = sorted(steps, key=lambda r: r["peak_bytes"])[len(steps) // 2]  # the median step
            result["peak_bytes_all_steps"] = [r["peak_bytes"] for r in steps]
        del trainer
        gc.collect()
        out[name] = result
    return out


# ---------------------------------------------------------------------------------------------------------
# The analytic model
# ---------------------------------------------------------------------------------------------------------
def _categories(bd: dict) -> dict:
    """A rank's breakdown at its peak in the table's categories; "other" (a few bytes) counts as activations."""
    cats = {c: bd.get(c, 0) for c in CATEGORIES}
    cats["activations"] += sum(v for k, v in bd.items() if k not in CATEGORIES)
    return cats


def analytic(name: str, w: int, cfg, activations: float) -> dict:
    """Bytes per rank predicted for ``name`` at world size ``w`` (see the module docstring)."""
    family, opt = trainers.STRATEGIES[name]
    units = trainers.unit_param_counts(cfg, opt.get("blocks_per_unit", 1))
    n_root, n_block, n_blocks = units["root"], units["block"], units["n_blocks"]
    psi = n_root + n_block * n_blocks
    sharded = family in ("fsdp", "fsdp2")
    s = (math.ceil(n_root / w) + n_blocks * math.ceil(n_block / w)) if sharded else psi
    tied = cfg.vocab_size * cfg.n_embd  # the tied embedding/head weight
    if not sharded:
        u_p, u_g, u_end = 0, tied, 2 * tied
    else:
        # U_p: the root and the block unit computing (+1 prefetched); without reshard after forward every unit
        # is still unsharded from its forward. U_end: every unit is resharded after its own backward (reshard
        # after forward or not), so at the end only the root's full parameters and gradient are left.
        u_p = n_root + n_block * min(2 if opt.get("prefetch") else 1, n_blocks) if opt.get("reshard", True) else psi
        # U_g: with prefetching the previous unit's reduce-scatter is still in flight (Task 6: at most one), and
        # its input, that unit's flat gradient, lives beside this unit's two copies.
        u_g = (3 if opt.get("prefetch") else 2) * n_block + tied
        u_end = 2 * n_root + 2 * tied
    start = 12 * s + activations + 4 * (u_p + u_g)
    end = 16 * s + 4 * u_end
    if family == "ddp":  # buckets hold the gradients from construction on
        start = end = 16 * s + activations + 4 * tied
    return {"S": s, "psi": psi, "n_root": n_root, "n_block_unit": n_block, "n_block_units": n_blocks,
            "U_p": u_p, "U_g": u_g, "U_end": u_end, "states_bytes": 16 * s, "activations_bytes": activations,
            "unsharded_params_bytes": 4 * u_p, "unsharded_grads_bytes": 4 * u_g, "end_extra_bytes": 4 * u_end,
            "at_backward_start": start, "at_backward_end": end, "peak_bytes": max(start, end)}


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [1, 2, 4])
    cli.add_model_args(p, params=4e6, layers=8, block_size=32, batch=1)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=list(trainers.STRATEGIES))
    p.add_argument("--repeat", type=cli.positive_int, default=3, help="measured steps per strategy; the median step is reported")
    return p


def main(argv=None) -> dict:
    args = cli.parse(parser(), argv, NAME, QUICK)
    cfg = trainers.model_config(args)
    payload = {**trainers.model_payload(args), "strategies": args.strategies, "repeat": args.repeat}
    report.log(f"memory: GPT {trainers.param_count(cfg) / 1e6:.2f}M params ({cfg}), batch {args.batch}x{args.block_size} "
          f"per rank, AdamW, W in {args.world_sizes}", quiet=args.quiet)

    # "one process" is one process: it runs at W=1 only; everything else at every W asked for
    runs: dict[int, list[str]] = {}
    if "one process" in args.strategies:
        runs[1] = ["one process"]
    for w in args.world_sizes:
        runs.setdefault(w, []).extend(n for n in args.strategies if n != "one process")
    measured: dict[tuple[int, str], list[dict]] = {}  # (W, strategy) -> every rank's result
    skipped: list[str] = []
    done = sweep.run(args, NAME, "benchmarks.bench_memory:worker",
                     [(f"W{w}", w, {**payload, "strategies": names}) for w, names in sorted(runs.items())])
    for w, names in sorted(runs.items()):
        ranks = done.get(f"W{w}")
        for name in names if ranks is not None else []:
            if "skipped" in ranks[0][name]:
                skipped.append(f"- {name} (W={w}): not measured ({ranks[0][name]['skipped']})")
            else:
                measured[(w, name)] = [r[name] for r in ranks]
    if not report.is_writer():
        return {}

    one = measured.get((1, "one process"), [None])[0]
    activations = one["forward_growth_bytes"] if one else 0.0  # without a one-process run the model has no A
    one_peak = one["peak_bytes"] if one else None

    rows, records = [], []
    for (w, name), per_rank in measured.items():
        worst = max(per_rank, key=lambda r: r["peak_bytes"])
        model = analytic(name, w, cfg, activations)
        err = worst["peak_bytes"] / model["peak_bytes"] - 1
        vs_one = worst["peak_bytes"] / one_peak if one_peak else None
        per_rank_cats = [_categories(r["breakdown_at_peak"]) for r in per_rank]
        cats = per_rank_cats[per_rank.index(worst)]
        rows.append([name, w, report.spread(worst["peak_bytes_all_steps"], 1 / report.MiB),
                     model["peak_bytes"] / report.MiB, f"{err:+.1%}",
                     None if vs_one is None else f"{vs_one:.3f}x"] + [cats[c] / report.MiB for c in CATEGORIES])
        records.append({"strategy": name, "world_size": w, "peak_bytes": worst["peak_bytes"],
                        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank], "model": model,
                        "model_error": err, "vs_one_process": vs_one, "breakdown_at_peak": cats,
                        # which rank is the worst moves with noise when the peaks are close (uneven shards differ by a
                        # few hundred bytes): compare runs rank by rank, never through the worst rank alone
                        "worst_rank": per_rank.index(worst), "breakdown_at_peak_per_rank": per_rank_cats,
                        "forward_growth_bytes": worst["forward_growth_bytes"], "tracker": worst["tracker"],
                        "peak_bytes_all_steps_per_rank": [r["peak_bytes_all_steps"] for r in per_rank]})

    md = (f"GPT {trainers.param_count(cfg) / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
          f"vocab={cfg.vocab_size}), batch {args.batch}x{args.block_size} tokens per rank, fp32, AdamW; "
          f"per-rank peak of one step (worst rank), {records[0]['tracker'] if records else ''}: median (min-max, "
          f"n = measured steps) of the worst rank's steps; the breakdown is of its median step.\n"
          f"Model: max(12·S + A + 4·(U_p + U_g), 16·S + 4·U_end) (see bench_memory.py), S = this rank's parameter count, "
          f"A = {activations / report.MiB:.2f} MiB (one-process forward).\n\n")
    md += report.markdown_table(HEADERS, rows) + ("\n" + "\n".join(skipped) + "\n" if skipped else "")
    raw = {"benchmark": NAME, "config": vars(args) | {"gpt": cfg.__dict__}, "environment": report.environment(),
           "activations_bytes_one_process": activations, "results": records, "skipped": skipped}

    def plot():
        import matplotlib.pyplot as plt

        ws = sorted({w for w, _ in measured})
        fig, axes = plt.subplots(1, len(ws), figsize=(4.2 * len(ws) + 1.5, 4.6), sharey=True, squeeze=False)
        colors = {"params": "#4C72B0", "grads": "#DD8452", "optim": "#55A868", "unsharded": "#C44E52",
                  "activations": "#8172B3"}
        for ax, w in zip(axes[0], ws):
            recs = [r for r in records if r["world_size"] == w]
            x = range(len(recs))
            bottom = [0.0] * len(recs)
            for c in CATEGORIES:
                vals = [r["breakdown_at_peak"][c] / report.MiB for r in recs]
                ax.bar(x, vals, bottom=bottom, color=colors[c], label=c if w == ws[0] else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
            worst = [r["peak_bytes_all_steps_per_rank"][r["peak_bytes_per_rank"].index(r["peak_bytes"])] for r in recs]
            ax.errorbar(x, [r["peak_bytes"] / report.MiB for r in recs], fmt="none", ecolor="black", capsize=3,
                        yerr=[[(r["peak_bytes"] - min(s)) / report.MiB for r, s in zip(recs, worst)],
                              [(max(s) - r["peak_bytes"]) / report.MiB for r, s in zip(recs, worst)]],
                        label="peak, min-max over measured steps" if w == ws[0] else None)
            ax.scatter(x, [r["model"]["peak_bytes"] / report.MiB for r in recs], marker="_", s=600, color="black",
                       zorder=3, label="analytic model" if w == ws[0] else None)
            ax.set_xticks(list(x), [r["strategy"] for r in recs], rotation=35, ha="right", fontsize=8)
            ax.set_title(f"W = {w}")
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].set_ylabel("per-rank peak memory (MiB)")
        fig.legend(loc="upper right", fontsize=8)
        fig.suptitle(f"Peak memory of one AdamW step, GPT {trainers.param_count(cfg) / 1e6:.1f}M params "
                     f"(bars: measured breakdown at the peak)", fontsize=10)
        fig.tight_layout(rect=(0, 0, 0.88, 0.95))
        return fig

    sweep.finish(args, NAME, raw, md, plot)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
