"""Task 3: forward (unshard, reshard, pre_forward/post_forward hooks)."""

from __future__ import annotations

import pytest
import torch

import adapters
from fsdp_assignment.support.models import GPT, GPTConfig, ToyMLP
from tests.harness import run_ranks
from tests.public.common import assert_close, hand_shard_gpt, local_batch, rank_device, unsharded_storage_sizes

pytestmark = pytest.mark.task3


def _unshard(rank, world_size):
    torch.manual_seed(0)
    block = ToyMLP().blocks[0].to(rank_device())
    names = [n for n, p in block.named_parameters() if p.requires_grad]
    fp = adapters.make_flat_param(block, names, rank, world_size)
    adapters.unshard(fp)
    gathered = fp.unsharded.detach()[:fp.numel].clone().cpu()
    sizes = [fp.unsharded.untyped_storage().size()]
    adapters.reshard(fp)
    sizes.append(fp.unsharded.untyped_storage().size())
    work = adapters.unshard(fp, async_op=True)
    work.wait()
    gathered_async = fp.unsharded.detach()[:fp.numel].clone().cpu()
    adapters.reshard(fp)
    return {"gathered": gathered, "gathered_async": gathered_async, "sizes": sizes,
            "itemsize": fp.unsharded.element_size(), "padded_numel": fp.padded_numel}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.evidence("memory")
def test_unshard_gathers_every_rank_shard_and_reshard_frees(backend, world_size):
    results = run_ranks(_unshard, world_size, backend=backend)
    torch.manual_seed(0)
    block = ToyMLP().blocks[0]
    flat = torch.cat([p.detach().reshape(-1) for p in block.parameters() if p.requires_grad])
    for rank, got in enumerate(results):
        assert torch.equal(got["gathered"], flat), f"rank {rank}: unshard() must gather every rank's shard in rank order"
        assert torch.equal(got["gathered_async"], flat), f"rank {rank}: unshard(async_op=True) + wait() gathers wrong data"
        assert got["sizes"][0] == got["padded_numel"] * got["itemsize"], f"rank {rank}: unsharded storage not allocated"
        assert got["sizes"][1] == 0, f"rank {rank}: reshard() must leave the unsharded storage at size 0"


def _forward(rank, world_size, reshard_after_forward):
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    hand_shard_gpt(model, reshard_after_forward=reshard_after_forward, hooks=3)
    idx, _ = local_batch(cfg, rank, world_size, step=0)
    with torch.no_grad():
        logits = model(idx)
        logits_again = model(idx)  # a second forward re-gathers (or reuses) correctly
    return {"logits": logits, "again": logits_again, "sizes": unsharded_storage_sizes(model)}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.evidence("memory")
def test_forward_matches_single_process(world_size, reshard_after_forward):
    results = run_ranks(_forward, world_size, reshard_after_forward)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    for rank, got in enumerate(results):
        idx, _ = local_batch(cfg, rank, world_size, step=0)
        with torch.no_grad():
            expected = model(idx)
        assert_close(got["logits"], expected, f"rank {rank}: logits", rtol=1e-6)
        assert_close(got["again"], expected, f"rank {rank}: logits of a second forward", rtol=1e-6)
        assert len(got["sizes"]) == cfg.n_layer + 1, \
            f"rank {rank}: {len(got['sizes'])} FlatParameters, expected one per unit ({cfg.n_layer} blocks + root)"
        if reshard_after_forward:
            assert all(s == 0 for s in got["sizes"]), \
                f"rank {rank}: after forward with reshard_after_forward=True every unit must be resharded " \
                f"(unsharded storage sizes {got['sizes']})"
        else:
            assert all(s > 0 for s in got["sizes"]), \
                f"rank {rank}: with reshard_after_forward=False units stay unsharded after forward ({got['sizes']})"
