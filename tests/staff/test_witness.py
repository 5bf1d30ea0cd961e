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

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_assignment.support.models import gpt_loss
from tests.harness import RankFailure, run_ranks
from tests.public.test_task7_fully_shard import (WITNESS_CFG, _memory_states, check_memory_states,
                                                 witness_bounds)

pytestmark = pytest.mark.staff
WORLD_SIZE = 2
ROOT = Path(__file__).resolve().parents[2]


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


def _never_free_in_shared_memory() -> None:
    """Issue 32's lie: the reference, except that each gathered buffer lives in a new piece of an unlinked /dev/shm
    file mapped MAP_SHARED, "freed" with MADV_DONTNEED. The storages really read 0 bytes and resident memory
    falls, but the pages stay in the file: nothing is freed (Shmem rose 197 MiB, VmHWM at the reference's level)."""
    import mmap
    import os
    from fsdp_assignment.reference import task2_flat_param as t2
    path = f"/dev/shm/fsdp-witness-lie-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    pieces = {"end": 0, "maps": []}

    def alloc_unsharded(self):
        if self.is_unsharded():
            return
        nbytes = -(-self.padded_numel * self.unsharded.element_size() // mmap.PAGESIZE) * mmap.PAGESIZE
        os.ftruncate(fd, pieces["end"] + nbytes)
        piece = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, offset=pieces["end"])
        pieces["end"] += nbytes
        pieces["maps"].append(piece)
        self.unsharded.data = torch.frombuffer(piece, dtype=self.unsharded.dtype, count=self.padded_numel)

    def free_unsharded(self):
        for piece in pieces["maps"]:
            piece.madvise(mmap.MADV_DONTNEED)
        empty = torch.empty(self.padded_numel, dtype=self.unsharded.dtype)  # never touched: nothing resident
        empty.untyped_storage().resize_(0)
        self.unsharded.data = empty

    t2.FlatParameter.alloc_unsharded, t2.FlatParameter.free_unsharded = alloc_unsharded, free_unsharded


def _shared_memory_body(rank, world_size):
    _never_free_in_shared_memory()
    return _memory_states(rank, world_size)


@pytest.mark.parametrize("source", ["cgroup", "proc"])
def test_memory_hidden_in_a_dropped_shared_mapping_is_the_kernels(source, monkeypatch):
    """Issue 32 (item 2): what the rank holds in tmpfs pages it no longer maps counts: its memory cgroup's shmem
    where a cgroup can be made, else the blocks of the tmpfs files it holds (/proc); the ranks' reports pass, the
    kernel's count does not."""
    import os
    import tests.harness
    from tests.rank_cgroup import RankCgroup
    if source == "cgroup":
        probe = RankCgroup.create(f"fsdp-probe-{os.getpid()}")
        if probe is None:
            pytest.skip("no memory cgroup can be made here")
        probe.remove()
    else:
        monkeypatch.setattr(tests.harness.RankCgroup, "create", classmethod(lambda cls, name: None))
    witness = witness_bounds(WITNESS_CFG, WORLD_SIZE)
    results = run_ranks(_shared_memory_body, WORLD_SIZE, witness=witness)
    with pytest.raises(RankFailure) as lying:
        check_memory_states(results, witness)
    message = str(lying.value)
    assert lying.value.kind == "witness" and "resident memory" in message and "page tables" in message, message
    assert "What the ranks reported failed" not in message, message  # the reports themselves passed


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


# ---- Which graded tests the kernel watches (issue 32, item 1) --------------------------------------------------
# Graded tests that decide memory or bytes from the ranks' reports (marker evidence) but whose runs the kernel does
# not watch yet: issue 32 asks for every one to be witnessed against its own bound, which is not done (a memory
# bound means something only where a unit's parameters stand far above the 1-2 MiB by which an idle rank moves;
# these tests' models are small). Until then the grader's rule covers them: a witness failure, or a witnessed test
# failing only where watched (Grader.fail_closed), refutes their reports. The list may only shrink.
NOT_YET_WITNESSED = {
    "test_differential.py::test_generated_scripts_match_torch_fsdp2",
    "test_task3_hidden.py::test_reshard_really_frees_memory",
    "test_task4_hidden.py::test_gradients_accumulate_over_backward_passes",
    "test_task4_hidden.py::test_backward_really_frees_full_parameters_and_gradients",
    "test_task4_hidden.py::test_frozen_embedding_and_a_fully_frozen_unit",
    "test_task4_hidden.py::test_unit_run_twice_and_detached_output",
    "test_task6_hidden.py::test_prefetch_gathers_each_unit_once_and_finishes_every_reduction",
    "test_task6_hidden.py::test_prefetch_follows_a_changed_order_and_frees_units_that_never_run",
    "test_task6_hidden.py::test_prefetch_with_a_block_run_twice_keeps_two_units_unsharded",
    "test_task6_hidden.py::test_prefetch_with_frozen_embedding_and_a_fully_frozen_unit",
    "test_task7_hidden.py::test_gradient_accumulation_over_two_steps_with_prefetch",
    "test_task7_hidden.py::test_reshard_after_forward_false_via_fully_shard",
    "test_bonus_hsdp.py::test_hsdp_2x2_trains_like_one_process_and_fsdp2",
    "test_bonus_hsdp.py::test_hsdp_degenerate_meshes_4x1_and_1x4",
    "test_task2_flat_param.py::test_views_alias_the_flat_buffer_and_free_releases_storage",
    "test_task3_forward.py::test_unshard_gathers_every_rank_shard_and_reshard_frees",
    "test_task3_forward.py::test_forward_matches_single_process",
    "test_task4_backward.py::test_gradient_shards_match_single_process",
    "test_task4_backward.py::test_gradients_without_reshard_after_forward",
    "test_task4_backward.py::test_nested_frozen_and_unused_parameters",
    "test_task4_backward.py::test_frozen_base_weights_are_resharded_at_each_units_backward",
    "test_task4_backward.py::test_activation_checkpointing_matches_single_process",
    "test_task5_optim_ckpt.py::test_optimizer_state_is_sharded_and_one_adamw_step_matches",
    "test_task6_prefetch.py::test_prefetch_changes_no_number",
    "test_task6_prefetch.py::test_prefetch_order_and_at_most_two_units_unsharded",
    "test_task6_prefetch.py::test_prefetch_with_frozen_base_weights",
    "test_task6_prefetch.py::test_prefetch_with_activation_checkpointing",
    "test_task7_fully_shard.py::test_training_matches_single_process_and_torch_fsdp2",
    "test_task7_fully_shard.py::test_tied_weights_are_updated_once",
    "test_task7_fully_shard.py::test_mixed_precision_matches_torch_fsdp2",
    "test_task7_fully_shard.py::test_gradient_accumulation_with_and_without_sync",
}


def _marked_tests() -> dict[str, dict[str, ast.Call]]:
    """``file.py::test`` -> {marker name: its decorator call} for the evidence and witnessed markers."""
    out = {}
    for path in sorted(ROOT.glob("tests/*/test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = {ast.unparse(d.func).rsplit(".", 1)[1]: d for d in node.decorator_list
                         if isinstance(d, ast.Call) and ast.unparse(d.func) in ("pytest.mark.evidence",
                                                                                 "pytest.mark.witnessed")}
                out[f"{path.name}::{node.name}"] = marks
    return out


def test_every_test_that_decides_memory_or_bytes_is_witnessed_or_listed():
    marked = _marked_tests()
    evidence = {name for name, marks in marked.items() if "evidence" in marks}
    witnessed = {name: marks["witnessed"] for name, marks in marked.items() if "witnessed" in marks}
    unwatched = evidence - set(witnessed) - NOT_YET_WITNESSED
    assert not unwatched, f"graded tests deciding memory or bytes that no kernel witness watches: {sorted(unwatched)}"
    stale = NOT_YET_WITNESSED - (evidence - set(witnessed))
    assert not stale, f"NOT_YET_WITNESSED names tests that are witnessed now, or gone: {sorted(stale)}"
    tests = {name.split("::")[1] for name in marked}
    for name, mark in witnessed.items():  # each names its twins: graded tests running the same code unwatched
        twins = next((ast.literal_eval(k.value) for k in mark.keywords if k.arg == "twins"), ())
        assert twins and all(t in tests and t != name.split("::")[1] for t in twins), \
            f"{name}: witnessed(twins={twins!r}) must name other tests"
