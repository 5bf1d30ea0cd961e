"""The kernel witnesses (tests/harness.py, Witness) against submissions that lie, and against PyTorch's FSDP2.

A rank runs student code, which can rewrite anything in its own process: the storage sizes the tests read, the
memory tracker, the collective counters, the invariant monitor. Two such lies used to pay (issue 25):

- never freeing the unsharded parameters, and patching ``UntypedStorage.size``/``nbytes`` so that every buffer
  "freed" reads 0 bytes (56 points honestly, 100 with the lie);
- all-reducing gradients instead of reduce-scattering them, and relabelling the all-reduce as a reduce-scatter
  in the counter's ``_record`` (85.6 honestly, 98.9 with the lie).

Each is played here twice on top of the reference, honestly and with its lie, through the graded test that
decides it (Task 7's ``test_units_are_resharded_after_forward_and_backward``): the honest bug fails on what the
ranks report and on what the kernel saw, the lying one passes the first and fails the second. Either way the
failure is the kernel's, which the grader carries to every test that decides the same property from the ranks'
reports, so the lie earns nothing (staff/grader_selftest/lies.py grades both pairs in full). The same
witness passes on torch's own ``fully_shard`` for the same model and step. (The variants are staff-only: they
import the reference directly.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_assignment.support.models import gpt_loss
from tests.harness import RankFailure, run_ranks
from tests.public.test_task7_fully_shard import (WITNESS_CFG, _memory_states, check_memory_states,
                                                 witness_bounds)

pytestmark = pytest.mark.staff
WORLD_SIZE = 2


# ---- The variants, applied inside the rank before the graded body runs -----------------------------------
def _never_free(lie: bool) -> None:
    """The reference, except that ``free_unsharded`` keeps the storage. The lie: storages it "freed" read as 0
    bytes through ``UntypedStorage.size``/``nbytes`` (what the tests, the monitor and the memory tracker read)."""
    from fsdp_assignment.reference import task2_flat_param as t2
    freed: set[int] = set()
    size, nbytes = torch.UntypedStorage.size, torch.UntypedStorage.nbytes
    t2.FlatParameter.free_unsharded = lambda self: freed.add(self.unsharded.untyped_storage().data_ptr())
    if not lie:
        return
    alloc = t2.FlatParameter.alloc_unsharded

    def alloc_unsharded(self):
        freed.discard(self.unsharded.untyped_storage().data_ptr())
        alloc(self)

    t2.FlatParameter.alloc_unsharded = alloc_unsharded
    torch.UntypedStorage.size = lambda st: 0 if st.data_ptr() in freed else size(st)
    torch.UntypedStorage.nbytes = lambda st: 0 if st.data_ptr() in freed else nbytes(st)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


def _all_reduce(lie: bool) -> None:
    """The reference, except that a gradient is all-reduced and this rank keeps its chunk. The lie: the counter
    records the all-reduce as a reduce-scatter of the same tensor."""
    from fsdp_assignment.reference import task4_backward as t4

    def reduce_scatter(output, input, group, async_op):
        full = input.clone()
        dist.all_reduce(full, group=group)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        output.copy_(full.chunk(world_size)[rank] / world_size)
        return _Done() if async_op else None

    t4._reduce_scatter_single = reduce_scatter
    if not lie:
        return
    from tests.public import collectives
    record = collectives.CountedProcessGroup._record

    def relabelled(self, kind, tensor, opts, output=None, numel=None):
        if kind == "all_reduce":
            kind, numel = "reduce_scatter", int(tensor.numel())
        return record(self, kind, tensor, opts, output, numel)

    collectives.CountedProcessGroup._record = relabelled


VARIANTS = {"never frees": _never_free, "all-reduces": _all_reduce}


def _graded_body(rank, world_size, variant, lie):
    VARIANTS[variant](lie)
    return _memory_states(rank, world_size)


def _fsdp2_body(rank, world_size):
    """The same model and step on torch's own fully_shard."""
    from torch.distributed.fsdp import fully_shard
    from tests.public.collectives import use_counted_collectives
    from tests.public.common import gpt_sharded_block_by_block, local_batch
    use_counted_collectives(late=False)
    torch.manual_seed(0)
    model = gpt_sharded_block_by_block(WITNESS_CFG, fully_shard)
    idx, tgt = local_batch(WITNESS_CFG, rank, world_size, 0)
    gpt_loss(model, idx, tgt).backward()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_lie_earns_nothing_the_kernel_witness_catches_it(variant):
    what = "resident memory" if variant == "never frees" else "bytes written"
    # Told honestly: what the ranks report fails the test's checks, and the kernel, asked either way, fails it too
    # (a "witness" failure, whose message keeps the reports' failure).
    witness = witness_bounds(WITNESS_CFG, WORLD_SIZE)
    results = run_ranks(_graded_body, WORLD_SIZE, variant, False, witness=witness)
    with pytest.raises(RankFailure) as honest:
        check_memory_states(results, witness)
    message = str(honest.value)
    assert honest.value.kind == "witness" and what in message, message
    assert "What the ranks reported failed the test's checks too" in message, message
    # With the lie: the reports pass, the kernel's counts do not, and the failure says the kernel decided. The
    # same kind of failure as the honest one, so the grader refutes the same tests' reports for both
    # (staff/grader_selftest/lies.py grades the pairs in full).
    witness = witness_bounds(WITNESS_CFG, WORLD_SIZE)
    results = run_ranks(_graded_body, WORLD_SIZE, variant, True, witness=witness)
    with pytest.raises(RankFailure) as lying:
        check_memory_states(results, witness)
    message = str(lying.value)
    assert lying.value.kind == "witness" and "kernel" in message and what in message, message
    assert "What the ranks reported failed" not in message, message


def test_the_witness_passes_on_torch_fsdp2():
    witness = witness_bounds(WITNESS_CFG, WORLD_SIZE)
    run_ranks(_fsdp2_body, WORLD_SIZE, witness=witness)
    witness.check()
    for m in witness.measured:  # and it measured something real: the step's gathers and reduce-scatters
        assert m["sent_bytes"] > 0.9 * witness.sent_bytes and m["peak_bytes"] > 0.5 * witness.peak_bytes, m
