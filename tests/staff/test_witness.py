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
failure is the kernel's, and it is this test's alone: every test that decides memory or bytes is witnessed on its
own run against its own bound (checked below; staff/grader_selftest/lies.py grades the pairs). The same witness
passes on torch's own ``fully_shard`` for the same model and step. (The variants are staff-only: they
import the reference directly.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_assignment.support.models import gpt_loss
from tests.harness import RankFailure, Witness, run_ranks
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
    # With the lie: the reports pass, the kernel's counts do not, and the failure says the kernel decided: the same
    # kind of failure as the honest one, so the lie scores what the honest bug scores here.
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


# ---- Every graded test that decides memory or bytes is witnessed on its own run (issue 35, item 1) ------------------
# Each test marked evidence("memory"/"bytes") passes a Witness, with its own bound, to every run_ranks call it makes
# (directly, or through a function of its module that it calls): no run is special, so none can be recognised, and
# a test stands or falls on what the kernel saw of its own run. The list of tests not witnessed yet stays empty.
NOT_YET_WITNESSED: set[str] = set()


def _run_ranks_calls(fn: ast.FunctionDef, functions: dict[str, ast.FunctionDef], seen=()) -> list[ast.Call]:
    """The run_ranks calls ``fn`` makes, itself or through the module's functions it calls (by name)."""
    calls = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "run_ranks":
                calls.append(node)
            elif node.func.id in functions and node.func.id not in seen and node.func.id != fn.name:
                calls += _run_ranks_calls(functions[node.func.id], functions, (*seen, fn.name))
    return calls


def _evidence_tests() -> dict[str, list[ast.Call]]:
    """``file.py::test`` -> its run_ranks calls, for every test marked evidence(...)."""
    out = {}
    for path in sorted(ROOT.glob("tests/*/test_*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        functions = {n.name: n for n in body if isinstance(n, ast.FunctionDef)}
        for node in functions.values():
            if node.name.startswith("test_") and any(
                    isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.evidence"
                    for d in node.decorator_list):
                out[f"{path.name}::{node.name}"] = _run_ranks_calls(node, functions)
    return out


def test_every_test_that_decides_memory_or_bytes_is_witnessed_on_its_own_run():
    tests = _evidence_tests()
    assert len(tests) >= 31, f"only {len(tests)} tests marked evidence(...) found: the AST walk is broken"
    unwatched = {name for name, calls in tests.items()
                 if not calls or any(not any(k.arg == "witness" for k in c.keywords) for c in calls)}
    assert unwatched == NOT_YET_WITNESSED == set(), (
        f"graded tests deciding memory or bytes whose runs the kernel does not watch (each run_ranks call needs "
        f"witness=Witness(...) with the test's own bound, tests/public/common.py's witness_bounds): "
        f"{sorted(unwatched)}")
    retired = [p.name for d in ("public", "hidden") for p in (ROOT / "tests" / d).glob("test_*.py")
               if "pytest.mark.witnessed" in p.read_text()]
    assert not retired, f"the witnessed(twins=...) marker is retired (every evidence test is witnessed): {retired}"


def _holds_then_hangs(rank, world_size):
    import time
    kept = torch.ones(16 << 20, dtype=torch.uint8)  # 16 MiB, far above the bound below
    time.sleep(60)
    return int(kept[0])


def test_a_witnessed_run_that_timed_out_is_judged_as_a_timeout():
    """Issue 35, item 4: a timeout is not evidence. The rank broke its bound before it hung, and the run still
    fails as the timeout it is (kind "timeout", its stacks), not as a witness failure (on the harness before: a
    "witness" failure, which the grader's hang blame does not see)."""
    with pytest.raises(RankFailure) as failed:
        run_ranks(_holds_then_hangs, 1, timeout=3, witness=Witness(peak_bytes=1 << 20, sent_bytes=0))
    assert failed.value.kind == "timeout", f"{failed.value.kind}: {failed.value}"
    assert "the kernel's witness" not in str(failed.value), str(failed.value)
