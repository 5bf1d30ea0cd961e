"""All-gather and reduce-scatter on 2 CPU processes (gloo): what Tasks 3 and 4 build on. Run: python docs/collectives_demo.py"""
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world_size: int, store_file: str) -> None:
    # A FileStore rendezvous, not a fixed port: two demos (or a demo and the tests) never collide.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    shard = torch.arange(3.0) + 10 * rank                       # rank r owns elements [3r, 3r + 3) of a flat buffer
    full = torch.empty(3 * world_size)
    dist.all_gather_single(full, shard)                         # every rank receives every shard, in rank order
    grad = torch.full((3 * world_size,), float(rank + 1))      # each rank's full "gradient"
    mine = torch.empty(3)
    dist.reduce_scatter_single(mine, grad, op=dist.ReduceOp.AVG)  # mean over ranks, keep only my slice
    print(f"rank {rank}: shard {shard.tolist()} -> all-gather {full.tolist()}; reduce-scatter(AVG) {mine.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(main, args=(2, f"{tmp}/store"), nprocs=2)
