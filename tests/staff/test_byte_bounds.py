"""The kernel's byte bounds hold for correct code under load and still fail the defects they exist for (issue 42).

A rank's bytes are counted at its TCP sockets (tests/harness_sockets.py). Until issue 42 the count was
``tcpi_bytes_acked + idiag_wqueue``, which the kernel reads at two moments (idiag_wqueue before tcp_get_info takes
the socket's lock): the ACKs arriving in between counted twice, the parent kept each socket's most, and correct runs
beside other gradings counted up to 4.1% over their bound (Task 3's forward, W=2: 39,922,170 bytes against
38,358,599). The count is now one locked reading's (``tcp_written``), exact under any load.

Here: the racy reading measured on this machine is counted once; correct runs of Task 3's forward at W = 2, 3, 4,
with other witnessed runs and busy processes beside them, pass their bound; the defects the bound is for fail it,
under the same load: every unit gathered a second time (Task 3's forward at W=2 with resharding, against the bound
of the forward that keeps its units), and an all-reduce where a reduce-scatter does (Task 7's witnessed step, the
reference with its gradients all-reduced: a step's bytes grow by a third). Each run's bytes against its bound are
printed (``-s``): the margin, measured.

``python -m tests.staff.test_byte_bounds SECONDS STOPFILE`` is the load: witnessed forward runs back to back
(W=2 and 3), until STOPFILE exists or SECONDS pass.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness import RankFailure, run_ranks
from tests.harness_sockets import (TCPI_BYTES_ACKED, TCPI_BYTES_RETRANS, TCPI_BYTES_SENT, TCPI_NOTSENT_BYTES,
                                   tcp_written)
from tests.public import test_task3_forward as t3
from tests.public.common import witness_for

# At load 20 on 2 cores the first run's forkserver alone outlasted pytest's default 120 s (the run itself then
# took 60 s): a generous limit, the load being the point.
pytestmark = [pytest.mark.staff, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
BUSY_LOOPS = 2  # besides the witnessed runs of the load: processes that only take CPU


def _forward_witness(world_size: int, reshard_after_forward: bool):
    """test_forward_matches_single_process's own bound (the same call)."""
    cfg = t3.FORWARD_CFG
    witness = witness_for(lambda: t3.GPT(cfg), [f"blocks.{i}." for i in range(cfg.n_layer)] + [""], world_size,
                          built=0, shard_copies=1, unsharded=2 if reshard_after_forward else cfg.n_layer + 1,
                          full_grads=0, moved=2 if reshard_after_forward else 1)
    witness.deferred = True  # checked by the test, after the figures are printed
    witness.peak_bytes = None  # bytes only, here: memory has its own tests (test_witness.py)
    return witness


def _sent(witness) -> str:
    bound = witness.sent_bytes
    return ", ".join(f"rank {m['rank']} {m['socket_sent_bytes']:,} ({m['socket_sent_bytes'] / bound - 1:+.2%})"
                     for m in witness.measured) + f" against {bound:,}"


def _load_avg() -> str:
    return open("/proc/loadavg").read().split()[0]


@pytest.fixture(scope="module")
def load_beside():
    """Other gradings beside the test: witnessed forward runs back to back in another process, and busy loops."""
    stop = Path(tempfile.mkdtemp(prefix="fsdp-load-")) / "stop"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.staff.test_byte_bounds", "300", str(stop)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    procs += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_LOOPS)]
    time.sleep(2)  # the first witnessed run of the load under way
    try:
        yield
    finally:
        stop.touch()
        for p in procs[1:]:
            p.kill()
        try:
            procs[0].wait(timeout=60)  # it ends its run (and the run's ranks) cleanly
        except subprocess.TimeoutExpired:
            procs[0].kill()
        for p in procs:
            p.wait()
        stop.unlink(missing_ok=True)
        stop.parent.rmdir()


def test_a_reading_counts_the_bytes_written_once():
    """A reading taken on this machine's kernel (6.18) beside other gradings: bytes_acked had reached the socket's
    whole count while idiag_wqueue, read before the lock, still held 1,835,114 bytes. The locked counters say what
    was written: the old sum counted 3.6% more."""
    info = bytearray(232)
    struct.pack_into("=Q", info, TCPI_BYTES_ACKED, 50_601_569)
    struct.pack_into("=QQ", info, TCPI_BYTES_SENT, 50_613_932, 12_364)  # sent, of which retransmitted
    struct.pack_into("=I", info, TCPI_NOTSENT_BYTES, 0)
    assert tcp_written(bytes(info), 1_835_114) == 50_601_568
    # Data written and not yet sent is counted too (a reading in the middle of a send).
    struct.pack_into("=I", info, TCPI_NOTSENT_BYTES, 598_595)
    assert tcp_written(bytes(info), 1_835_114) == 50_601_568 + 598_595
    # A kernel before 4.19 (no bytes_sent): the old sum.
    assert tcp_written(bytes(info[:TCPI_BYTES_RETRANS]), 100) == 50_601_569 + 100


# The two runs issue 42 saw fail under load ([False-2]: the staff's implementation, 4.1% over; [True-3]: an
# independent one, 0.68% over), and W=4.
@pytest.mark.parametrize("reshard_after_forward, world_size", [(False, 2), (False, 3), (False, 4), (True, 3)])
def test_a_correct_forward_passes_its_byte_bound_beside_other_gradings(reshard_after_forward, world_size,
                                                                       load_beside):
    witness = _forward_witness(world_size, reshard_after_forward)
    run_ranks(t3._forward, world_size, reshard_after_forward, witness=witness, timeout=240)
    print(f"\ncorrect forward, W={world_size}, reshard_after_forward={reshard_after_forward}, load {_load_avg()}: "
          f"{_sent(witness)}")
    witness.check()


def test_every_unit_gathered_twice_fails_the_byte_bound_beside_other_gradings(load_beside):
    """The forward that reshards gathers every unit again in its second forward: against the bound of the one
    that keeps its units, twice its bytes."""
    witness = _forward_witness(2, False)
    run_ranks(t3._forward, 2, True, witness=witness, timeout=240)
    print(f"\nevery unit gathered twice, W=2, load {_load_avg()}: {_sent(witness)}")
    with pytest.raises(RankFailure) as failed:
        witness.check()
    assert failed.value.kind == "witness" and "bytes written to the rank's sockets" in str(failed.value)


def test_an_all_reduce_for_a_reduce_scatter_fails_the_byte_bound_beside_other_gradings(load_beside):
    """Task 7's witnessed step, the reference with each gradient all-reduced (tests/staff/test_witness.py's
    variant, its counter's record honest): a step moves 4 units' worth where 3 do."""
    from tests.public.test_task7_fully_shard import WITNESS_CFG, witness_bounds
    from tests.staff.test_witness import _graded_body
    witness = witness_bounds(WITNESS_CFG, 2)
    witness.peak_bytes = None
    run_ranks(_graded_body, 2, "all-reduces", True, witness=witness, timeout=240)
    print(f"\nall-reduce for a reduce-scatter, W=2, load {_load_avg()}: {_sent(witness)}")
    with pytest.raises(RankFailure) as failed:
        witness.check()
    assert failed.value.kind == "witness" and "bytes written to the rank's sockets" in str(failed.value)


def test_the_hsdp_tests_send_each_tensor_of_a_state_dict_once():
    """Issue 42 item 4: the HSDP tests send the full state dict between ranks for their own purposes, and pickling a
    tensor sends its whole storage. A state dict whose tensors are views of one buffer is sent as its tensors'
    own bytes (own_storage), not the buffer once per view; a tensor that owns its storage is sent as it is.
    (Ranks and all: the reference returning such views passed the 2x2 test, rank 0 sending 4,722,536 bytes
    against its bound of 5,290,787, and failed it without own_storage, 24,410,248.)"""
    import pickle
    import torch
    from tests.public.common import own_storage
    buffer = torch.arange(1 << 16, dtype=torch.float32)
    views = {f"p{i}": buffer[i << 12:(i + 1) << 12].view(64, 64) for i in range(16)}
    owned = {"w": torch.ones(64, 64), "nested": [torch.zeros(8), (buffer[:8],)], "step": 3}

    def pickled(obj) -> int:  # as broadcast_object_list sends it (torch.save would share the storage once)
        return len(pickle.dumps(obj))

    assert pickled(views) > 16 * buffer.nbytes  # the defect: each view drags the whole buffer along
    sent = own_storage(views)
    assert pickled(sent) < 1.1 * buffer.nbytes
    assert all(torch.equal(sent[k], v) for k, v in views.items())
    kept = own_storage(owned)
    assert kept["w"] is owned["w"] and kept["step"] == 3  # no copy where the tensor owns its storage
    assert kept["nested"][1][0].untyped_storage().nbytes() == 32


def _load(seconds: float, stop: Path) -> None:
    deadline = time.monotonic() + seconds
    world_sizes = [2, 3]
    while time.monotonic() < deadline and not stop.exists():
        world_size = world_sizes[0]
        world_sizes.reverse()
        try:
            run_ranks(t3._forward, world_size, False, witness=_forward_witness(world_size, False), timeout=240)
        except RankFailure:
            pass  # the load's own runs decide nothing


if __name__ == "__main__":
    _load(float(sys.argv[1]), Path(sys.argv[2]))
