"""The strategies the benchmarks compare, on one model: the GPT of fsdp_assignment/support/models.py trained with
AdamW by one process, stock DistributedDataParallel, this project's FSDP (through adapters.py, the one seam) and
torch's own FSDP2. ``build_trainer`` builds one, ``Trainer.step`` takes one training step."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from benchmarks import lazy_import

# imported on first use: the scripts read STRATEGIES (their flags' choices) before torch is imported
torch = lazy_import("torch")
dist = lazy_import("torch.distributed")

if TYPE_CHECKING:
    from benchmarks.comm_meter import CommMeter
    from benchmarks.launch import RankContext


def model_config(args_or_payload) -> "Any":
    from fsdp_assignment.support.models import gpt_config_for_params

    get = (lambda k: args_or_payload[k]) if isinstance(args_or_payload, dict) else (lambda k: getattr(args_or_payload, k))
    return gpt_config_for_params(int(get("params")), n_layer=get("layers"), block_size=get("block_size"),
                                 vocab_size=get("vocab"))


def model_payload(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("params", "layers", "block_size", "batch", "vocab")}


# name -> (family, options). The names are the row labels of the tables.
STRATEGIES = {
    "one process": ("single", {}),
    "DDP (torch)": ("ddp", {}),
    "FSDP": ("fsdp", {"reshard": True, "prefetch": False}),
    "FSDP no-reshard": ("fsdp", {"reshard": False, "prefetch": False}),
    "FSDP + prefetch": ("fsdp", {"reshard": True, "prefetch": True}),
    # The unit-size experiment: two consecutive blocks per unit (half as many units, each twice as large)
    "FSDP + prefetch, 2 blocks/unit": ("fsdp", {"reshard": True, "prefetch": True, "blocks_per_unit": 2}),
    "FSDP2 (torch)": ("fsdp2", {"reshard": True}),
    "FSDP2 (torch) no-reshard": ("fsdp2", {"reshard": False}),
    # The HSDP bonus: a 2-D mesh (replicas R, shard size S) = (2, 2), so W = 4 only.
    "HSDP 2x2": ("hsdp", {"reshard": True, "mesh": (2, 2)}),
}


@dataclass
class Trainer:
    """A model ready to train with AdamW under one strategy, and its step."""
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    cfg: Any
    batch: int
    device: torch.device
    step_index: int = 0

    def batch_for(self, rank: int, step: int):
        from fsdp_assignment.support.models import gpt_batch

        return gpt_batch(self.cfg, self.batch, seed=1000 * step + rank, device=self.device)

    def step(self, rank: int, labels=None, probe: Callable[[str], None] | None = None) -> float:
        """forward, backward, AdamW step, zero_grad. ``labels`` (a LiveStorageTracker) attributes the memory;
        ``probe("forward")`` / ``probe("backward")`` is called when that phase has finished."""
        from fsdp_assignment.support.models import gpt_loss

        idx, tgt = self.batch_for(rank, self.step_index)
        self.step_index += 1
        lab = labels.label if labels is not None else (lambda _name: contextlib.nullcontext())
        with torch.profiler.record_function("bench::forward"), lab("activations"):
            loss = gpt_loss(self.model, idx, tgt)
        if probe is not None:
            probe("forward")
        with torch.profiler.record_function("bench::backward"), lab("activations"):
            loss.backward()
        if probe is not None:
            probe("backward")
        if labels is not None:  # what backward left in .grad is the gradient state, wherever it was allocated
            labels.relabel([p.grad for p in self.model.parameters() if p.grad is not None], "grads")
        with torch.profiler.record_function("bench::optimizer"), lab("optim"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def build_trainer(name: str, cfg, batch: int, device: torch.device, meter: CommMeter | None = None,
                  lr: float = 1e-3, count_ddp: bool = False, foreach: bool | None = None) -> Trainer:
    """Build the benchmark GPT under strategy ``name`` (a key of STRATEGIES) with the same seed everywhere.

    DDP is stock ``DistributedDataParallel`` (its C++ reducer and default all-reduce; gradient_as_bucket_view so
    that .grad are views of its buckets). Only ``count_ddp=True`` (bench_comm's byte counts, never a timing) gives it
    a communication hook that routes each bucket through ``dist.all_reduce``, where ``meter`` can count it.

    ``foreach`` goes to AdamW: None lets torch choose (the per-parameter loop on a CPU, the foreach kernels on a
    GPU, which a timing wants); bench_memory passes False, because the foreach kernels hold a temporary as large as
    the moments during the step, which the memory model does not count."""
    from fsdp_assignment.support.models import GPT

    family, opt = STRATEGIES[name]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # gradient_as_bucket_view: .grad are views of DDP's buckets, so gradients are not held twice
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
        if count_ddp and meter is not None:
            from benchmarks.comm_meter import ddp_comm_hook

            model.register_comm_hook(None, ddp_comm_hook(meter))
    elif family == "fsdp":
        import adapters

        k = opt.get("blocks_per_unit", 1)
        if k > 1:  # regroup the blocks: GPT.forward runs model.blocks in order, a Sequential of k runs the same ops
            blocks = list(model.blocks)
            model.blocks = torch.nn.ModuleList(torch.nn.Sequential(*blocks[i:i + k]) for i in range(0, len(blocks), k))
        for block in model.blocks:
            adapters.fully_shard(block, reshard_after_forward=opt["reshard"])
        adapters.fully_shard(model, reshard_after_forward=opt["reshard"])
        adapters.set_prefetch(model, opt["prefetch"])
    elif family == "hsdp":
        import adapters
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != opt["mesh"][0] * opt["mesh"][1]:
            raise NotImplementedError(f"{name} needs W = {opt['mesh'][0] * opt['mesh'][1]} ranks")
        mesh = init_device_mesh(device.type, opt["mesh"], mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            adapters.fully_shard(block, reshard_after_forward=opt["reshard"], mesh=mesh)
        adapters.fully_shard(model, reshard_after_forward=opt["reshard"], mesh=mesh)
    elif family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=opt["reshard"])
        fully_shard(model, mesh=mesh, reshard_after_forward=opt["reshard"])
    if family in ("fsdp", "hsdp"):
        import adapters

        optimizer = adapters.get_sharded_optimizer(model, torch.optim.AdamW, lr=lr, foreach=foreach)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)
    return Trainer(name, model, optimizer, cfg, batch, device)


def skipped(name: str, exc: BaseException, ctx: "RankContext") -> dict:
    """A strategy whose implementation raises NotImplementedError (a student's unfinished task) is skipped, not
    fatal: the other rows still get measured, and the table lists what was skipped. Every rank raises at the same
    point (the same code runs everywhere), so the ranks stay in step."""
    ctx.log(f"{name}: skipped, {type(exc).__name__}: {exc}")
    dist.barrier()
    return {"skipped": f"{type(exc).__name__}: {exc}"}


def param_count(cfg) -> int:
    """Ψ: parameters of the benchmark GPT, the tied head counted once."""
    from fsdp_assignment.support.models import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def unit_param_counts(cfg, blocks_per_unit: int = 1) -> dict:
    """Parameters per FSDP unit: the root (embeddings, ln_f, tied head) and one block unit (``blocks_per_unit``
    consecutive blocks); ``n_blocks`` is the number of block units."""
    from fsdp_assignment.support.models import GPT

    with torch.device("meta"):
        m = GPT(cfg)
    block = sum(p.numel() for p in m.blocks[0].parameters())
    if cfg.n_layer % blocks_per_unit:
        raise ValueError(f"n_layer={cfg.n_layer} is not a multiple of {blocks_per_unit} blocks per unit")
    return {"root": param_count(cfg) - block * cfg.n_layer, "block": block * blocks_per_unit,
            "n_blocks": cfg.n_layer // blocks_per_unit}

