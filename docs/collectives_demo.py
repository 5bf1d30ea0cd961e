"""All-gather and reduce-scatter on 2 CPU processes (gloo): what Tasks 3 and 4 build on. Run: python docs/collectives_demo.py"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    shard = torch.arange(3.0) + 10 * rank                       # rank r owns elements [3r, 3r + 3) of a flat buffer
    full = torch.empty(3 * world_size)
    dist.all_gather_single(full, shard)                         # every rank receives every shard, in rank order
    grad = torch.full((3 * world_size,), float(rank + 1))      # each rank's full "gradient"
    mine = torch.empty(3)
    dist.reduce_scatter_single(mine, grad, op=dist.ReduceOp.AVG)  # mean over ranks, keep only my slice
    print(f"rank {rank}: shard {shard.tolist()} -> all-gather {full.tolist()}; reduce-scatter(AVG) {mine.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
