"""Smoke tests for the benchmarks and the CPU memory tracker they use (fast: run them often).

The benchmark tests run each script end to end at a tiny size with W=2 (gloo, local spawn) and check that the
raw JSON, the markdown table and the PNG plot were written. They say nothing about the numbers themselves:
those depend on the machine. The tracker tests check exact byte counts on hand-made allocations.
"""

from __future__ import annotations

import gc

import torch

from fsdp_assignment.support.memory import LiveStorageTracker


# ---- LiveStorageTracker ---------------------------------------------------------------------------------
def test_tracker_counts_allocations_and_frees():
    with LiveStorageTracker() as mem:
        a = torch.zeros(1000)                       # 4000 bytes
        b = a.view(10, 100)                         # a view: same storage, counted once
        assert mem.current_bytes == 4000
        c = torch.ones(500, dtype=torch.float64)    # 4000 bytes
        assert mem.current_bytes == 8000
        del a
        assert mem.current_bytes == 8000            # b still holds the storage
        del b
        gc.collect()
        assert mem.current_bytes == 4000
        assert mem.peak_bytes == 8000
        del c
        assert mem.current_bytes == 0
        mem.reset_peak()
        assert mem.peak_bytes == 0


def test_tracker_follows_storage_resize():
    # FSDP frees an unsharded buffer by resizing its storage to 0 and re-allocates it by resizing it back.
    with LiveStorageTracker(resize_label="unsharded") as mem:
        t = torch.empty(256)                        # 1024 bytes
        t.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        t.untyped_storage().resize_(4096)
        assert mem.current_bytes == 4096
        assert mem.bytes_by_label() == {"unsharded": 4096}
        u = torch.empty(0)
        u.resize_(100)                              # aten.resize_ goes through the dispatcher
        assert mem.current_bytes == 4096 + 400
        assert mem.peak_bytes == 4096 + 400
    # untracked storages created before the tracker are counted once a resize touches them
    old = torch.empty(10)
    orig_resize = torch.UntypedStorage.resize_
    with LiveStorageTracker() as mem:
        old.untyped_storage().resize_(0)
        old.untyped_storage().resize_(80)
        assert mem.current_bytes == 80
    assert torch.UntypedStorage.resize_ is orig_resize  # the wrapper is gone after the tracker exits


def test_tracker_labels_and_peak_breakdown():
    w = torch.randn(100, 100, requires_grad=True)   # exists before: counted only through track()
    with LiveStorageTracker() as mem:
        assert mem.track(w, label="params") == 40000
        mem.reset_peak()
        with mem.label("activations"):
            h = w @ w                               # 40000
            big = torch.empty(50_000)               # 200000: the peak
            del big
            h.sum().backward()
        # the gradient was allocated under "activations"; relabelling it changes the peak breakdown too
        mem.relabel(w.grad, "grads")
        assert mem.peak_bytes >= 40000 + 40000 + 200000
        breakdown = mem.peak_breakdown()
        assert breakdown["params"] == 40000
        assert breakdown["activations"] >= 240000
        assert sum(breakdown.values()) == mem.peak_bytes
        assert mem.bytes_by_label()["grads"] == 40000
