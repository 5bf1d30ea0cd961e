"""Train the small GPT with FSDP on W ranks, on one node or several, and check it against one process.

    python benchmarks/train_gpt.py --world-sizes 2 4                      # local ranks
    python benchmarks/train_gpt.py --launcher slurm --slurm-nodes 2 --world-sizes 4      # 2 nodes x 2 tasks
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        benchmarks/train_gpt.py --world-sizes 4                           # the same command on every node

The training example of the cluster instructions (benchmarks/README.md), and CI's multi-node check: every rank
builds the same GPT (seed 0), wraps each block and then the root with ``adapters.fully_shard`` (the
implementation ``FSDP_IMPL`` selects), and takes ``--steps`` AdamW steps on its 1/W slice of a
global batch of W x --batch sequences. Rank 0 then trains the same model in one process on the whole global batch
(the mean loss over W equal slices equals the mean over the batch, and FSDP's reduce-scatter averages over W), and
compares every parameter gathered with ``adapters.gather_full_params``:

    max rel. error = max over parameters of ||FSDP - one process|| / ||one process||   (fp32: about 1e-7)

The model starts from a sensible initialisation (``sensible_init``: every Linear and Embedding weight N(0, 0.02),
biases zero, as GPT-2 does; the support model's own default, N(0, 1) embeddings feeding a tied head, starts the loss
near 50), and by default every step sees the same global batch (``--data repeat``): the model memorizes it, so the
loss falls visibly from about ln(vocab) within a few steps, a sign that training works that random fresh tokens
(``--data fresh``, not learnable) cannot give.

AdamW's eps is 1e-4 here, not 1e-8: Adam's step is lr * g / (|g| + eps), and for a gradient that is zero in exact
arithmetic (the attention key bias: softmax ignores it) a tiny eps turns rounding noise into a full +-lr step in
any two implementations; an eps above that noise keeps the comparison about FSDP.

Output: <out>/train.json and train.md (no plot).

| W | nodes | hosts | steps | first loss | final loss | max rel. error vs one process |
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import lazy_import  # noqa: E402
from benchmarks import cli, report, sweep, trainers  # noqa: E402  (none of these imports torch)

# imported on first use (inside the ranks): see benchmarks/__init__.py
torch = lazy_import("torch")
launch = lazy_import("benchmarks.launch")

NAME = "train"
HEADERS = ["W", "nodes", "hosts", "steps", "first loss", "final loss", "max rel. error vs one process"]
QUICK = ["--world-sizes", "2", "--steps", "2"] + cli.QUICK_MODEL


def sensible_init(model) -> None:
    """GPT-2's initialisation: Linear and Embedding weights N(0, 0.02), biases zero (LayerNorms keep 1 and 0)."""
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)


def _train(model, optimizer, cfg, batch: int, world_size: int, rank: int, steps: int, device,
           repeat: bool = True) -> list[float]:
    from fsdp_assignment.support.models import gpt_batch, gpt_loss

    losses = []
    for step in range(steps):
        idx, tgt = gpt_batch(cfg, batch * world_size, seed=0 if repeat else step, device=device)
        idx, tgt = idx[rank * batch:(rank + 1) * batch], tgt[rank * batch:(rank + 1) * batch]
        loss = gpt_loss(model, idx, tgt)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def worker(ctx: launch.RankContext, payload: dict) -> dict:
    import adapters
    import torch.distributed as dist
    from fsdp_assignment.support.models import GPT

    cfg = trainers.model_config(payload)
    torch.manual_seed(0)
    model = GPT(cfg).to(ctx.device)
    sensible_init(model)
    for block in model.blocks:
        adapters.fully_shard(block)
    adapters.fully_shard(model)
    opt = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=payload["lr"], eps=payload["eps"])
    repeat = payload.get("data", "repeat") == "repeat"
    losses = _train(model, opt, cfg, payload["batch"], ctx.world_size, ctx.rank, payload["steps"], ctx.device, repeat)
    full = {k: v.detach().cpu() for k, v in adapters.gather_full_params(model).items()}
    out = {"host": socket.gethostname(), "local_rank": ctx.local_rank, "device": str(ctx.device), "losses": losses}
    if ctx.rank == 0:  # the same training in one process, on the whole global batch
        torch.manual_seed(0)
        ref = GPT(cfg).to(ctx.device)
        sensible_init(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=payload["lr"], eps=payload["eps"])
        ref_losses = _train(ref, ref_opt, cfg, payload["batch"] * ctx.world_size, 1, 0, payload["steps"], ctx.device,
                            repeat)
        errs = {}
        for name, p in ref.named_parameters():
            a, b = full[name], p.detach().cpu()
            errs[name] = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        out |= {"max_rel_err": max(errs.values()), "worst_param": max(errs, key=errs.get),
                "one_process_losses": ref_losses, "params": sum(p.numel() for p in ref.parameters())}
    dist.barrier()
    return out


def parser() -> argparse.ArgumentParser:
    """This script's flags (torch-free: run_all.py checks them all before running anything)."""
    p = cli.base_parser(__doc__)
    cli.world_sizes_arg(p, [2])
    cli.add_model_args(p, params=4e5, layers=4, block_size=32, batch=2)
    p.add_argument("--steps", type=cli.positive_int, default=3, help="AdamW steps")
    p.add_argument("--lr", type=cli.positive_float, default=1e-3)
    p.add_argument("--eps", type=cli.positive_float, default=1e-4, help="AdamW eps (see the docstring)")
    p.add_argument("--data", choices=["repeat", "fresh"], default="repeat",
                   help="repeat: the same global batch every step (the loss falls); fresh: new random tokens each step")
    return p


def main(argv=None) -> dict:
    args = cli.parse(parser(), argv, NAME, QUICK)
    payload = {**trainers.model_payload(args), "steps": args.steps, "lr": args.lr, "eps": args.eps, "data": args.data}
    done = sweep.run(args, NAME, "benchmarks.train_gpt:worker", [(f"W{w}", w, payload) for w in args.world_sizes])
    if not report.is_writer():
        return {}
    rows, records = [], []
    for w in args.world_sizes:
        ranks = done.get(f"W{w}")
        if ranks is None:
            continue
        hosts = sorted({r["host"] for r in ranks})
        r0 = ranks[0]
        # the loss of the global batch: the mean over the ranks' equal slices
        loss = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(r0["losses"]))]
        rows.append([w, len(hosts), ", ".join(hosts), args.steps, f"{loss[0]:.3f}", f"{loss[-1]:.3f}",
                     f"{r0['max_rel_err']:.2e}"])
        records.append({"world_size": w, "hosts": hosts, "ranks": ranks})
    md = (f"GPT {done and records and records[0]['ranks'][0]['params'] or 0:,} params, {args.steps} AdamW steps, "
          f"global batch W x {args.batch} x {args.block_size} tokens, FSDP = adapters ({report.environment()['fsdp_impl']}), "
          f"launcher {args.launcher}; GPT-2 initialisation (N(0, 0.02)); data: {args.data} (repeat: the same global "
          f"batch every step, so the loss falls as it is memorized; ln(vocab) = {math.log(args.vocab):.3f}). Losses: "
          f"the global batch's, before the first and the last step.\n\n" + report.markdown_table(HEADERS, rows))
    raw = {"benchmark": NAME, "config": vars(args), "environment": report.environment(), "results": records}
    sweep.finish(args, NAME, raw, md, None)
    return raw


if __name__ == "__main__":
    cli.run_script(main)
