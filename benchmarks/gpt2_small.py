"""GPT-2 small under FSDP: built on meta, sharded and materialized unit by unit, trained a few AdamW steps, with
and without activation checkpointing; per-rank peak memory next to the 16Ψ/W + units + activations model.

    python benchmarks/gpt2_small.py                           # W=2, CPU, GPT-2 small (124M params): a few minutes
    python benchmarks/gpt2_small.py --layers 4 --n-embd 256 --vocab 8192      # a smaller model, same shape
    python benchmarks/gpt2_small.py --device cuda             # on GPUs: the peak is torch.cuda.max_memory_allocated
    python benchmarks/gpt2_small.py --quick                   # tiny sizes: a smoke run

Every rank builds GPT-2 small's shape (fsdp_assignment/support/models.py's GPT: 12 blocks, n_embd 768, 12 heads,
vocab 50257, 1024 positions, tied head: Ψ = 124.4M) on the ``meta`` device, wraps each block and then the root with
``adapters.fully_shard`` (the implementation ``FSDP_IMPL`` selects), and materializes
it with ``adapters.materialize_meta_module``: unit by unit, so no rank ever holds the full model (the "init peak"
column). It then takes one warm-up AdamW step (the optimizer state exists from then on) and --steps measured steps
on a batch of --batch x --seq tokens per rank; a step's peak is the median of those steps' peaks (worst rank), its
time the median step time. With activation checkpointing each block runs under
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``: only its input is kept, and its activations are
recomputed (and its parameters re-gathered) in backward.

The model (bytes per rank, fp32, AdamW; benchmarks/bench_memory.py explains every term):

    states  16Ψ/W         4·S params + 4·S grads + 8·S AdamW moments, S = this rank's shard elements
    units   4·(U_p + U_g) unsharded parameters (root unit + the block being computed + the prefetched one) and
                          unsharded gradients in flight; at the end of backward 4·U_end instead
    activations  A        without checkpointing: L·a_block + a_root; with it: L·(batch·seq·n_embd·4) + a_block + a_root,
                          where a_block and a_root are what the forward of ONE block, and of the root alone
                          (embeddings, ln_f, head, loss), keeps for backward, each measured by itself before the FSDP
                          run: the model is built from units, not from the run it predicts
    peak model = max(12·S + A + 4·(U_p + U_g),  16·S + 4·U_end)

The table says how long everything took (wall time of the launch, build and materialization included). On CPU the
peak comes from fsdp_assignment/support/memory.py's LiveStorageTracker; on GPU from torch.cuda.max_memory_allocated.

Output: <out>/gpt2.json, gpt2.md, gpt2.png.

| W | activation checkpointing | peak MiB | model MiB | model error | model peak at | states MiB | units MiB | activations MiB | after forward MiB | init peak MiB | step s |

The three model columns add up to "model MiB": they are the terms of the branch of the max that binds ("model peak
at"): at the start of backward, states = 12·S, units = 4·(U_p + U_g), activations = A; at the end of backward,
states = 16·S, units = 4·U_end, activations = 0.

"after forward" is what a rank holds when forward ends (12·S + activations + what stays unsharded): where activation
checkpointing shows. With a small batch per rank the peak itself comes at the end of backward (all gradient shards
plus the root's full parameters and gradients), where checkpointing changes nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import bench_memory, cli, report, sweep  # noqa: E402  (none of these imports torch)

# imported on first use (inside the ranks, or after the flags were checked): see benchmarks/__init__.py
torch = lazy_import("torch")
launch, measure = lazy_import("benchmarks.launch"), lazy_import("benchmarks.measure")

NAME = "gpt2"
HEADERS = ["W", "activation checkpointing", "peak MiB", "model MiB", "model error", "model peak at", "states MiB",
           "units MiB", "activations MiB", "after forward MiB", "init peak MiB", "step s"]
QUICK = ["--layers", "2", "--n-embd", "64", "--n-head", "4", "--vocab", "512", "--positions", "64", "--seq", "16",
         "--steps", "1"]


def gpt2_config(p: dict):
    from fsdp_assignment.support.models import GPTConfig

    return GPTConfig(vocab_size=p["vocab"], block_size=p["positions"], n_layer=p["layers"], n_head=p["n_head"],
                     n_embd=p["n_embd"])


# ---------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------
def _checkpointed_forward(self, idx):
    """GPT.forward with every block (an FSDP unit) under non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    pos = torch.arange(idx.shape[1], device=idx.device)
    x = self.wte(idx) + self.wpe(pos)
    for block in self.blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return self.lm_head(self.ln_f(x))


class _Peak:
    """Peak bytes of a region: the CUDA allocator's on GPU, LiveStorageTracker's (already running) on CPU."""

    def __init__(self, mem, device):
        self.mem, self.device = mem, device

    def __enter__(self):
        gc.collect()
        measure.sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.mem.reset_peak()
        return self

    def __exit__(self, *exc):
        measure.sync(self.device)
        self.bytes = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                      else self.mem.peak_bytes)


def activation_probe(cfg, batch: int, seq: int, device) -> dict:
    """What the forward keeps alive for backward, measured on one unit at a time, eagerly, without FSDP:
    a_block for ONE block (its output included: the next block saves it as its input), a_root for the root alone
    (embeddings, ln_f, the tied head's logits and the loss's saved log-softmax). Gradients are not activations:
    the model's unit terms count them (bench_memory.analytic)."""
    from fsdp_assignment.support.memory import LiveStorageTracker
    from fsdp_assignment.support.models import GPT, Block, GPTConfig, gpt_batch, gpt_loss

    torch.manual_seed(0)
    block = Block(cfg).to(device)
    x = torch.randn(batch, seq, cfg.n_embd, device=device, requires_grad=True)
    with LiveStorageTracker(device=device.type) as mem:
        # the parameters are tracked first: ops return views of them (the transposed weight inside F.linear),
        # which would otherwise be counted as new memory
        base = mem.track(block, "params") + mem.track(x, "input")
        y = block(x)
        a_block = mem.current_bytes - base
    del block, x, y
    root = GPT(GPTConfig(**{**cfg.__dict__, "n_layer": 0})).to(device)
    idx, tgt = gpt_batch(cfg, batch, seed=0, device=device)
    with LiveStorageTracker(device=device.type) as mem:
        base = mem.track(root, "params")
        loss = gpt_loss(root, idx[:, :seq], tgt[:, :seq])
        a_root = mem.current_bytes - base
    del root, loss
    return {"a_block_bytes": a_block, "a_root_bytes": a_root}


def worker(ctx: launch.RankContext, payload: dict) -> dict:
    import adapters
    from fsdp_assignment.support.memory import LiveStorageTracker
    from fsdp_assignment.support.models import GPT, gpt_batch, gpt_loss

    cfg = gpt2_config(payload)
    batch, seq = payload["batch"], payload["seq"]
    out = {"probe": activation_probe(cfg, batch, seq, ctx.device), "modes": {}}
    for ac in payload["checkpointing"]:
        t0 = time.perf_counter()
        gc.collect()
        with LiveStorageTracker(device=ctx.device.type, resize_label="unsharded") as mem:
            torch.manual_seed(0)
            with torch.device("meta"):
                model = GPT(cfg)
            for block in model.blocks:
                adapters.fully_shard(block)
            adapters.fully_shard(model)
            with _Peak(mem, ctx.device) as init:
                adapters.materialize_meta_module(model, ctx.device)
            t_init = time.perf_counter() - t0
            if ac:
                model.forward = types.MethodType(_checkpointed_forward, model)
            opt = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=1e-4)
            mem.track(model, "params")

            def step(i, phases=None):
                """One AdamW step; with ``phases`` (a dict), the peak of forward+backward and of the optimizer step
                separately (the model's two terms) and the bytes alive when forward ends."""
                idx, tgt = gpt_batch(cfg, batch, seed=1000 * i + ctx.rank, device=ctx.device)
                region = _Peak(mem, ctx.device).__enter__() if phases is not None else None
                loss = gpt_loss(model, idx[:, :seq], tgt[:, :seq])
                if phases is not None:
                    phases["after_forward_bytes"] = mem.current_bytes
                loss.backward()
                if phases is not None:
                    region.__exit__()
                    phases["forward_backward_peak_bytes"] = region.bytes
                    region = _Peak(mem, ctx.device).__enter__()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if phases is not None:
                    region.__exit__()
                    phases["optimizer_peak_bytes"] = region.bytes
                    phases["peak_bytes"] = max(phases["forward_backward_peak_bytes"], region.bytes)
                return float(loss.detach())

            losses = [step(0)]  # warm-up: AdamW's moments exist from here on
            mem.track(opt, "optim")
            measured, times = [], []
            for i in range(1, payload["steps"] + 1):
                torch.distributed.barrier()
                phases: dict = {}
                t = time.perf_counter()
                losses.append(step(i, phases))
                times.append(time.perf_counter() - t)
                measured.append(phases)
            peaks = [m["peak_bytes"] for m in measured]
            shard_elems = sum(p.numel() for p in model.parameters())
        out["modes"][str(ac)] = {"init_peak_bytes": init.bytes, "init_s": t_init, "peaks_bytes": peaks,
                                 "phases": measured,
                                 "peak_bytes": statistics.median(peaks), "step_s": times, "losses": losses,
                                 "shard_elems": shard_elems, "wall_s": time.perf_counter() - t0,
                                 "tracker": "torch.cuda.max_memory_allocated" if ctx.device.type == "cuda"
                                 else "LiveStorageTracker"}
        ctx.log(f"checkpointing={ac}: peak {statistics.median(peaks) / report.MiB:.0f} MiB, "
                f"{statistics.median(times):.1f} s/step, init {t_init:.1f} s (peak {init.bytes / report.MiB:.0f} MiB)")
        model = opt = step = None  # free this mode's model before the next one is built
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
def model_terms(cfg, w: int, probe: dict, batch: int, seq: int, ac: bool) -> dict:
    """The printed model for one W and checkpointing setting (bench_memory.analytic with A from the probe)."""
    a_block, a_root = probe["a_block_bytes"], probe["a_root_bytes"]
    kept = batch * seq * cfg.n_embd * 4  # a checkpointed block keeps only its input
    acts = (cfg.n_layer * kept + a_block + a_root) if ac else (cfg.n_layer * a_block + a_root)
    m = bench_memory.analytic("FSDP", w, cfg, acts)
    m["units_bytes"] = m["unsharded_params_bytes"] + m["unsharded_grads_bytes"]
    # the terms of the branch of the max that binds: they add up to the model's peak
    if m["at_backward_start"] >= m["at_backward_end"]:
        m["binding"], m["terms"] = "start of backward", {"states": 12 * m["S"], "units": m["units_bytes"],
                                                          "activations": m["activations_bytes"]}
    else:
        m["binding"], m["terms"] = "end of backward", {"states": 16 * m["S"], "units": m["end_extra_bytes"],
                                                        "activations": 0}
    return m


def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [2])
    g = p.add_argument_group("model: GPT-2 small by default; smaller values reduce it")
    g.add_argument("--layers", type=cli.positive_int, default=12)
    g.add_argument("--n-embd", type=cli.positive_int, default=768)
    g.add_argument("--n-head", type=cli.positive_int, default=12)
    g.add_argument("--vocab", type=cli.positive_int, default=50257)
    g.add_argument("--positions", type=cli.positive_int, default=1024, help="the model's context (position embeddings)")
    g.add_argument("--seq", type=cli.positive_int, default=128, help="tokens per sequence in training (<= --positions)")
    g.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per rank per step")
    p.add_argument("--steps", type=cli.positive_int, default=2, help="measured AdamW steps after one warm-up step")
    p.add_argument("--checkpointing", choices=["both", "off", "on"], default="both")
    # a 124M-parameter model on a loaded CPU: two modes x (build + 3 steps) can take well over 10 minutes
    p.set_defaults(timeout=3600)
    return p


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    args = cli.parse(parser(), argv, NAME, QUICK)
    modes = {"both": [False, True], "off": [False], "on": [True]}[args.checkpointing]
    payload = {"layers": args.layers, "n_embd": args.n_embd, "n_head": args.n_head, "vocab": args.vocab,
               "positions": args.positions, "seq": min(args.seq, args.positions), "batch": args.batch,
               "steps": args.steps, "checkpointing": modes}
    cfg = gpt2_config(payload)
    from benchmarks import trainers

    psi = trainers.param_count(cfg)
    report.log(f"gpt2: Ψ = {psi / 1e6:.1f}M params (L={cfg.n_layer}, d={cfg.n_embd}, vocab {cfg.vocab_size}), "
               f"W in {args.world_sizes}, batch {args.batch}x{payload['seq']} per rank", quiet=args.quiet)
    done = sweep.run(args, NAME, "benchmarks.gpt2_small:worker", [(f"W{w}", w, payload) for w in args.world_sizes])
    if not report.is_writer():
        return {}
    rows, records = [], []
    for w in args.world_sizes:
        ranks = done.get(f"W{w}")
        if ranks is None:
            continue
        for ac in modes:
            res = [r["modes"][str(ac)] for r in ranks]
            peak = max(r["peak_bytes"] for r in res)
            m = model_terms(cfg, w, ranks[0]["probe"], args.batch, payload["seq"], ac)
            err = peak / m["peak_bytes"] - 1
            step_s = statistics.median(t for r in res for t in r["step_s"])
            after_forward = [max(r["phases"][i]["after_forward_bytes"] for r in res) for i in range(len(res[0]["phases"]))]
            rows.append([w, "on" if ac else "off", peak / report.MiB, m["peak_bytes"] / report.MiB, f"{err:+.1%}",
                         m["binding"]] + [m["terms"][k] / report.MiB for k in ("states", "units", "activations")] + [
                         statistics.median(after_forward) / report.MiB,
                         max(r["init_peak_bytes"] for r in res) / report.MiB,
                         step_s])
            steps_worst = [max(r["peaks_bytes"][i] for r in res) for i in range(len(res[0]["peaks_bytes"]))]
            records.append({"world_size": w, "checkpointing": ac, "peak_bytes": peak, "model": m, "model_error": err,
                            "per_rank": res, "step_s": step_s, "peak_bytes_steps": steps_worst,
                            "after_forward_bytes_steps": after_forward})
    took = time.perf_counter() - t_start
    full_bytes = 4 * psi
    md = (f"GPT-2-small shape: Ψ = {psi:,} params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
          f"vocab={cfg.vocab_size}, positions={cfg.block_size}; full fp32 model {full_bytes / report.MiB:.0f} MiB), "
          f"batch {args.batch}x{payload['seq']} tokens per rank, AdamW, FSDP = adapters "
          f"({report.environment()['fsdp_impl']}); built on meta, sharded, materialized unit by unit. Peak = worst "
          f"rank, median of {args.steps} measured steps ({records[0]['per_rank'][0]['tracker'] if records else '?'}). "
          f"The whole run took {took:.0f} s ({report.environment()['cpus']} CPUs, device {args.device}).\n\n"
          + report.markdown_table(HEADERS, rows))
    raw = {"benchmark": NAME, "config": vars(args), "environment": report.environment(), "psi": psi,
           "results": records, "took_s": took}

    def plot():
        import matplotlib.pyplot as plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4))
        labels = [f"W={r['world_size']}\nAC {'on' if r['checkpointing'] else 'off'}" for r in records]
        xs = list(range(len(records)))

        def spread(vals):  # median and its min-max error bar, MiB
            mid = statistics.median(vals)
            return mid / report.MiB, [(mid - min(vals)) / report.MiB, (max(vals) - mid) / report.MiB]

        peaks = [spread(r["peak_bytes_steps"]) for r in records]
        ax.bar([x - 0.2 for x in xs], [p[0] for p in peaks], 0.4, yerr=list(zip(*[p[1] for p in peaks])),
               capsize=3, label="measured peak (min-max over steps)")
        bottom = [0.0] * len(records)
        for key, color in (("states", "#55A868"), ("units", "#C44E52"), ("activations", "#8172B3")):
            vals = [r["model"]["terms"][key] / report.MiB for r in records]
            ax.bar([x + 0.2 for x in xs], vals, 0.4, bottom=bottom, color=color, label=f"model: {key}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(xs, labels)
        ax.set_ylabel("MiB per rank")
        ax.set_title("Peak: measured vs the model's terms (they add up)", fontsize=10)
        ax.legend(fontsize=7)
        after = [spread(r["after_forward_bytes_steps"]) for r in records]
        bx.bar([x - 0.2 for x in xs], [a[0] for a in after], 0.4, yerr=list(zip(*[a[1] for a in after])), capsize=3,
               color="#4C72B0", label="held when forward ends, measured (min-max over steps)")
        bx.bar([x + 0.2 for x in xs], [r["model"]["activations_bytes"] / report.MiB for r in records], 0.4,
               color="#8172B3", label="activations kept for backward (model's A)")
        bx.set_xticks(xs, labels)
        bx.set_ylabel("MiB per rank")
        bx.set_title("What activation checkpointing changes", fontsize=10)
        bx.legend(fontsize=7)
        fig.suptitle(f"GPT-2-small shape ({psi / 1e6:.0f}M params), batch {args.batch}x{payload['seq']} per rank",
                     fontsize=10)
        fig.tight_layout()
        return fig

    sweep.finish(args, NAME, raw, md, plot)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
