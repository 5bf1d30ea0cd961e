"""Communication: all-gather and reduce-scatter time and bandwidth by message size, and the bytes one training
step really moves, counted, against the ZeRO-3 formulas.

    python benchmarks/bench_comm.py                          # W = 2, 4; 1 KiB .. 64 MiB; about 40 s on 2 cores
    python benchmarks/bench_comm.py --world-sizes 2 --max-size 4MiB
    python benchmarks/bench_comm.py --sim-bandwidth 1        # through the simulated 1 GB/s link instead
    torchrun --nproc-per-node=8 benchmarks/bench_comm.py     # NCCL on a GPU box

Part 1, collectives. For each size (the full, unsharded tensor: the all-gather output, the reduce-scatter input)
the ranks run ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` back to back after a warm-up, in 5
repeats; a repeat's time is the slowest rank's mean over its batch of calls, and the table gives the median with
the spread (min-max, n). Bandwidths (from the median) follow nccl-tests:

    algbw = size / time
    busbw = algbw * (W-1)/W     (each rank sends and receives (W-1)/W of the tensor in a ring; busbw is the
                                 number to compare with the link's bandwidth, whatever W is)

The alpha-beta fit (the handout's Models box: one ring all-gather or reduce-scatter of a full tensor of N elements of
b bytes each, over W ranks; the Models box's symbols: N counts elements, b is bytes per element):

    T(N, W) = (W - 1) * alpha + (W - 1) / W * N * b / beta

fitted per W and collective by least squares over the measured sizes (the median times; the "size" column is N * b,
in bytes), weighted by relative error: T = c0 + c1 * (N b), alpha = c0 / (W-1), beta = (W-1) / (W c1). The third
table gives alpha and beta with two standard errors, whether alpha is resolved (c0 > 2 SE(c0)), and the fit's
largest relative error; the plot draws the fitted bus bandwidth beside the measured one.

Part 2, bytes per step. One AdamW step of the benchmark GPT under each strategy, with every collective counted
by benchmarks.comm_meter.CommMeter (bus bytes, as above: payload * (W-1)/W for all-gather and reduce-scatter,
2 * payload * (W-1)/W for all-reduce). Ψ = parameters (elements), x 4 bytes (fp32). The formulas (ZeRO paper, ZeRO-3 =
FSDP full sharding):

    FSDP, reshard after forward:   3Ψ(W-1)/W   all-gather in forward, again in backward, reduce-scatter grads
    FSDP, no reshard:              2Ψ(W-1)/W   all-gather once, reduce-scatter grads
    DDP:                           2Ψ(W-1)/W   all-reduce grads (= reduce-scatter + all-gather)

DDP's reducer all-reduces its buckets in C++, out of the meter's sight; here (and only here: the step benchmark
times stock DDP) it gets a communication hook that sends each bucket through ``dist.all_reduce``, asynchronously
as its default hook does, so the bytes can be counted. Counted bytes include each unit's padding to a multiple of W, so they can exceed the formula by a hair.

Output: <out>/comm.json, comm.md (two tables), comm.png.

Table headers (comm.md; the writeup copies them):

| collective | W | interconnect | size | time us | algbw GB/s | busbw GB/s |
| strategy | W | all-gather MiB | reduce-scatter MiB | all-reduce MiB | total MiB | formula | formula MiB | counted / formula | note |

HSDP 2x2 (the bonus; W = 4 only): a 2-D mesh (R, K) = (2, 2) (R replicas, each sharded over K ranks), dim 0 replicates and dim 1 shards. Per rank and step
all-gathers 2 (K-1)/K Ψ and a reduce-scatter (K-1)/K Ψ inside the shard group, and an all-reduce 2 (R-1)/R Ψ/K of
the gradient shard across the replicate group: 3Ψ(K-1)/K + 2Ψ(R-1)/(RK) = 2Ψ at 2x2 (times 4 bytes), against FSDP's 2.25Ψ at W = 4,
and only the last term crosses between replicas (nodes). Its note gives the bytes per process group.

The note says when a run does not match its formula but matches a known variant: an implementation that keeps the
root unit (embeddings, tied head) unsharded after forward, as FSDP2 does when reshard_after_forward is left to its
default, all-gathers the root once, not twice: (3Ψ - Ψ_root)(W-1)/W.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import cli, report, sweep, trainers  # noqa: E402  (none of these imports torch)
from benchmarks.cli import QUICK_MODEL  # noqa: E402

# imported on first use (inside the ranks, or after the flags were checked): see benchmarks/__init__.py
torch = lazy_import("torch")
dist = lazy_import("torch.distributed")
comm_meter, launch, measure = (lazy_import(f"benchmarks.{m}") for m in ("comm_meter", "launch", "measure"))

NAME = "comm"
# --quick: tiny sizes that check the plumbing (written to <out>/quick/, tables labelled "quick")
QUICK = ["--world-sizes", "2", "--max-size", "16KiB", "--budget", "0.01", "--strategies", "FSDP", "DDP (torch)"] + QUICK_MODEL
HEADERS_COLL = ["collective", "W", "interconnect", "size", "time us", "algbw GB/s", "busbw GB/s"]
HEADERS_FIT = ["collective", "W", "interconnect", "alpha us (± 2 SE)", "alpha resolved", "beta GB/s (± 2 SE)", "sizes",
               "max rel. error of the fit"]
HEADERS_STEP = ["strategy", "W", "all-gather MiB", "reduce-scatter MiB", "all-reduce MiB", "total MiB", "formula",
                "formula MiB", "counted / formula", "note"]
STEP_STRATEGIES = ["FSDP", "FSDP no-reshard", "FSDP2 (torch)", "FSDP2 (torch) no-reshard", "DDP (torch)", "HSDP 2x2"]
FORMULA = {"FSDP": 3, "FSDP no-reshard": 2, "FSDP + prefetch": 3, "FSDP2 (torch)": 3,
           "FSDP2 (torch) no-reshard": 2, "DDP (torch)": 2, "HSDP 2x2": None}
HSDP_MESH = {"HSDP 2x2": (2, 2)}  # (R, K); measured only where W = R x K


def hsdp_formula(R: int, K: int) -> float:
    """Bus bytes per rank per step of HSDP on mesh (R, K): R replicas of K-way shard groups, in units of 4Ψ bytes (the
    handout's formulas)."""
    return 3 * (K - 1) / K + 2 * (R - 1) / (R * K)


def fit_alpha_beta(sizes: list[float], seconds: list[float], w: int) -> dict:
    """Least squares of T = c0 + c1 x (x = N b, the size in bytes) weighted by relative error (each point's residual
    divided by its T, so the small sizes, where the latency term lives, count as much as the large ones); alpha =
    c0 / (W-1), beta = (W-1) / (W c1) (bytes/s). With it the standard errors of c0 and c1 (from the weighted
    residuals), and whether alpha is *resolved*: c0 > 2 SE(c0). An unresolved alpha (or one <= 0) is below this
    machine's noise: the handout's rule is then to use alpha_bound = max(c0, 0) / (W-1) + 2 SE(c0) / (W-1) as an
    upper bound, never the fit. (c0, c1 are not the Models box's b, bytes per element: the JSON keeps their old
    names a_s and b_s_per_byte.)"""
    n = len(sizes)
    wts = [1 / y ** 2 for y in seconds]
    sw = sum(wts)
    mx = sum(wi * x for wi, x in zip(wts, sizes)) / sw
    my = sum(wi * y for wi, y in zip(wts, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(wts, sizes))
    c1 = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(wts, sizes, seconds)) / sxx if sxx else float("nan")
    c0 = my - c1 * mx
    resid = sum(wi * (c0 + c1 * x - y) ** 2 for wi, x, y in zip(wts, sizes, seconds))
    s2 = resid / (n - 2) if n > 2 else float("nan")  # relative variance of one point
    se_c1 = (s2 / sxx) ** 0.5 if sxx else float("nan")
    se_c0 = (s2 * (1 / sw + mx ** 2 / sxx)) ** 0.5 if sxx else float("nan")
    alpha = c0 / (w - 1)
    beta = (w - 1) / (w * c1) if c1 > 0 else float("inf")
    resolved = bool(c0 > 2 * se_c0)  # NaN compares False: two sizes cannot resolve it
    worst = max(abs(c0 + c1 * x - y) / y for x, y in zip(sizes, seconds))
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "a_s": c0, "b_s_per_byte": c1, "max_rel_error": worst,
            "sizes": n, "weighting": "relative error (1/T^2)", "alpha_se_s": se_c0 / (w - 1),
            "beta_rel_se": se_c1 / c1 if c1 > 0 else float("nan"), "alpha_resolved": resolved,
            "alpha_bound_s": (max(c0, 0.0) + 2 * se_c0) / (w - 1)}


def human(n: int) -> str:
    return f"{n // 1024 ** 2} MiB" if n >= 1024 ** 2 else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def time_collective(kind: str, size: int, ctx: launch.RankContext, budget_s: float, repeats: int = 5) -> list[float]:
    """Seconds per collective, ``repeats`` times (each the mean over a batch of calls, the slowest rank's), so
    the table can give the median and the spread. ``size`` bytes of fp32, a multiple of 4*W."""
    w = ctx.world_size
    numel = size // 4
    full = torch.ones(numel, device=ctx.device)
    shard = torch.ones(numel // w, device=ctx.device)

    def once():
        if kind == "all_gather":
            dist.all_gather_single(full, shard)
        else:
            dist.reduce_scatter_single(shard, full)

    once()  # warm-up: first-call set-up (buffers, connections) is not what we measure
    measure.sync(ctx.device)
    t0 = time.perf_counter()
    once()
    measure.sync(ctx.device)
    # every rank must run the same number of iterations: agree on the slowest rank's estimate
    est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(est, op=dist.ReduceOp.MAX)
    iters = int(max(1, min(40, budget_s / repeats / max(est.item(), 1e-6))))
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        measure.sync(ctx.device)
        mean = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        times.append(mean.item())
    return times


def worker(ctx: launch.RankContext, payload: dict) -> dict:
    link = comm_meter.SimLink(payload["sim_bandwidth"], payload["sim_latency_us"]) if payload["sim_bandwidth"] else None
    out = {"collectives": [], "steps": {}}
    with comm_meter.CommMeter(link=link):  # counts nothing we read here; it applies the simulated link when there is one
        for kind in ("all_gather", "reduce_scatter"):
            for size in payload["sizes"]:
                size -= size % (4 * ctx.world_size)
                ts = time_collective(kind, size, ctx, payload["budget_s"])
                out["collectives"].append({"kind": kind, "size": size, "seconds": report.median(ts),
                                           "seconds_repeats": ts})
            ctx.log(f"{kind}: {len(payload['sizes'])} sizes done")
    cfg = trainers.model_config(payload)
    for name in payload["strategies"]:
        if name in HSDP_MESH and HSDP_MESH[name][0] * HSDP_MESH[name][1] != ctx.world_size:
            continue  # a 2-D mesh of another size: that row belongs to another W
        with comm_meter.CommMeter() as meter:
            try:
                trainer = trainers.build_trainer(name, cfg, payload["batch"], ctx.device, meter, count_ddp=True)
                trainer.step(ctx.rank)  # warm-up (lazy initialization may communicate)
            except NotImplementedError as exc:
                out["steps"][name] = trainers.skipped(name, exc, ctx)
                continue
            meter.reset()
            trainer.step(ctx.rank)
            out["steps"][name] = {**meter.summary(), "by_group": meter.summary_by_group()}
        del trainer
        gc.collect()
        ctx.log(f"{name}: step bytes counted")
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [2, 4])
    cli.add_model_args(p, params=4e6, layers=8, block_size=32, batch=1)
    cli.add_sim_args(p)
    p.add_argument("--min-size", type=cli.size_bytes, default="1KiB", help="smallest message (B, KiB, MiB, GiB)")
    p.add_argument("--max-size", type=cli.size_bytes, default="64MiB", help="largest message (B, KiB, MiB, GiB)")
    p.add_argument("--budget", type=cli.positive_float, default=0.15, help="seconds of timed collectives per size (at least 3)")
    p.add_argument("--strategies", nargs="*", default=STEP_STRATEGIES, choices=list(FORMULA),
                   help="strategies whose bytes per step are counted (none: skip part 2)")
    return p


def main(argv=None) -> dict:
    args = cli.parse(parser(), argv, NAME, QUICK)
    if args.min_size > args.max_size:
        parser().error(f"--min-size {args.min_size} B is larger than --max-size {args.max_size} B")
    sizes, s = [], args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= 4
    sim_bw = float(args.sim_bandwidth)
    interconnect = (f"simulated {sim_bw:g} GB/s, {args.sim_latency_us:g} us" if sim_bw
                    else ("nccl" if args.device == "cuda" else "gloo (real)"))
    if sim_bw:
        report.log(comm_meter.SimLink(sim_bw, args.sim_latency_us).describe(), quiet=False)
    cfg = trainers.model_config(args)
    psi = trainers.param_count(cfg)
    units = trainers.unit_param_counts(cfg)
    payload = {**trainers.model_payload(args), "sizes": sizes, "budget_s": args.budget, "strategies": args.strategies,
               "sim_bandwidth": sim_bw, "sim_latency_us": args.sim_latency_us}
    report.log(f"comm: sizes {human(sizes[0])}..{human(sizes[-1])}, W in {args.world_sizes}; bytes per step of GPT "
          f"{psi / 1e6:.2f}M params", quiet=args.quiet)

    results: dict[int, dict] = {}
    done = sweep.run(args, NAME, "benchmarks.bench_comm:worker", [(f"W{w}", w, payload) for w in args.world_sizes])
    for w in args.world_sizes:
        if f"W{w}" in done:  # times are already the slowest rank's; byte counts are the same on every rank
            results[w] = done[f"W{w}"][0]
    if not report.is_writer():
        return {}

    coll_rows, coll_records, step_rows, step_records, skipped = [], [], [], [], []
    for w, res in results.items():
        for r in res["collectives"]:
            alg = r["size"] / r["seconds"] / 1e9
            bus = alg * (w - 1) / w
            coll_rows.append([r["kind"].replace("_", "-"), w, interconnect, human(r["size"]),
                              report.spread(r.get("seconds_repeats", [r["seconds"]]), 1e6), alg, bus])
            coll_records.append({**r, "world_size": w, "algbw_gbps": alg, "busbw_gbps": bus, "interconnect": interconnect})
        for name, summary in res["steps"].items():
            if "skipped" in summary:
                skipped.append(f"- {name} (W={w}): not measured ({summary['skipped']})")
                continue
            mib = {k: summary.get(k, {}).get("bus_bytes", 0.0) / report.MiB for k in ("all_gather", "reduce_scatter", "all_reduce")}
            total = sum(mib.values())
            k = FORMULA[name]
            if name in HSDP_MESH:
                R, K = HSDP_MESH[name]
                formula, formula_text = hsdp_formula(R, K) * psi * 4 / report.MiB, "(3(K-1)/K+2(R-1)/(RK))Ψ·4B"
                groups = summary.get("by_group", {})
                note = "; ".join(f"group {g}: " + " + ".join(f"{kind.replace('_', '-')} {v['bus_bytes'] / report.MiB:.2f}"
                                                             for kind, v in kinds.items()) + " MiB"
                                 for g, kinds in sorted(groups.items()))
                note = f"rank 0's groups: {note} (shard group: K={K} ranks; replicate group: R={R})"
            else:
                formula, formula_text = k * psi * 4 * (w - 1) / w / report.MiB, f"{k}Ψ(W-1)/W·4B"
                note = "counted through a comm hook (dist.all_reduce per bucket)" if name == "DDP (torch)" else ""
                root_kept = (k * psi - units["root"]) * 4 * (w - 1) / w / report.MiB
                if k == 3 and abs(total / formula - 1) > 0.01 and abs(total / root_kept - 1) <= 0.01:
                    note = f"root kept unsharded after forward: counted / (3Ψ-Ψ_root)(W-1)/W = {total / root_kept:.4f}"
            step_rows.append([name, w, mib["all_gather"], mib["reduce_scatter"], mib["all_reduce"], total,
                              formula_text, formula, f"{total / formula:.4f}", note])
            step_records.append({"strategy": name, "world_size": w, "counted": summary, "total_bus_bytes": total * report.MiB,
                                 "formula": formula_text, "formula_bytes": formula * report.MiB,
                                 "ratio": total / formula, "psi_params": psi, "note": note})

    fits, fit_rows = [], []
    for w in results:
        for kind in ("all_gather", "reduce_scatter"):
            pts = [r for r in coll_records if r["world_size"] == w and r["kind"] == kind]
            if len(pts) < 2 or w < 2:
                continue
            f = fit_alpha_beta([r["size"] for r in pts], [r["seconds"] for r in pts], w)
            fits.append({"kind": kind, "world_size": w, "interconnect": interconnect, **f})
            beta_gb = f["beta_bytes_per_s"] / 1e9
            fit_rows.append([kind.replace("_", "-"), w, interconnect,
                             f"{f['alpha_s'] * 1e6:.0f} ± {2 * f['alpha_se_s'] * 1e6:.0f}",
                             "yes" if f["alpha_resolved"] else f"no: alpha < {f['alpha_bound_s'] * 1e6:.0f} us",
                             f"{beta_gb:.3g} ± {2 * f['beta_rel_se'] * beta_gb:.2g}" if 0 < beta_gb < float("inf")
                             else "n/a (fitted slope <= 0: the sizes are too small or too noisy)", f["sizes"],
                             f"{f['max_rel_error']:.1%}"])

    md = (f"Collectives: {interconnect}; time us = median (min-max, n) of repeats, each the slowest rank's mean "
          f"over a batch of calls; algbw and busbw from the median; busbw = size/time x (W-1)/W.\n\n"
          + report.markdown_table(HEADERS_COLL, coll_rows)
          + f"\nBytes per training step (bus bytes per rank, counted), GPT Ψ = {psi:,} params x 4 B = "
          f"{psi * 4 / report.MiB:.2f} MiB:\n\n" + report.markdown_table(HEADERS_STEP, step_rows)
          + ("\n" + "\n".join(skipped) + "\n" if skipped else "")
          + "\nalpha-beta fit of the collectives (the Models box's T(N, W) = (W-1)·alpha + (W-1)/W·N·b/beta, N = the "
          "full tensor's elements, b = bytes per element, so N·b = the size column; least squares over the sizes above weighted by relative error, per W; ± two standard "
          "errors; alpha is resolved when it exceeds two standard errors, otherwise only its upper bound is "
          "measured):\n\n" + report.markdown_table(HEADERS_FIT, fit_rows))
    raw = {"benchmark": NAME, "alpha_beta": fits, "config": vars(args) | {"gpt": cfg.__dict__}, "environment": report.environment(),
           "interconnect": interconnect, "collectives": coll_records, "bytes_per_step": step_records, "skipped": skipped}

    def plot():
        import matplotlib.pyplot as plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.15, 1]})
        for w in results:
            for kind, style in (("all_gather", "-o"), ("reduce_scatter", "--s")):
                pts = [r for r in coll_records if r["world_size"] == w and r["kind"] == kind]
                xs = [r["size"] for r in pts]
                ys = [r["busbw_gbps"] for r in pts]
                # error bars: the bus bandwidth at the slowest and the fastest repeat
                lo = [y - r["size"] / max(r["seconds_repeats"]) / 1e9 * (w - 1) / w for y, r in zip(ys, pts)]
                hi = [r["size"] / min(r["seconds_repeats"]) / 1e9 * (w - 1) / w - y for y, r in zip(ys, pts)]
                line = ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, ms=4, capsize=2,
                                   label=f"{kind.replace('_', '-')} W={w} (min-max over repeats)")
                f = next((f for f in fits if f["world_size"] == w and f["kind"] == kind), None)
                if f is not None and f["b_s_per_byte"] > 0:
                    model = [x / (f["a_s"] + f["b_s_per_byte"] * x) / 1e9 * (w - 1) / w for x in xs]
                    if all(m > 0 for m in model):
                        ax.plot(xs, model, ":", color=line[0].get_color(), lw=1,
                                label=f"alpha-beta fit W={w}: {f['alpha_s'] * 1e6:.0f} us, "
                                      f"{f['beta_bytes_per_s'] / 1e9:.2g} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["size"] for r in coll_records})
        ax.set_xticks(ticks, [human(t).replace(" ", "") for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("message size (bytes, full tensor)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"Collectives, {interconnect}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        labels = [f"{r['strategy']}\nW={r['world_size']}" for r in step_records]
        x = range(len(step_records))
        bottom = [0.0] * len(step_records)
        for key, color in (("all_gather", "#4C72B0"), ("reduce_scatter", "#DD8452"), ("all_reduce", "#55A868")):
            vals = [r["counted"].get(key, {}).get("bus_bytes", 0.0) / report.MiB for r in step_records]
            bx.bar(x, vals, bottom=bottom, color=color, label=key.replace("_", "-"))
            bottom = [b + v for b, v in zip(bottom, vals)]
        bx.scatter(x, [r["formula_bytes"] / report.MiB for r in step_records], marker="_", s=500, color="black",
                   zorder=3, label="formula kΨ(W-1)/W")
        top = max([r["formula_bytes"] for r in step_records] + [r["total_bus_bytes"] for r in step_records] + [1.0])
        bx.set_ylim(0, 1.12 * top / report.MiB)
        bx.set_xticks(list(x), labels, rotation=40, ha="right", fontsize=7)
        bx.set_ylabel("bus MiB per rank per step")
        bx.set_title("Bytes per training step: counted vs formula", fontsize=10)
        bx.legend(fontsize=8)
        bx.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        return fig

    sweep.finish(args, NAME, raw, md, plot)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
